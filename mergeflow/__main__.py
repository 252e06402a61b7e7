"""`python -m mergeflow`: the mergeflow command."""

import sys

from mergeflow.cli import main

sys.exit(main())

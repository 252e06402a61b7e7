"""`python -m mergeflow`: the mergeflow command."""

from mergeflow.cli import run

run()

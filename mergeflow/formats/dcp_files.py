"""The file names of a PyTorch Distributed Checkpoint (DCP) archive, which Megatron's `torch_dist` format and
torchtitan save (names only: imports no torch)."""

import re

METADATA_FILE = ".metadata"
"""Written last, after every data file: an archive without it is not complete."""
DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")

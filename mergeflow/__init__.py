"""mergeflow: turn verl's distributed checkpoints into Hugging Face models, as a Prefect pipeline.

`MergeJob(local_dir, target_dir, MergeOptions(...)).run()` merges without Prefect; the flows are in
`mergeflow.flows`, the command in `mergeflow.cli`."""

__version__ = "0.1.0"

from mergeflow.job import MergeJob
from mergeflow.options import MergeOptions

__all__ = ["MergeJob", "MergeOptions", "__version__"]

"""mergeflow: turn verl's distributed checkpoints into Hugging Face models, as a Prefect pipeline.

`MergeJob(local_dir, target_dir, MergeOptions(...)).run()` merges without Prefect; the flows are in
`mergeflow.flows`, the command in `mergeflow.cli`."""

from mergeflow.version import __version__

__all__ = ["MergeJob", "MergeOptions", "__version__"]


def __getattr__(name: str):
    """The public names, imported when first used (so that `import mergeflow` stays light)."""
    if name == "MergeJob":
        from mergeflow.job import MergeJob

        return MergeJob
    if name == "MergeOptions":
        from mergeflow.options import MergeOptions

        return MergeOptions
    raise AttributeError(f"module 'mergeflow' has no attribute {name!r}")

from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.formats.fsdp.index import ShardIndex
from mergeflow.planning import MergePlan
from mergeflow.spec.model_spec import ModelSpec
from mergeflow.validation.merged_view import MergedCheckpoint
from mergeflow.validation.validate import ValidationReport, compare_to_reference


@task(name="compare-checkpoint", cache_policy=NO_CACHE)
def compare_checkpoint(
    plan: MergePlan,
    index: ShardIndex,
    spec: ModelSpec,
    test_hf_dir: str,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> ValidationReport:
    """Compare the merged tensors, read straight from the rank files, with a reference model (nothing is written)."""
    with MergedCheckpoint(plan, index) as merged:
        report = compare_to_reference(
            merged, Path(test_hf_dir), model_dir=index.checkpoint_dir, tied=spec.tied, atol=atol, rtol=rtol
        )
        merged.verify()
    logger = get_run_logger()
    if report.passed:
        logger.info("%d tensors equal the reference %s", report.tensors_compared, test_hf_dir)
    else:
        logger.error(report.failure_message())
    return report

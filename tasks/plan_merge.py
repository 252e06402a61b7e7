from prefect import get_run_logger

from mergeflow.job import MergeJob, PlanMade
from mergeflow.tasks.cache import merge_step


@merge_step("plan-merge")
def plan_merge(job: MergeJob, *, replace: bool = False) -> PlanMade:
    """Check the target, then resolve every tensor against the config: names, shapes, dtype, ties, files."""
    plan = job.plan(replace=replace)
    logger = get_run_logger()
    logger.info(
        "%d tensors, %d bytes in %d weight file(s), dtype %s", plan.tensors, plan.total_size, len(plan.weight_files), plan.dtype
    )
    if plan.dropped_aliases:
        logger.info("tied aliases not written: %s", ", ".join(sorted(plan.dropped_aliases)))
    if plan.unexpected:
        logger.warning("tensors the config's model does not declare (written anyway): %s", ", ".join(plan.unexpected))
    return plan

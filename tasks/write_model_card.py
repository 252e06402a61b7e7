from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.output.model_card import MergeFacts, write_model_card


@task(name="write-model-card", cache_policy=NO_CACHE)
def write_card(target_dir: str, facts: MergeFacts) -> str | None:
    """README.md with the merge's facts, unless the checkpoint brought its own model card."""
    path = write_model_card(Path(target_dir), facts)
    logger = get_run_logger()
    if path is None:
        logger.info("kept the checkpoint's README.md as the model card")
        return None
    logger.info("wrote the model card %s", path)
    return str(path)

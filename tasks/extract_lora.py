from prefect import get_run_logger

from mergeflow.job import LoraFound, MergeJob
from mergeflow.tasks.cache import merge_step


@merge_step("extract-lora")
def extract_lora(job: MergeJob) -> LoraFound:
    """Find LoRA tensors among the shards and rebuild the adapter's PEFT config (to write as an adapter, or fold in)."""
    lora = job.extract_lora()
    logger = get_run_logger()
    logger.info(lora.description or "no LoRA tensors")
    for note in lora.notes:
        logger.warning(note)
    return lora

from prefect import get_run_logger

from mergeflow.job import CheckpointFound, LoraFound, MergeJob
from mergeflow.output.manifest import SavedModel
from mergeflow.tasks.cache import merge_step
from mergeflow.validation.report import ValidationReport


@merge_step("write-model-card")
def write_model_card(
    job: MergeJob, saved: SavedModel, report: ValidationReport, checkpoint: CheckpointFound, lora: LoraFound | None
) -> str | None:
    """README.md with the merge's facts, unless the checkpoint brought its own model card."""
    path = job.write_model_card(saved, report, checkpoint, lora)
    get_run_logger().info("wrote the model card" if path else "kept the checkpoint's README.md as the model card")
    return path

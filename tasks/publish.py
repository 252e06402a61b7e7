import hashlib
import re
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from mergeflow.job import CheckpointFound, MergeJob, MergeSteps
from mergeflow.output.manifest import SavedModel
from mergeflow.tasks.cache import merge_step
from mergeflow.validation.report import ValidationReport

KEY_PATH_PARTS = 3
KEY_MAX_LENGTH = 90


@merge_step("publish")
def publish(
    job: MergeJob,
    saved: SavedModel,
    report: ValidationReport,
    checkpoint: CheckpointFound,
    merged: MergeSteps | None = None,
    *,
    replace: bool = False,
) -> SavedModel:
    """Rename the validated staging folder into place as the target (a folder that failed validation is not
    published), and publish a summary and the largest differences as artifacts; return the target's manifest.
    `merged`: what the merge's steps found (None for a checkpoint that held the Hugging Face model)."""
    published = job.publish(saved, report, replace=replace)
    get_run_logger().info("published %s", published.folder)
    create_markdown_artifact(
        key=artifact_key("merge-summary", checkpoint.checkpoint_dir, published.folder),
        markdown=summary_markdown(checkpoint, merged, published, report),
        description=f"mergeflow: {checkpoint.checkpoint_dir}",
    )
    create_table_artifact(
        key=artifact_key("merge-differences", checkpoint.checkpoint_dir, published.folder),
        table=[
            {
                "tensor": d.name,
                "dtype": d.dtype,
                "shape": str(d.shape),
                "max_abs_diff": d.max_abs_diff,
                "mismatched": d.mismatched,
                "max_relative_error": d.max_relative_error,
            }
            for d in report.largest_differences
        ],
        description="Largest differences from the reference, and each FP8 weight's largest relative rounding error",
    )
    return published


def artifact_key(kind: str, checkpoint_dir: str, target_dir: str) -> str:
    """A key stable per checkpoint and target (`merge-summary-run-a-global-step-120-actor-1a2b3c4d`, the digest
    of both paths), so runs of the same merge can be compared in the UI and merges of one checkpoint into two
    targets keep a summary each."""
    absolute = str(Path(checkpoint_dir).absolute())
    tail = "-".join(Path(absolute).parts[-KEY_PATH_PARTS:])
    slug = re.sub(r"[^a-z0-9]+", "-", tail.lower()).strip("-")
    digest = hashlib.sha1(f"{absolute}\0{Path(target_dir).absolute()}".encode()).hexdigest()[:8]
    return f"{kind}-{slug}"[: KEY_MAX_LENGTH - len(digest) - 1].rstrip("-") + f"-{digest}"


def summary_markdown(
    checkpoint: CheckpointFound, merged: MergeSteps | None, saved: SavedModel, report: ValidationReport
) -> str:
    rows = [
        ("source", f"`{checkpoint.checkpoint_dir}`"),
        ("backend", checkpoint.backend),
        ("world size", str(checkpoint.world_size)),
        ("dtype", saved.dtype),
        ("tensors", f"{saved.num_tensors} in {len(saved.weight_files)} file(s), {saved.total_size:,} bytes"),
        ("output", f"`{saved.folder}`"),
        ("time", f"{saved.seconds:.1f} s"),
        ("reference", f"`{report.reference_dir}`" if report.reference_dir else "none"),
        ("validation", "passed" if report.passed else "**failed**"),
    ]
    if merged is not None:
        facts = merged.shards.facts
        rows[3:3] = [(name.replace("_", " "), str(value)) for name, value in facts.items() if value is not None]
        rows.append(("parameters", f"{merged.plan.parameters:,}"))
        if merged.lora.description is not None:
            rows.append(("LoRA", merged.lora.description))
    if report.logits is not None:
        rows.append(("logits", report.logits.message))
    lines = [f"# Merge of `{checkpoint.checkpoint_dir}`", "", "| | |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += ["", "## Files", "", "| file | bytes |", "| --- | ---: |"]
    lines += [f"| {file.name} | {file.size:,} |" for file in saved.files]
    if report.problems:
        lines += ["", "## Problems", ""] + [f"- {problem}" for problem in report.problems]
    return "\n".join(lines) + "\n"

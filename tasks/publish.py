import hashlib
import math
import re
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from mergeflow.job import MergeJob
from mergeflow.output.manifest import SavedModel
from mergeflow.tasks.cache import merge_step
from mergeflow.validation.report import ValidationReport

KEY_PATH_PARTS = 3
KEY_MAX_LENGTH = 90


@merge_step("publish")
def publish(
    job: MergeJob, saved: SavedModel, report: ValidationReport, card: str | None, *, replace: bool = False
) -> SavedModel:
    """Rename the validated staging folder into place as the target (a folder that failed validation is not
    published), and publish a summary and the largest differences as artifacts; return the target's manifest."""
    published = job.publish(saved, report, replace=replace)
    get_run_logger().info("published %s", published.target_dir)
    checkpoint_dir = job.layout().checkpoint_dir
    create_markdown_artifact(
        key=artifact_key("merge-summary", checkpoint_dir, published.target_dir),
        markdown=summary_markdown(job, published, report),
        description=f"mergeflow: {checkpoint_dir}",
    )
    create_table_artifact(
        key=artifact_key("merge-differences", checkpoint_dir, published.target_dir),
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


def summary_markdown(job: MergeJob, saved: SavedModel, report: ValidationReport) -> str:
    from mergeflow.lora import describe_lora

    layout = job.layout()
    rows = [
        ("source", f"`{layout.checkpoint_dir}`"),
        ("backend", job.options.backend),
        ("world size", str(layout.world_size)),
        ("dtype", saved.dtype),
        ("tensors", f"{saved.num_tensors} in {len(saved.weight_files)} file(s), {saved.total_size:,} bytes"),
        ("output", f"`{saved.target_dir}`"),
        ("time", f"{saved.seconds:.1f} s"),
        ("reference", f"`{report.reference_dir}`" if report.reference_dir else "none"),
        ("validation", "passed" if report.passed else "**failed**"),
    ]
    if layout.model_dir is None:
        plan, _ = job.merge_plan()
        facts = job.index().facts()
        rows[3:3] = [(name.replace("_", " "), str(value)) for name, value in facts.items() if value is not None]
        if plan is not None:
            rows.append(("parameters", f"{sum(math.prod(t.shape) for t in plan.tensors.values()):,}"))
        if job.lora() is not None:
            rows.append(("LoRA", describe_lora(job.lora())))
    if report.logits is not None:
        rows.append(("logits", report.logits.message))
    lines = [f"# Merge of `{layout.checkpoint_dir}`", "", "| | |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += ["", "## Files", "", "| file | bytes |", "| --- | ---: |"]
    lines += [f"| {file.name} | {file.size:,} |" for file in saved.files]
    if report.problems:
        lines += ["", "## Problems", ""] + [f"- {problem}" for problem in report.problems]
    return "\n".join(lines) + "\n"

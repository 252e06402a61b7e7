import hashlib
import math
import re
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from mergeflow.formats.fsdp.index import ShardIndex
from mergeflow.lora import LoraPlan, describe_lora
from mergeflow.output.manifest import SavedModel
from mergeflow.planning import MergePlan
from mergeflow.validation.validate import ValidationReport

KEY_PATH_PARTS = 3
KEY_MAX_LENGTH = 90


def artifact_key(kind: str, checkpoint_dir: str) -> str:
    """A key stable per checkpoint (`merge-summary-run-a-global-step-120-actor-1a2b3c4d`), so runs on the
    same checkpoint can be compared in the UI."""
    absolute = str(Path(checkpoint_dir).absolute())
    tail = "-".join(Path(absolute).parts[-KEY_PATH_PARTS:])
    slug = re.sub(r"[^a-z0-9]+", "-", tail.lower()).strip("-")
    digest = hashlib.sha1(absolute.encode()).hexdigest()[:8]
    return f"{kind}-{slug}"[: KEY_MAX_LENGTH - len(digest) - 1].rstrip("-") + f"-{digest}"


@task(name="publish-report", cache_policy=NO_CACHE)
def publish_report(
    index: ShardIndex,
    plan: MergePlan,
    report: ValidationReport,
    *,
    saved: SavedModel | None,
    seconds: float,
    lora: LoraPlan | None = None,
) -> None:
    """A markdown summary and a table of the largest per-tensor differences, as Prefect artifacts."""
    create_markdown_artifact(
        key=artifact_key("merge-summary", index.checkpoint_dir),
        markdown=summary_markdown(index, plan, report, saved=saved, seconds=seconds, lora=lora),
        description=f"mergeflow: {index.checkpoint_dir}",
    )
    create_table_artifact(
        key=artifact_key("merge-differences", index.checkpoint_dir),
        table=[
            {
                "tensor": d.name,
                "dtype": d.dtype,
                "shape": str(d.shape),
                "max_abs_diff": d.max_abs_diff,
                "mismatched": d.mismatched,
            }
            for d in report.largest_differences
        ],
        description="Largest differences from the reference (empty without one)",
    )


def summary_markdown(
    index: ShardIndex,
    plan: MergePlan,
    report: ValidationReport,
    *,
    saved: SavedModel | None,
    seconds: float,
    lora: LoraPlan | None = None,
) -> str:
    parameters = sum(math.prod(tensor.shape) for tensor in plan.tensors.values())
    verdict = "passed" if report.passed else "**failed**"
    lines = [
        f"# Merge of `{index.checkpoint_dir}`",
        "",
        "| | |",
        "| --- | --- |",
        f"| source | `{index.checkpoint_dir}` |",
        f"| world size | {index.world_size} |",
        f"| mesh | {index.mesh_shape} {index.mesh_dim_names or ''} |",
        f"| dtype | {plan.config_dtype} |",
        f"| parameters | {parameters:,} |",
        f"| tensors | {len(plan.tensors)} in {len(plan.shard_to_names)} file(s), {plan.total_size:,} bytes |",
        f"| output | `{saved.target_dir}` |" if saved else "| output | none (compared in place) |",
        f"| time | {seconds:.1f} s" + (f" (writing {saved.seconds:.1f} s)" if saved else "") + " |",
        f"| reference | `{report.reference_dir}` |" if report.reference_dir else "| reference | none |",
        f"| validation | {verdict} |",
    ]
    if lora is not None:
        lines.append(f"| LoRA | {describe_lora(lora)} |")
    if report.logits is not None:
        lines.append(f"| logits | {report.logits.message} |")
    if saved:
        lines += ["", "## Files", "", "| file | bytes |", "| --- | ---: |"]
        lines += [f"| {file.name} | {file.size:,} |" for file in saved.files]
    if report.problems:
        lines += ["", "## Problems", ""] + [f"- {problem}" for problem in report.problems]
    return "\n".join(lines) + "\n"

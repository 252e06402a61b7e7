import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed

from mergeflow.formats.fsdp.index import ShardIndex
from mergeflow.output.manifest import SavedModel
from mergeflow.output.save import ShardWritten, describe_output, write_model_files
from mergeflow.planning import AdapterPlan, MergePlan
from mergeflow.spec.model_spec import ModelSpec
from mergeflow.tasks.publish_report import artifact_key
from mergeflow.tasks.write_shard import write_shard


@task(name="save", cache_policy=NO_CACHE)
def save(
    plan: MergePlan | None,
    index: ShardIndex,
    spec: ModelSpec,
    staging_dir: str,
    target_dir: str,
    *,
    adapter: AdapterPlan | None = None,
    progress: bool = True,
) -> SavedModel:
    """Write the model folder into the staging directory: each weight shard as its own task run (in
    parallel on the flow's task runner, a Dask cluster included), then the index, config, side files and
    the LoRA adapter. The manifest it returns describes the staging directory."""
    started = time.monotonic()
    staging = Path(staging_dir)
    written = write_shards(plan, index, staging_dir, progress=progress) if plan is not None else []
    write_model_files(plan, index, spec, staging, Path(target_dir), adapter=adapter, progress=False)
    saved = describe_output(plan, adapter, staging, written, seconds=time.monotonic() - started)
    resumed = sum(shard.resumed for shard in written)
    get_run_logger().info(
        "wrote %d files, %d bytes of weights in %.1fs%s",
        len(saved.files),
        saved.total_size,
        saved.seconds,
        f" ({resumed} weight file(s) kept from earlier: written while the config was read or by an interrupted run)" if resumed else "",
    )
    return saved


def write_shards(plan: MergePlan, index: ShardIndex, staging_dir: str, *, progress: bool) -> list[ShardWritten]:
    """Submit one `write-shard` task per output file, and report progress as an artifact while they finish."""
    progress_id = create_progress_artifact(
        progress=0.0,
        key=artifact_key("merge-progress", index.checkpoint_dir),
        description=f"shards written for {index.checkpoint_dir}",
    )
    futures = [
        write_shard.submit(plan, index, staging_dir, filename, progress=progress)
        for filename in plan.shard_to_names
    ]
    written = []
    for future in as_completed(futures):
        written.append(future.result())
        update_progress_artifact(progress_id, progress=100.0 * len(written) / len(futures))
    return sorted(written, key=lambda shard: shard.name)

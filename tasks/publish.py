import dataclasses
import time
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.output.manifest import SavedModel, describe_files
from mergeflow.output.save import relocated
from mergeflow.output.staging import publish as publish_folder
from mergeflow.run_layout import Protected


@task(name="publish", cache_policy=NO_CACHE)
def publish(saved: SavedModel, target_dir: str, *, overwrite: bool, protected: tuple[Protected, ...] = ()) -> SavedModel:
    """Rename the validated staging directory into place as the target; return the target's manifest."""
    staging = Path(saved.target_dir)
    digests = {file.name: file.sha256 for file in saved.files}
    described = dataclasses.replace(saved, files=describe_files(staging, digests))
    started = time.monotonic()
    publish_folder(staging, Path(target_dir), overwrite=overwrite, protected=protected)
    get_run_logger().info("published %s in %.2fs", target_dir, time.monotonic() - started)
    return relocated(described, Path(target_dir).absolute())

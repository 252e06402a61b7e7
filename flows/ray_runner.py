"""Prefect's Ray task runner, leaving this process's Ray as it found it when starting fails: a `ray.init` that
fails part way (a Ray Client server that did not start, a local node that did not come up) otherwise leaves
state behind that fails every later `ray.init` of the process, and the local node's agents running."""

import ray
from prefect_ray import RayTaskRunner


class RayTaskRunnerShutDownOnFailure(RayTaskRunner):
    def __enter__(self) -> "RayTaskRunnerShutDownOnFailure":
        try:
            return super().__enter__()
        except BaseException:
            ray.shutdown()
            raise

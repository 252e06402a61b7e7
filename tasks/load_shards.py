from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.formats.fsdp.index import ShardIndex, index_shards
from mergeflow.formats.fsdp.layout import RankFiles
from mergeflow.formats.megatron.index import MegatronIndex, index_megatron
from mergeflow.formats.megatron.layout import MegatronLayout
from mergeflow.spec.model_spec import ModelSpec


@task(name="load-shards", cache_policy=NO_CACHE)
def load_shards(source: RankFiles | MegatronLayout, spec: ModelSpec) -> ShardIndex | MegatronIndex:
    """Read the shards' metadata (FSDP rank files memory-mapped with weights_only, or a Megatron archive's
    `.metadata` mapped onto HF names); tensor data stays on disk."""
    logger = get_run_logger()
    if isinstance(source, MegatronLayout):
        index = index_megatron(source, spec)
        logger.info("%d HF tensors from %d stored tensors, TP=%s", len(index.tensors), len(index.stored), index.tensor_parallel)
        return index
    index = index_shards(source)
    logger.info("%d tensors on mesh %s %s", len(index.tensors), index.mesh_shape, index.mesh_dim_names or "(plain tensors)")
    return index

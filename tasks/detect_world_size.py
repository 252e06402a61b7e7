from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.formats.fsdp.layout import RankFiles
from mergeflow.formats.megatron.layout import MegatronLayout
from mergeflow.preflight import find_checkpoint


@task(name="detect-world-size", cache_policy=NO_CACHE)
def detect_world_size(local_dir: str, backend: str = "fsdp") -> RankFiles | MegatronLayout:
    """FSDP: find the rank files and check that every rank 0..W-1 is present, and no other.
    Megatron: find the `dist_ckpt/` archive and its `huggingface/` folder in either of verl's layouts."""
    logger = get_run_logger()
    checkpoint = find_checkpoint(local_dir, backend)
    if isinstance(checkpoint, MegatronLayout):
        if checkpoint.hf_weights:
            logger.info("%s holds Hugging Face weights already (an mbridge run)", checkpoint.hf_dir)
        else:
            logger.info("torch_dist archive %s, config in %s", checkpoint.dist_ckpt_dir, checkpoint.hf_dir)
        return checkpoint
    logger.info("world size %d: %d rank files in %s", checkpoint.world_size, len(checkpoint.paths), local_dir)
    return checkpoint

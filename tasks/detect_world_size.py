from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.fsdp_layout import RankFiles, find_rank_files
from mergeflow.megatron_layout import MegatronLayout, find_megatron_checkpoint


@task(name="detect-world-size", cache_policy=NO_CACHE)
def detect_world_size(local_dir: str, backend: str = "fsdp") -> RankFiles | MegatronLayout:
    """FSDP: find the rank files and check that every rank 0..W-1 is present, and no other.
    Megatron: find the `dist_ckpt/` archive and its `huggingface/` folder in either of verl's layouts."""
    logger = get_run_logger()
    if backend == "megatron":
        layout = find_megatron_checkpoint(Path(local_dir))
        if layout.hf_weights:
            logger.info("%s holds Hugging Face weights already (an mbridge run)", layout.hf_dir)
        else:
            logger.info("torch_dist archive %s, config in %s", layout.dist_ckpt_dir, layout.hf_dir)
        return layout
    rank_files = find_rank_files(Path(local_dir))
    logger.info("world size %d: %d rank files in %s", rank_files.world_size, len(rank_files.paths), local_dir)
    return rank_files


def default_config_dir_of(source: RankFiles | MegatronLayout) -> str | None:
    """Where the checkpoint keeps its HF config: None means `<local_dir>/huggingface` (FSDP)."""
    return source.hf_dir if isinstance(source, MegatronLayout) else None

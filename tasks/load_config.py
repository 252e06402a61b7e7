from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.formats.fsdp.layout import default_config_dir
from mergeflow.spec.model_spec import ModelSpec, load_model_spec


@task(name="load-config", cache_policy=NO_CACHE)
def load_config(
    local_dir: str,
    hf_model_config_path: str | None = None,
    *,
    trust_remote_code: bool = False,
    is_value_model: bool = False,
    tie_word_embedding: bool = False,
) -> ModelSpec:
    """Read the Hugging Face config saved with the checkpoint (or given explicitly) into a model spec."""
    config_dir = Path(hf_model_config_path) if hf_model_config_path else default_config_dir(Path(local_dir))
    spec = load_model_spec(
        config_dir,
        trust_remote_code=trust_remote_code,
        is_value_model=is_value_model,
        tie_word_embedding=tie_word_embedding,
    )
    tied = ", ".join(f"{alias} -> {kept}" for alias, kept in spec.tied.items()) or "none"
    get_run_logger().info(
        "%s from %s: %d tensors expected, tied: %s",
        spec.model_class,
        config_dir,
        len(spec.expected_shapes),
        tied,
    )
    return spec

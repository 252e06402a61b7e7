"""One rank of the VeOmni fixture writer, run in the VeOmni venv (`tests.side_venvs.VEOMNI`) by
`mergeflow.demo.ranks`: builds the model as verl's VeOmni engine does (`workers/engine/veomni/transformer_impl.py`)
and saves it with verl's own `FSDPCheckpointManager`, as that engine does."""

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

VERL_ENVIRONMENT = {"VERL_USE_EXTERNAL_MODULES": "tests.writers.verl_cpu", "VERL_PLATFORM": "cpu"}
"""verl's plugin hook loads the CPU platform (`tests.writers.verl_cpu`), and verl uses it."""


def eager_ops():
    """VeOmni's kernels as eager PyTorch (its defaults need triton and CUDA), quantization-aware training off."""
    from veomni.arguments import OpsImplementationConfig

    return OpsImplementationConfig(
        **{
            field.name: "none" if field.name == "qat_implementation" else "eager"
            for field in dataclasses.fields(OpsImplementationConfig)
        }
    )


def build_model(job: dict):
    """The reference model on VeOmni's meshes: FSDP2 over `dp_shard` (`dp_shard_sp` with Ulysses; HSDP with
    `replicas`), experts split over `expert_parallel` groups, weights loaded from the reference on rank 0 and
    broadcast."""
    from veomni.arguments import MixedPrecisionConfig
    from veomni.distributed import parallel_state
    from veomni.distributed.torch_parallelize import build_parallelize_model
    from veomni.models.auto import build_foundation_model

    data_parallel = dist.get_world_size() // job["ulysses"]
    parallel_state.init_parallel_state(
        dp_size=data_parallel,
        dp_replicate_size=job["replicas"],
        dp_shard_size=data_parallel // job["replicas"],
        ulysses_size=job["ulysses"],
        extra_parallel_sizes=(job["expert_parallel"],),
        dp_mode="fsdp2",
        device_type="cpu",
    )
    reference = job["reference_dir"]
    model = build_foundation_model(
        config_path=reference,
        weights_path=reference,
        torch_dtype="float32",
        attn_implementation="eager",
        ops_implementation=eager_ops(),
        init_device="meta",
    )
    return build_parallelize_model(
        model,
        init_device="meta",
        weights_path=reference,
        enable_full_shard=True,
        mixed_precision=MixedPrecisionConfig(enable=False),
        enable_gradient_checkpointing=False,
        basic_modules=list(getattr(model, "_no_split_modules", None) or []),
        broadcast_model_weights_from_rank0=True,
    )


def save(model, job: dict) -> None:
    """verl's FSDP checkpoint manager's save: rank files, extra state, `fsdp_config.json`, `huggingface/`."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    contents = list(job["save_contents"])
    manager = FSDPCheckpointManager(
        model=model,
        processing_class=AutoTokenizer.from_pretrained(job["reference_dir"]),
        checkpoint_config=OmegaConf.create({"save_contents": contents, "load_contents": contents}),
    )
    manager.save_checkpoint(local_path=job["checkpoint_dir"], global_step=job["step"])


def main() -> None:
    os.environ.update(VERL_ENVIRONMENT)
    job = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    try:
        save(build_model(job), job)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

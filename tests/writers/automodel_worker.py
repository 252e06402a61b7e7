"""One rank of the Automodel fixture writer, run in the nemo-automodel venv (`tests.side_venvs.AUTOMODEL`) by
`mergeflow.demo.ranks`: the reference model sharded with torch FSDP2, then saved by nemo-automodel's own
`Checkpointer`, configured as verl's Automodel engine configures it (`workers/engine/automodel/transformer_impl.py`:
safetensors, consolidated), model then optimizer, as the engine's `save_checkpoint` calls them."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def sharded_model(reference: str) -> torch.nn.Module:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = transformers.AutoConfig.from_pretrained(reference)
    model = getattr(transformers, config.architectures[0]).from_pretrained(reference, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def save(model: torch.nn.Module, job: dict) -> None:
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer, CheckpointingConfig

    config = CheckpointingConfig(
        enabled=True,
        checkpoint_dir="checkpoints/",
        model_save_format="safetensors",
        model_cache_dir=job["hf_home"],
        model_repo_id=job["reference_dir"],
        save_consolidated=True,
        is_peft=False,
    )
    checkpointer = Checkpointer(config=config, dp_rank=dist.get_rank(), tp_rank=0, pp_rank=0, moe_mesh=None)
    checkpointer.save_model(model, job["checkpoint_dir"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    checkpointer.save_optimizer(optimizer, model, job["checkpoint_dir"], scheduler=None)


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    os.environ["HF_HOME"] = job["hf_home"]  # nothing of the user's Hugging Face cache is read or written
    dist.init_process_group("gloo")
    try:
        save(sharded_model(job["reference_dir"]), job)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

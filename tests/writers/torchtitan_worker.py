"""One rank of the TorchTitan fixture writer, run in the torchtitan venv (`tests.side_venvs.TORCHTITAN`) by
`mergeflow.demo.ranks`. verl 0.9.1's TorchTitan engine does not import against torchtitan 0.3.0, so the engine's
part is done here as it does it: the model is built from torchtitan's own config builders (Qwen3, Llama 3), the
reference weights are loaded through torchtitan's own state-dict adapter (`from_hf`), the model is sharded with torch FSDP2, and
torchtitan's own `CheckpointManager` (with its optimizer and LR-scheduler containers) saves the step into the folder
verl's engine points it at (`global_step_N/`, which makes `global_step_N/step-N/`)."""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import load_file


def rope(hf: dict, rope_class, head_dim: int):
    return rope_class.Config(dim=head_dim, max_seq_len=hf["max_position_embeddings"], theta=hf["rope_parameters"]["rope_theta"])


def qwen3_config(hf: dict):
    """torchtitan's Qwen3 config of the reference's shape (dense, or MoE when it has experts)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_SKIP_INIT,
        _LINEAR_INIT,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )
    from torchtitan.models.qwen3.model import Qwen3Model

    dim, head_dim, vocab = hf["hidden_size"], hf["head_dim"], hf["vocab_size"]
    shape = {
        "n_layers": hf["num_hidden_layers"],
        "dim": dim,
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf["num_key_value_heads"],
        "head_dim": head_dim,
        "attn_backend": "flex",
        "rope": rope(hf, CosSinRoPE, head_dim),
    }
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    if experts:
        layers = _build_qwen3_moe_layers(
            **shape,
            moe_hidden_dim=hf["moe_intermediate_size"],
            num_experts=experts,
            top_k=hf["num_experts_per_tok"],
            moe_comm_backend="standard",
        )
    else:
        layers = _build_qwen3_layers(**shape, hidden_dim=hf["intermediate_size"])
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=hf["tie_word_embeddings"],
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )


def llama3_config(hf: dict):
    """torchtitan's Llama 3 config of the reference's shape (complex RoPE, no scaling)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _LINEAR_INIT, _NORM_INIT, _build_llama3_layers
    from torchtitan.models.llama3.model import Llama3Model

    dim, heads, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=hf["tie_word_embeddings"],
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=_build_llama3_layers(
            n_layers=hf["num_hidden_layers"],
            dim=dim,
            n_heads=heads,
            n_kv_heads=hf["num_key_value_heads"],
            hidden_dim=hf["intermediate_size"],
            rope=rope(hf, ComplexRoPE, dim // heads),
            attn_backend="flex",
        ),
    )


def config_and_adapter(hf: dict):
    """torchtitan's model config of the reference, and its own state-dict adapter class, by `model_type`."""
    if hf["model_type"] == "llama":
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

        return llama3_config(hf), Llama3StateDictAdapter
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    return qwen3_config(hf), Qwen3StateDictAdapter


def loaded_model(reference: Path):
    """The reference model as torchtitan's, its weights converted by torchtitan's own adapter; and the adapter."""
    config, adapter_class = config_and_adapter(json.loads((reference / "config.json").read_text()))
    model = config.build()
    adapter = adapter_class(config, str(reference))
    weights = {name: tensor for path in sorted(reference.glob("*.safetensors")) for name, tensor in load_file(path).items()}
    model.load_state_dict(adapter.from_hf(weights), strict=False)  # leaves the load-balancing bias at zero
    return model, adapter


def sharded(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def save(model, adapter, folder: str, step: int) -> None:
    """torchtitan's checkpoint save of model, optimizer and LR scheduler, as verl's engine calls it."""
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    optimizer_config = default_adamw()
    optimizer_config.implementation = "for-loop"  # the fused one needs CUDA
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=step)
    checkpointer = CheckpointManager(
        CheckpointManager.Config(enable=True, interval=1),
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={},
        sd_adapter=adapter,
    )
    checkpointer.folder = folder
    checkpointer.save(curr_step=step)


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    try:
        for job in jobs:
            model, adapter = loaded_model(Path(job["reference_dir"]))
            save(sharded(model), adapter, job["folder"], job["step"])
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

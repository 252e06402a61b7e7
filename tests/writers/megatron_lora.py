"""A Megatron LoRA run's checkpoint, as verl saves it with Megatron-Bridge's PEFT, in the layout derived from
Megatron-Bridge's source (it needs Python 3.12 and cannot run here).

Megatron-Bridge's `LoRALinear` wraps each of a layer's linear modules (`linear_qkv`, `linear_proj`, `linear_fc1`,
`linear_fc2`) and saves its adapter beside the weight it adapts: `….linear_qkv.adapter.linear_in.weight` (PEFT's
lora_A, one for all the modules a fused layer feeds: q, k and v; gate and up) and `….adapter.linear_out.weight`
(lora_B, its rows in the layer's own layout: [q, k, v] per query group, gate then up), stacked over layers as the
layer's weights are. verl saves them with the model (`model/dist_ckpt/` holding both), or alone beside a PEFT
folder that Megatron-Bridge exports (`ckpt_contents.json`'s `peft_adapters`, and `model/huggingface/adapter/`).
The archive is written by torch DCP's own writer; the base model's tensors come from a fixture megatron-core wrote.
"""

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint
from peft import PeftModel

from mergeflow.demo.fsdp import TRACKER_FILE
from mergeflow.demo.models import tiny_lora
from mergeflow.formats.dcp import read_metadata, read_slice
from tests.writers.megatron import MegatronFixture, fused_qkv

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Megatron-Bridge's default LoRA targets (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`), by HF name."""
SHARED_LORA_A = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
"""Modules whose lora_A is another's: a fused layer has one `linear_in`."""


def trained_lora(fixture: MegatronFixture, *, rank: int, alpha: int, seed: int) -> PeftModel:
    """The fixture's model with a LoRA of Megatron-Bridge's shape: every linear layer adapted, with the lora_A of a
    fused layer's modules shared."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(fixture.reference_dir, dtype=torch.float32)
    model = tiny_lora(base, {"r": rank, "lora_alpha": alpha, "target_modules": TARGET_MODULES}, seed=seed)
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            modules = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
            for module, owner in SHARED_LORA_A.items():
                modules[module].lora_A["default"].weight.copy_(modules[owner].lora_A["default"].weight)
    return model


def adapter_tensors(model: PeftModel) -> dict[str, torch.Tensor]:
    """The LoRA's tensors under Megatron-Bridge's keys, each stacked over layers."""
    config = model.base_model.model.config

    def lora(module, side: str) -> torch.Tensor:
        return getattr(module, side)["default"].weight.detach().clone()

    per_layer: dict[str, list[torch.Tensor]] = {}
    for layer in model.base_model.model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        tensors = {
            "self_attention.linear_qkv.adapter.linear_in.weight": lora(attention.q_proj, "lora_A"),
            "self_attention.linear_qkv.adapter.linear_out.weight": fused_qkv(
                *(lora(getattr(attention, f"{p}_proj"), "lora_B") for p in "qkv"), config.num_key_value_heads
            ),
            "self_attention.linear_proj.adapter.linear_in.weight": lora(attention.o_proj, "lora_A"),
            "self_attention.linear_proj.adapter.linear_out.weight": lora(attention.o_proj, "lora_B"),
            "mlp.linear_fc1.adapter.linear_in.weight": lora(mlp.gate_proj, "lora_A"),
            "mlp.linear_fc1.adapter.linear_out.weight": torch.cat([lora(mlp.gate_proj, "lora_B"), lora(mlp.up_proj, "lora_B")]),
            "mlp.linear_fc2.adapter.linear_in.weight": lora(mlp.down_proj, "lora_A"),
            "mlp.linear_fc2.adapter.linear_out.weight": lora(mlp.down_proj, "lora_B"),
        }
        for key, tensor in tensors.items():
            per_layer.setdefault(key, []).append(tensor)
    return {f"decoder.layers.{key}": torch.stack(layers) for key, layers in per_layer.items()}


def write_lora_run(fixture: MegatronFixture, model: PeftModel, run_dir: Path, *, with_model: bool) -> Path:
    """A verl 0.9 checkpoint of the LoRA run under `run_dir`: `with_model`, the model's archive with the adapters
    in it; otherwise the adapters' archive alone, with the PEFT folder Megatron-Bridge exports. Returns the
    checkpoint directory (`global_step_1/actor`)."""
    checkpoint_dir = run_dir / "global_step_1" / "actor"
    hf_dir = checkpoint_dir / "model" / "huggingface"
    shutil.copytree(fixture.model_dir / "huggingface", hf_dir)
    state = adapter_tensors(model)
    if with_model:
        archive = fixture.model_dir / "dist_ckpt"
        state |= {key: read_slice(archive, entry) for key, entry in read_metadata(archive).items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it saves from one process
        torch.distributed.checkpoint.save(state, checkpoint_id=checkpoint_dir / "model" / "dist_ckpt", no_dist=True)
    contents = {"hf_config": {"path": "model/huggingface", "format": "huggingface"}}
    if with_model:
        contents["model"] = {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint"}
    else:
        model.save_pretrained(hf_dir / "adapter")
        contents["model"] = {
            "path": "model/huggingface",
            "format": "huggingface",
            "backend": "mbridge",
            "peft_adapter_path": "model/huggingface/adapter",
        }
        contents["peft_adapters"] = {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint"}
    manifest = {
        "schema_version": 2,
        "framework": "megatron",
        "backend": {"has_bridge": True, "use_dist_checkpointing": with_model, "peft": True},
        "contents": contents,
    }
    (checkpoint_dir / "ckpt_contents.json").write_text(json.dumps(manifest, indent=2))
    (run_dir / TRACKER_FILE).write_text("1")
    return checkpoint_dir

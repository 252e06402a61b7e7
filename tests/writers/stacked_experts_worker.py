"""One rank of the writer of FSDP checkpoints whose MoE experts are stacked one projection per tensor, as VeOmni's
models hold them under transformers 4 (`mlp.experts.gate_proj` and `up_proj`, each (experts, ffn, hidden), and
`down_proj`, (experts, hidden, ffn): VeOmni 0.1.4's `Qwen3MoeExperts`). The layout is derived from that source:
VeOmni 0.1.4 (transformers 4.57) was tried in a venv of its own and does not import without CUDA (its grouped-GEMM
kernels query the device at import). The model is the reference, its fused `gate_up_proj` split into the two halves
it fuses, sharded and saved by real torch FSDP2 as `mergeflow.demo.fsdp_worker` does."""

import os

import torch

from mergeflow.demo.fsdp_worker import load_model, main_over, save_sharded

FUSED = "gate_up_proj"
HALVES = ("gate_proj", "up_proj")


def stack_halves_apart(model: torch.nn.Module) -> None:
    """Replace every experts module's fused `gate_up_proj` by its gate and up halves, stacked per expert."""
    for module in model.modules():
        fused = module._parameters.get(FUSED)
        if fused is None or fused.dim() != 3:
            continue
        del module._parameters[FUSED]
        for half, rows in zip(HALVES, fused.data.chunk(2, dim=1), strict=True):
            module.register_parameter(half, torch.nn.Parameter(rows.contiguous()))


def write_checkpoint(job: dict, rank: int, world_size: int) -> None:
    model = load_model(job)
    stack_halves_apart(model)
    save_sharded(model, job, rank, world_size)


def main() -> None:
    main_over(write_checkpoint)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

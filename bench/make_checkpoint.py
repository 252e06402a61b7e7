"""Write a large verl-layout FSDP checkpoint fast: random weights as real DTensor shards, W gloo ranks.

    python -m bench.make_checkpoint --model qwen2.5-1.5b --world-size 8 --out /data/bench/qwen2.5-1.5b

Each rank draws only its own Shard(0) chunks (torch.chunk semantics, as FSDP2 saves them), wraps them
with `DTensor.from_local` on a `("fsdp",)` mesh and saves its rank file the way verl does.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER_TIMEOUT_SECONDS = 3600


def write_huggingface_dir(model: str, checkpoint_dir: Path) -> None:
    from bench.shapes import qwen25_config
    from mergeflow.demo.models import tiny_tokenizer

    hf_dir = checkpoint_dir / "huggingface"
    qwen25_config(model).save_pretrained(hf_dir)
    tiny_tokenizer().save_pretrained(hf_dir)


def rank_main(model: str, checkpoint_dir: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from bench.shapes import qwen25_config, state_dict_shapes
    from mergeflow.formats.fsdp.placement import chunk_bounds

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    shapes, tied = state_dict_shapes(qwen25_config(model))
    state: dict[str, torch.Tensor] = {}
    for index, (name, shape) in enumerate(shapes):
        if name in tied:
            state[name] = state[tied[name]]
            continue
        start, stop = chunk_bounds(shape[0], world_size, rank)
        generator = torch.Generator().manual_seed(index * 1000 + rank)
        local = torch.empty([stop - start, *shape[1:]]).normal_(0.0, 0.02, generator=generator)
        stride = [1] * len(shape)
        for dim in range(len(shape) - 2, -1, -1):
            stride[dim] = stride[dim + 1] * shape[dim + 1]
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                         stride=tuple(stride))
    torch.save(state, checkpoint_dir / f"model_world_size_{world_size}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def write_checkpoint(model: str, world_size: int, checkpoint_dir: Path) -> None:
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    write_huggingface_dir(model, checkpoint_dir)
    (checkpoint_dir / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = str(Path(__file__).resolve().parent.parent)
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.make_checkpoint", "--rank-worker", "--model", model, "--out", str(checkpoint_dir)],
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": root},
        )
        for rank in range(world_size)
    ]
    codes = [process.wait(timeout=WORKER_TIMEOUT_SECONDS) for process in processes]
    if any(codes):
        raise RuntimeError(f"checkpoint writer ranks exited with {codes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_main(args.model, args.out)
    else:
        write_checkpoint(args.model, args.world_size, args.out)


if __name__ == "__main__":
    main()

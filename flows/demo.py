"""`mergeflow demo`: write a tiny real FSDP2 checkpoint (2 ranks, gloo) and run the merge flow on it."""

from pathlib import Path

import torch
import transformers

from mergeflow.demo.fsdp import FixtureSpec, write_fixtures
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.options import MergeOptions

DEMO_SPEC = FixtureSpec(name="demo", model="qwen2", world_size=2, tie=True, dtype="fp32", step=100)
DEMO_INPUT_IDS = [[2, 5, 7, 11, 13, 17, 19, 23]]


def run_demo(workdir: Path) -> bool:
    """Merge the demo checkpoint into `workdir/merged` and check its logits against the original model."""
    transformers.utils.logging.disable_progress_bar()
    workdir = Path(workdir).absolute()
    print(f"writing a 2-rank FSDP2 checkpoint under {workdir} ...")
    fixture = write_fixtures([DEMO_SPEC], workdir)["demo"]
    target = workdir / "merged"
    saved = merge_checkpoint(
        local_dir=str(fixture.checkpoint_dir), target_dir=str(target), options=MergeOptions(dtype="bf16"), overwrite=True
    )
    matches = logits_match(fixture.reference_dir, target, torch.bfloat16)
    print(f"checkpoint: {fixture.checkpoint_dir}")
    print(f"merged:     {saved.folder}")
    for file in saved.files:
        print(f"  {file.name:<40} {file.size:>10} bytes")
    return matches


def logits_match(reference_dir: Path, merged_dir: Path, dtype: torch.dtype) -> bool:
    """Whether both models give bit-identical logits on a fixed input, the original cast to `dtype`."""
    input_ids = torch.tensor(DEMO_INPUT_IDS)
    logits = []
    for directory in (reference_dir, merged_dir):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        with torch.no_grad():
            logits.append(model(input_ids).logits)
    return torch.equal(*logits)

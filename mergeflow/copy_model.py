"""A checkpoint that already holds a Hugging Face model (verl's Megatron backend with mbridge saves one in
`huggingface/`): nothing to merge, so its folder is copied byte for byte and then validated like a merge."""

import json
import shutil
import time
from collections import Counter
from pathlib import Path

from safetensors import safe_open

from mergeflow.dtypes import SAFETENSORS_CODES
from mergeflow.manifest import SavedModel, describe_files

DTYPE_OF_CODE = {code: dtype for dtype, code in SAFETENSORS_CODES.items()}


def copy_model_folder(source_dir: Path, output_dir: Path) -> SavedModel:
    """Copy every file of `source_dir` (weights, config, tokenizer and the rest) into `output_dir`."""
    started = time.monotonic()
    for path in sorted(Path(source_dir).rglob("*")):
        if path.is_file():
            destination = Path(output_dir) / path.relative_to(source_dir)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, destination)
    weight_files = sorted(path.name for path in Path(output_dir).glob("*.safetensors"))
    num_tensors, total_size, dtypes = 0, 0, Counter()
    for name in weight_files:
        with safe_open(Path(output_dir) / name, framework="pt") as weights:
            for key in weights.keys():
                tensor = weights.get_slice(key)
                dtype = DTYPE_OF_CODE[tensor.get_dtype()]
                count = 1
                for size in tensor.get_shape():
                    count *= size
                num_tensors += 1
                total_size += count * dtype.itemsize
                dtypes[str(dtype).removeprefix("torch.")] += count
    return SavedModel(
        target_dir=str(output_dir),
        files=describe_files(Path(output_dir), {}),
        weight_files=tuple(weight_files),
        total_size=total_size,
        num_tensors=num_tensors,
        dtype=_config_dtype(Path(output_dir)) or (dtypes.most_common(1)[0][0] if dtypes else "unknown"),
        seconds=time.monotonic() - started,
    )


def _config_dtype(model_dir: Path) -> str | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("dtype") or config.get("torch_dtype")

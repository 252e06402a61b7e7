"""Hugging Face model folders as tensor sources: sharded or single safetensors, or PyTorch `.bin` files.

Tensors are read a block of rows at a time (safetensors slices, memory-mapped `.bin` views), so a
comparison never holds a whole model. `completeness_problems` checks what a merge wrote.
"""

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mergeflow.dtypes import SAFETENSORS_CODES
from mergeflow.errors import CheckpointError
from mergeflow.spec.config_files import CONFIG_FILE, WEIGHT_INDEX_FILE
from mergeflow.spec.peft_names import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_SUBDIR,
    ADAPTER_WEIGHTS_FILE,
    lora_tensor_names,
)

SAFETENSORS_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
HEADER_LENGTH_BYTES = 8
DTYPE_FROM_CODE = {code: dtype for dtype, code in SAFETENSORS_CODES.items()}


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]


class SafetensorsFolder:
    """The tensors of a folder of `.safetensors` files (with or without an index)."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.files = _weight_files(self.model_dir, WEIGHT_INDEX_FILE, SAFETENSORS_FILE, "*.safetensors")
        self._handles = {}
        self._where: dict[str, str] = {}
        self._info: dict[str, TensorInfo] = {}
        for filename in self.files:
            for name, info in read_safetensors_header(self.model_dir / filename).items():
                self._where[name] = filename
                self._info[name] = info

    def names(self) -> list[str]:
        return list(self._where)

    def info(self, name: str) -> TensorInfo:
        return self._info[name]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        filename = self._where[name]
        if filename not in self._handles:
            self._handles[filename] = safe_open(self.model_dir / filename, framework="pt")
        if not self._info[name].shape:
            return self._handles[filename].get_tensor(name)
        return self._handles[filename].get_slice(name)[start:stop]


class TorchBinFolder:
    """The tensors of `pytorch_model*.bin` files, memory-mapped with `weights_only=True`."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.files = _weight_files(self.model_dir, BIN_INDEX, BIN_FILE, "pytorch_model*.bin")
        self._tensors: dict[str, torch.Tensor] = {}
        for filename in self.files:
            path = self.model_dir / filename
            try:
                self._tensors.update(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
            except Exception as e:
                raise CheckpointError(f"cannot read reference weights {path}: {e}") from e

    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        tensor = self._tensors[name]
        return TensorInfo(tensor.dtype, tuple(tensor.shape))

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        tensor = self._tensors[name]
        return tensor[start:stop] if tensor.dim() else tensor


def open_model_folder(model_dir: Path) -> SafetensorsFolder | TorchBinFolder:
    """The folder's weights, safetensors preferred as transformers prefers them."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    if any(model_dir.glob("*.safetensors")):
        return SafetensorsFolder(model_dir)
    if any(model_dir.glob("pytorch_model*.bin")):
        return TorchBinFolder(model_dir)
    raise CheckpointError(f"no weights in {model_dir}: expected *.safetensors or pytorch_model*.bin files")


def nbytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * info.dtype.itemsize


def dominant_floating_dtype(folder: "SafetensorsFolder | TorchBinFolder") -> torch.dtype | None:
    """The floating dtype holding most of a folder's bytes, or None when it has no floating tensors."""
    by_dtype: Counter = Counter()
    for name in folder.names():
        info = folder.info(name)
        if info.dtype.is_floating_point:
            by_dtype[info.dtype] += nbytes(info)
    return by_dtype.most_common(1)[0][0] if by_dtype else None


def _weight_files(model_dir: Path, index_name: str, single_name: str, pattern: str) -> list[str]:
    index_path = model_dir / index_name
    if index_path.is_file():
        return sorted(set(read_weight_index(index_path)["weight_map"].values()))
    if (model_dir / single_name).is_file():
        return [single_name]
    return sorted(path.name for path in model_dir.glob(pattern))


def read_weight_index(path: Path) -> dict:
    try:
        index = json.loads(Path(path).read_text())
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError("no 'weight_map' object")
        return index
    except (OSError, ValueError) as e:
        raise CheckpointError(f"unreadable weight index {path}: {e}") from e


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes and shapes from a safetensors header, checking that the file holds all their bytes.

    Raises:
        CheckpointError: the file is missing, empty, truncated, or its header is not valid.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            (header_length,) = struct.unpack("<Q", file.read(HEADER_LENGTH_BYTES))
            if header_length > size - HEADER_LENGTH_BYTES:
                raise ValueError(f"header of {header_length} bytes in a {size}-byte file")
            header = json.loads(file.read(header_length))
    except FileNotFoundError as e:
        raise CheckpointError(f"missing weights file {path}") from e
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"not a valid safetensors file: {path} ({e or 'empty'})") from e
    header.pop("__metadata__", None)
    data_bytes = size - HEADER_LENGTH_BYTES - header_length
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if end != data_bytes:
        raise CheckpointError(
            f"truncated or padded safetensors file: {path} holds {data_bytes} data bytes, "
            f"its header describes {end}"
        )
    try:
        return {
            name: TensorInfo(DTYPE_FROM_CODE[entry["dtype"]], tuple(entry["shape"]))
            for name, entry in header.items()
        }
    except KeyError as e:
        raise CheckpointError(f"unsupported dtype {e} in {path}") from e


def weight_counts(model_dir: Path) -> tuple[int, int]:
    """How many weight files a complete model folder's index names, and how many tensors they hold."""
    index_path = Path(model_dir) / WEIGHT_INDEX_FILE
    if index_path.is_file():
        weight_map = read_weight_index(index_path)["weight_map"]
        return len(set(weight_map.values())), len(weight_map)
    single = Path(model_dir) / SAFETENSORS_FILE
    return (1, len(read_safetensors_header(single))) if single.is_file() else (0, 0)


def completeness_problems(model_dir: Path) -> list[str]:
    """What is missing or inconsistent in a merged model folder (empty when it is complete).

    Checks: config.json parses; every file the index names exists and holds exactly the tensors the
    index assigns it; no safetensors file outside the index; total_size matches the tensors' bytes;
    and a `lora_adapter/` folder, when there is one, is a loadable PEFT adapter. A folder holding
    only the adapter (from a LoRA-only checkpoint) is checked as such.
    """
    model_dir = Path(model_dir)
    adapter_dir = model_dir / ADAPTER_SUBDIR
    if not adapter_dir.is_dir():
        return model_problems(model_dir)
    if not (model_dir / CONFIG_FILE).exists() and not list(model_dir.glob("*.safetensors")):
        return adapter_problems(adapter_dir)
    return model_problems(model_dir) + adapter_problems(adapter_dir)


def adapter_problems(adapter_dir: Path) -> list[str]:
    """What keeps a PEFT LoRA adapter folder from loading: its config, and its weights file."""
    from peft import LoraConfig

    problems = []
    config_path = adapter_dir / ADAPTER_CONFIG_FILE
    try:
        LoraConfig.from_pretrained(str(adapter_dir))
    except (OSError, ValueError, TypeError) as e:
        problems.append(f"adapter config: {config_path} is not a PEFT LoRA config ({e})")
    try:
        held = read_safetensors_header(adapter_dir / ADAPTER_WEIGHTS_FILE)
    except CheckpointError as e:
        return [*problems, str(e)]
    if not lora_tensor_names(held):
        problems.append(f"{adapter_dir / ADAPTER_WEIGHTS_FILE} holds no LoRA tensors")
    return problems


def model_problems(model_dir: Path) -> list[str]:
    """What is missing or inconsistent in a model folder's config, index and weight files."""
    problems = []
    try:
        json.loads((model_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        problems.append(f"config: {model_dir / CONFIG_FILE} does not parse ({e})")
    index_path = model_dir / WEIGHT_INDEX_FILE
    if index_path.is_file():
        try:
            index = read_weight_index(index_path)
        except CheckpointError as e:
            return [*problems, str(e)]
        weight_map: dict[str, str] = index["weight_map"]
    elif (model_dir / SAFETENSORS_FILE).is_file():
        weight_map = None
    else:
        return [*problems, f"no weights: {model_dir} has neither {WEIGHT_INDEX_FILE} nor {SAFETENSORS_FILE}"]
    files = sorted(set(weight_map.values())) if weight_map is not None else [SAFETENSORS_FILE]
    stray = sorted(p.name for p in model_dir.glob("*.safetensors") if p.name not in files)
    if stray:
        problems.append(f"stray weights file(s) not in {WEIGHT_INDEX_FILE}: {', '.join(stray)}")
    total = 0
    for filename in files:
        try:
            held = read_safetensors_header(model_dir / filename)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        total += sum(nbytes(info) for info in held.values())
        if weight_map is not None:
            expected = {name for name, file in weight_map.items() if file == filename}
            missing, extra = sorted(expected - held.keys()), sorted(held.keys() - expected)
            if missing:
                problems.append(
                    f"{model_dir / filename} lacks tensor(s) the index assigns it: {', '.join(missing)}"
                )
            if extra:
                problems.append(
                    f"{model_dir / filename} holds tensor(s) the index does not list: {', '.join(extra)}"
                )
    if weight_map is not None:
        declared = index.get("metadata", {}).get("total_size")
        if declared is not None and not problems and int(declared) != total:
            problems.append(
                f"{WEIGHT_INDEX_FILE} says total_size={declared}, the files hold {total} bytes of tensors"
            )
    return problems

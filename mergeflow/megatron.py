"""verl Megatron checkpoints: a `torch_dist` (PyTorch DCP) archive of megatron-core's global tensors,
mapped onto Hugging Face names without megatron-core or a GPU.

Layouts verl has written: `actor/model/dist_ckpt/` + `actor/model/huggingface/` (current) and
`actor/dist_ckpt/` + `actor/huggingface/` (2025). The archive holds every tensor with its global
shape, layers stacked along a leading axis (`decoder.layers.self_attention.linear_qkv.weight` is
`(num_layers, rows, hidden)`); `HF_FROM_MEGATRON` maps each key to its Hugging Face tensors, and the
fused ones (QKV per query group, gate|up) are split by small named functions. A key the table does
not know is an error that names it, never a dropped tensor.
"""

import re
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mergeflow.dcp import METADATA_FILE, StoredTensor, read_metadata, read_region, read_whole
from mergeflow.dtypes import dtype_name, parse_dtype_name
from mergeflow.errors import CheckpointError, PlanError, quoted
from mergeflow.fsdp import HF_SUBDIR
from mergeflow.hf_config import ModelSpec, load_config

DIST_CKPT_SUBDIR = "dist_ckpt"
HF_WEIGHT_FILES = "*.safetensors"
MODEL_SUBDIR = "model"
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
STACKED_PREFIX = "decoder.layers."
LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
DATA_FILE = re.compile(r"^__(\d+)_(\d+)\.distcp$")

COPY, VOCAB, Q, K, V, GATE, UP = "copy", "vocab", "q", "k", "v", "gate", "up"
HF_FROM_MEGATRON: dict[str, list[tuple[str, str]]] = {
    "embedding.word_embeddings.weight": [("model.embed_tokens.weight", VOCAB)],
    "decoder.final_layernorm.weight": [("model.norm.weight", COPY)],
    "output_layer.weight": [("lm_head.weight", VOCAB)],
    "decoder.layers.{}.self_attention.linear_qkv.layer_norm_weight": [("model.layers.{}.input_layernorm.weight", COPY)],
    "decoder.layers.{}.input_layernorm.weight": [("model.layers.{}.input_layernorm.weight", COPY)],
    "decoder.layers.{}.self_attention.linear_qkv.weight": [
        ("model.layers.{}.self_attn.q_proj.weight", Q),
        ("model.layers.{}.self_attn.k_proj.weight", K),
        ("model.layers.{}.self_attn.v_proj.weight", V),
    ],
    "decoder.layers.{}.self_attention.linear_qkv.bias": [
        ("model.layers.{}.self_attn.q_proj.bias", Q),
        ("model.layers.{}.self_attn.k_proj.bias", K),
        ("model.layers.{}.self_attn.v_proj.bias", V),
    ],
    "decoder.layers.{}.self_attention.q_layernorm.weight": [("model.layers.{}.self_attn.q_norm.weight", COPY)],
    "decoder.layers.{}.self_attention.k_layernorm.weight": [("model.layers.{}.self_attn.k_norm.weight", COPY)],
    "decoder.layers.{}.self_attention.linear_proj.weight": [("model.layers.{}.self_attn.o_proj.weight", COPY)],
    "decoder.layers.{}.mlp.linear_fc1.layer_norm_weight": [("model.layers.{}.post_attention_layernorm.weight", COPY)],
    "decoder.layers.{}.pre_mlp_layernorm.weight": [("model.layers.{}.post_attention_layernorm.weight", COPY)],
    "decoder.layers.{}.mlp.linear_fc1.weight": [
        ("model.layers.{}.mlp.gate_proj.weight", GATE),
        ("model.layers.{}.mlp.up_proj.weight", UP),
    ],
    "decoder.layers.{}.mlp.linear_fc2.weight": [("model.layers.{}.mlp.down_proj.weight", COPY)],
}
VALUE_HEAD = ("score.weight", COPY)
"""A value model's `output_layer` (one output) is its `score` head."""


@dataclass(frozen=True)
class MegatronLayout:
    """Where a Megatron checkpoint's parts are."""

    checkpoint_dir: str
    """What the user passed (`global_step_N/actor`)."""
    dist_ckpt_dir: str | None
    hf_dir: str
    hf_weights: bool = False
    """`hf_dir` already holds the model's weights (verl with mbridge saves them): nothing to merge."""

    @property
    def world_size(self) -> int:
        """Ranks that wrote the archive (1 when there is none)."""
        return _writer_ranks(Path(self.dist_ckpt_dir)) if self.dist_ckpt_dir else 1


@dataclass(frozen=True)
class Geometry:
    """What the fused tensors need from the HF config."""

    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int


@dataclass(frozen=True)
class MegatronTensor:
    """One Hugging Face tensor, as a part of one layer of a stored megatron-core tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    key: str
    layer: int | None
    part: str


@dataclass(frozen=True)
class MegatronIndex:
    """The checkpoint's tensors under Hugging Face names, from metadata alone."""

    checkpoint_dir: str
    dist_ckpt_dir: str
    world_size: int
    tensor_parallel: int | None
    tensors: dict[str, MegatronTensor]
    stored: dict[str, StoredTensor]
    geometry: Geometry
    aliases: dict[str, str]
    mesh_shape: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] | None = None
    fsdp_version: None = None


def find_megatron_checkpoint(local_dir: Path) -> MegatronLayout:
    """Locate `dist_ckpt/` and `huggingface/` in either of verl's layouts; a `huggingface/` that holds
    safetensors weights (an mbridge run) is the model itself.

    Raises:
        CheckpointError: neither layout is there (naming the directory to pass when it is a parent).
    """
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {local_dir}")
    for base in (local_dir / MODEL_SUBDIR, local_dir):
        if any((base / HF_SUBDIR).glob(HF_WEIGHT_FILES)):
            dist_ckpt = base / DIST_CKPT_SUBDIR
            return MegatronLayout(
                str(local_dir), str(dist_ckpt) if dist_ckpt.is_dir() else None, str(base / HF_SUBDIR), hf_weights=True
            )
        if (base / DIST_CKPT_SUBDIR).is_dir():
            dist_ckpt = base / DIST_CKPT_SUBDIR
            if not (dist_ckpt / METADATA_FILE).is_file():
                raise CheckpointError(f"not a torch_dist checkpoint: {dist_ckpt} has no {METADATA_FILE} file")
            return MegatronLayout(str(local_dir), str(dist_ckpt), str(base / HF_SUBDIR))
    if (local_dir / METADATA_FILE).is_file():
        return MegatronLayout(str(local_dir), str(local_dir), str(local_dir.parent / HF_SUBDIR))
    roles = [role for role in ("actor", "critic") if (local_dir / role).is_dir()]
    hint = f": pass {local_dir / roles[0]}" if roles else ""
    raise CheckpointError(
        f"not a Megatron checkpoint: {local_dir} has neither {MODEL_SUBDIR}/{DIST_CKPT_SUBDIR}/ nor "
        f"{DIST_CKPT_SUBDIR}/{hint}"
    )


def index_megatron(layout: MegatronLayout, spec: ModelSpec) -> MegatronIndex:
    """Every Hugging Face tensor the checkpoint holds, with its shape, from `.metadata` and the config.

    Raises:
        PlanError: an architecture the table does not cover, or keys it cannot map.
        CheckpointError: an unreadable archive, or none (the HF weights are there already: nothing to index).
    """
    if layout.dist_ckpt_dir is None:
        raise CheckpointError(
            f"{layout.hf_dir} already holds the Hugging Face model and there is no dist_ckpt/ to read: "
            f"check it with `mergeflow validate {layout.hf_dir}`"
        )
    config = load_config(Path(spec.config_dir), trust_remote_code=spec.trust_remote_code)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise PlanError(
            f'unknown architecture for the Megatron backend: model_type "{config.model_type}" '
            f"({spec.architecture}) in {spec.config_dir}/config.json; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    geometry = Geometry(
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
    )
    stored = read_metadata(Path(layout.dist_ckpt_dir))
    tensors: dict[str, MegatronTensor] = {}
    unmapped = []
    for key, entry in stored.items():
        template, layers = _template(key, entry, geometry)
        targets = HF_FROM_MEGATRON.get(template)
        if template == "output_layer.weight" and spec.is_value_model:
            targets = [VALUE_HEAD]
        if targets is None:
            unmapped.append(key)
            continue
        for layer in layers:
            for name_template, part in targets:
                name = name_template.format(layer) if layer is not None else name_template
                shape = _part_shape(part, _layer_shape(entry, key), geometry, key)
                tensors[name] = MegatronTensor(name, dtype_name(entry.dtype), shape, key, layer, part)
    if unmapped:
        raise PlanError(
            f"unmapped key(s) for {config.model_type} in {layout.dist_ckpt_dir}: {quoted(unmapped)}. "
            "Add them to HF_FROM_MEGATRON in mergeflow/megatron.py."
        )
    tensor_parallel = _tensor_parallel(stored)
    return MegatronIndex(
        checkpoint_dir=layout.checkpoint_dir,
        dist_ckpt_dir=layout.dist_ckpt_dir,
        world_size=_writer_ranks(Path(layout.dist_ckpt_dir)),
        tensor_parallel=tensor_parallel,
        mesh_shape=(tensor_parallel,) if tensor_parallel else (),
        mesh_dim_names=("tp",) if tensor_parallel else None,
        tensors=tensors,
        stored=stored,
        geometry=geometry,
        aliases={},
    )


def _template(key: str, entry: StoredTensor, geometry: Geometry) -> tuple[str, list[int | None]]:
    """The table key for a stored key, and the layers it holds (None for tensors outside the layers)."""
    per_layer = LAYER_KEY.match(key)
    if per_layer:
        return f"decoder.layers.{{}}.{per_layer[2]}", [int(per_layer[1])]
    if key.startswith(STACKED_PREFIX):
        if not entry.shape or entry.shape[0] != geometry.num_layers:
            raise PlanError(f"{key} has shape {entry.shape}: expected {geometry.num_layers} stacked layers first")
        return f"decoder.layers.{{}}.{key.removeprefix(STACKED_PREFIX)}", list(range(geometry.num_layers))
    return key, [None]


def _layer_shape(entry: StoredTensor, key: str) -> tuple[int, ...]:
    return entry.shape[1:] if key.startswith(STACKED_PREFIX) and not LAYER_KEY.match(key) else entry.shape


def _part_shape(part: str, shape: tuple[int, ...], geometry: Geometry, key: str) -> tuple[int, ...]:
    rows, tail = shape[0], shape[1:]
    if part in (Q, K, V):
        per_group = geometry.num_heads // geometry.num_query_groups
        expected = geometry.num_query_groups * (per_group + 2) * geometry.head_dim
        if rows != expected:
            raise PlanError(
                f"{key} has {rows} rows, but {geometry.num_heads} heads in {geometry.num_query_groups} query "
                f"groups of head_dim {geometry.head_dim} make {expected}"
            )
        heads = per_group * geometry.num_query_groups if part == Q else geometry.num_query_groups
        return (heads * geometry.head_dim, *tail)
    if part in (GATE, UP):
        return (rows // 2, *tail)
    if part == VOCAB:
        return (min(rows, geometry.vocab_size), *tail)
    return shape


def _writer_ranks(dist_ckpt_dir: Path) -> int:
    ranks = {int(match[1]) for path in dist_ckpt_dir.iterdir() if (match := DATA_FILE.match(path.name))}
    return len(ranks) or 1


def _tensor_parallel(stored: dict[str, StoredTensor]) -> int | None:
    """TP size, from how the first layer of the attention output projection is split (by input columns)."""
    entry = stored.get("decoder.layers.self_attention.linear_proj.weight")
    if entry is None:
        return None
    return sum(1 for chunk in entry.chunks if chunk.offsets[0] == 0)


def split_part(value: torch.Tensor, part: str, geometry: Geometry) -> torch.Tensor:
    """The HF tensor `part` of one layer of a stored tensor."""
    if part == COPY:
        return value
    if part == VOCAB:
        return value[: geometry.vocab_size]
    if part in (GATE, UP):
        half = value.shape[0] // 2
        return value[:half] if part == GATE else value[half:]
    per_group = geometry.num_heads // geometry.num_query_groups
    groups = value.reshape(geometry.num_query_groups, per_group + 2, geometry.head_dim, *value.shape[1:])
    picked = {Q: groups[:, :per_group], K: groups[:, per_group], V: groups[:, per_group + 1]}[part]
    return picked.reshape(-1, *value.shape[1:])


class MegatronTensors:
    """Reads planned tensors out of the archive, one stored layer at a time (the last few kept, so the
    three parts of a fused QKV cost one read)."""

    CACHED_LAYERS = 4

    def __init__(self, index: MegatronIndex):
        self._index = index
        self._cache: OrderedDict[tuple[str, int | None], torch.Tensor] = OrderedDict()

    def _layer(self, key: str, layer: int | None) -> torch.Tensor:
        cached = self._cache.get((key, layer))
        if cached is not None:
            self._cache.move_to_end((key, layer))
            return cached
        entry = self._index.stored[key]
        directory = Path(self._index.dist_ckpt_dir)
        value = read_region(directory, entry, layer, 1)[0] if layer is not None and not LAYER_KEY.match(key) else read_whole(directory, entry)
        self._cache[key, layer] = value
        if len(self._cache) > self.CACHED_LAYERS:
            self._cache.popitem(last=False)
        return value

    def whole(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        tensor = self._index.tensors[name]
        return split_part(self._layer(tensor.key, tensor.layer), tensor.part, self._index.geometry).to(dtype)

    def chunks(self, output, chunk_bytes: int) -> Iterator[torch.Tensor]:
        value = self.whole(output.source, parse_dtype_name(output.dtype)).contiguous()
        if not value.dim():
            yield value
            return
        row_bytes = max(1, value[0].numel() * value.element_size())
        step = max(1, chunk_bytes // row_bytes)
        for start in range(0, max(value.shape[0], 1), step):
            yield value[start : start + step]

    def rows(self, output, start: int, stop: int) -> torch.Tensor:
        value = self.whole(output.source, parse_dtype_name(output.dtype))
        return value if not value.dim() else value[start:stop]

    def close(self) -> None:
        self._cache.clear()

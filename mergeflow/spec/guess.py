"""A model spec guessed from the checkpoint itself, for a config whose real spec is still being built (transformers
and the model class take seconds to import): every tensor the checkpoint holds is expected under its own name and
shape, and its tied aliases are the names that share another's storage, or (where the config ties the word
embeddings) `lm_head.weight`, beside one input embedding of its shape. The write-ahead child plans and writes the
weight files with it meanwhile; the flow's steps plan with the real spec and keep a file only where the two plans
agree on every tensor it holds (`output.save.shard_plan_digest`), so a wrong guess costs time, never bytes."""

import json
from collections.abc import Mapping
from pathlib import Path

from mergeflow.spec.config_files import require_config
from mergeflow.spec.model_spec import ModelSpec

OUTPUT_EMBEDDING = "lm_head.weight"
INPUT_EMBEDDING_SUFFIX = "embed_tokens.weight"


def guessed_spec(
    config_dir: Path,
    shapes: Mapping[str, tuple[int, ...]],
    aliases: Mapping[str, str],
    *,
    trust_remote_code: bool,
    is_value_model: bool,
) -> ModelSpec:
    """The spec a plain model whose checkpoint holds exactly its state dict would have, from the checkpoint's
    tensors (`shapes`) and the names it stores once for two (`aliases`, as `TensorIndex.aliases`)."""
    config = json.loads(require_config(config_dir).read_text())
    architecture = (config.get("architectures") or ["unknown"])[0]
    tied = dict(aliases) or _tied_word_embeddings(config, shapes)
    expected = {name: shape for name, shape in shapes.items() if name not in tied}
    return ModelSpec(
        config_dir=str(config_dir),
        architecture=architecture,
        model_class=architecture,
        trust_remote_code=trust_remote_code,
        expected_shapes=expected,
        saved_shapes=expected,
        saved_views={},
        tied=tied,
        is_value_model=is_value_model,
    )


def _tied_word_embeddings(config: dict, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """`lm_head.weight` tied to the input embedding of its shape, where the config (or its text config) ties them."""
    text_config = config.get("text_config") or {}
    if not config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)):
        return {}
    output = shapes.get(OUTPUT_EMBEDDING)
    inputs = [name for name, shape in shapes.items() if name.endswith(INPUT_EMBEDDING_SUFFIX) and shape == output]
    return {OUTPUT_EMBEDDING: inputs[0]} if len(inputs) == 1 else {}

"""Each model family the Megatron backend reads, as one record per `model_type`: its key tables, its vision tower,
how its checkpoints name the multi-token-prediction layers, and its attention's output gate. Adding a family is a
record here, its table lines in `tables`, and its fixture."""

from dataclasses import dataclass

from mergeflow.formats.megatron import tables
from mergeflow.formats.megatron.tables import HF_FROM_MEGATRON

KeyTable = dict[str, list[tuple[str, str]]]


def language_model_under(prefix: str, table: KeyTable) -> KeyTable:
    """The table with its `model.` names moved under `prefix` (Qwen3-VL's `model.language_model.`)."""
    return {
        template: [(name.replace("model.", prefix, 1) if name.startswith("model.") else name, part) for name, part in names]
        for template, names in table.items()
    }


@dataclass(frozen=True)
class Family:
    """How one model type's archive maps onto its Hugging Face checkpoint."""

    table: KeyTable
    """The language model's key table: the dense decoder's lines, and what the family adds or overrides."""
    vision: KeyTable | None = None
    """A vision-language model's tower as megatron-core saves it (under `vision_model.`)."""
    hf_module_tower: str | None = None
    """A vision tower a writer may keep as Hugging Face's own module, saved under its HF names with this prefix
    (Megatron-Bridge's Qwen2.5-VL); an archive holds one tower or the other."""
    mtp_under_own_names: bool = False
    """Its checkpoints name an MTP layer `mtp.layers.{k}.*` (Qwen3-Next, Qwen3.5), not as the decoder layer after
    the last (DeepSeek-V3), which also holds copies of the embedding and head."""
    output_gate: bool = False
    """Its attention's query projection also gives a gate on the attention output (`cuts.Geometry.output_gate`)."""


def _family(*pieces: KeyTable, **traits) -> Family:
    return Family({**HF_FROM_MEGATRON, **{line: names for piece in pieces for line, names in piece.items()}}, **traits)


def _vision_language(*pieces: KeyTable, vision: KeyTable, **traits) -> Family:
    language = language_model_under("model.language_model.", _family(*pieces).table)
    return Family(language, vision=vision, **traits)


FAMILIES: dict[str, Family] = {
    "llama": _family(),
    "mistral": _family(),
    "qwen2": _family(),
    "qwen3": _family(),
    "qwen2_moe": _family(tables.QWEN_MOE),
    "qwen3_moe": _family(tables.QWEN_MOE),
    "mixtral": _family(tables.MIXTRAL_MOE),
    "deepseek_v3": _family(tables.MLA, tables.DEEPSEEK_MOE, tables.MTP),
    "glm4_moe": _family(tables.DEEPSEEK_MOE, tables.MTP),
    "gpt_oss": _family(tables.GPT_OSS),
    "qwen3_next": _family(
        tables.QWEN3_NEXT_GATED_DELTA_NET, tables.QWEN_MOE, tables.QWEN_MTP, mtp_under_own_names=True, output_gate=True
    ),
    "qwen2_5_vl": _family(vision=tables.QWEN2_5_VL_VISION, hf_module_tower="visual."),
    "qwen3_vl": _vision_language(vision=tables.QWEN3_VL_VISION),
    "qwen3_vl_moe": _vision_language(tables.QWEN3_VL_MOE_EXPERTS, vision=tables.QWEN3_VL_VISION),
    "qwen3_5": _vision_language(
        tables.GATED_DELTA_NET, tables.QWEN_MTP, vision=tables.QWEN3_VL_VISION, mtp_under_own_names=True, output_gate=True
    ),
    "qwen3_5_moe": _vision_language(
        tables.GATED_DELTA_NET, tables.QWEN_MOE, tables.QWEN_MTP, vision=tables.QWEN3_VL_VISION,
        mtp_under_own_names=True, output_gate=True,
    ),
}  # fmt: skip
"""Every model type the Megatron backend reads."""

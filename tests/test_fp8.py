"""Merging straight to FP8: linear layers' weights as float8_e4m3fn with a float32 scale per 128×128 block,
loaded by transformers (dequantized on CPU) with no missing or unexpected keys, and logits close to the bf16
merge's."""

import json
import math

import pytest
import torch
import transformers
from safetensors import safe_open

from mergeflow import fp8
from mergeflow.flows.merge import merge_checkpoint
from mergeflow.options import MergeOptions, Reference
from mergeflow.validation.validate import validate_model_dir
from tests.merging import INPUT_IDS, load_weights, merge_with_engine, model_class

LOGITS_TOLERANCE = 0.15
"""Largest logit difference from the bf16 merge's, as a share of its largest logit (measured 0.3-10% on these
random models, whose weights of std 0.3 amplify rounding: 10% on the widest)."""
FSDP_FIXTURES = ["qwen2-wide-ws2", "qwen2-ws2", "llama-untied-ws3", "qwen3moe-ws2", "qwen25vl-ws2"]
MEGATRON_FIXTURES = ["megatron-qwen2-tp1", "megatron-qwen3moe-tp2"]


def reference_quantize(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme written the plain way: one 128×128 block at a time."""
    rows, columns = matrix.shape
    values = torch.empty(matrix.shape, dtype=fp8.FP8_DTYPE)
    scales = torch.empty(math.ceil(rows / 128), math.ceil(columns / 128))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = matrix[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            largest = block.abs().max()
            scale = largest / fp8.LARGEST_CODE if largest > 0 else torch.tensor(1.0)
            scales[i, j] = scale
            values[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scale).to(fp8.FP8_DTYPE)
    return values, scales


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (300, 200), (5, 7), (129, 1), (1, 257)])
def test_the_block_quantizer_equals_a_plain_reference(shape):
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02

    quantized = fp8.quantize(matrix)

    expected_values, expected_scales = reference_quantize(matrix)
    assert torch.equal(quantized.scales, expected_scales)
    assert torch.equal(quantized.values.view(torch.uint8), expected_values.view(torch.uint8))


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (129, 1)])
def test_the_quantizers_own_rounding_check_agrees_with_checking_the_dequantized_weights(shape):
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 0.02

    quantized = fp8.quantize(matrix)

    relative, outside = fp8.rounding_error(matrix, quantized.values, quantized.scales)
    assert (quantized.outside, outside) == (0, 0)
    assert quantized.largest_relative_error == pytest.approx(relative, rel=1e-4)
    assert relative <= 2**-4


def test_a_value_off_by_more_than_half_a_step_is_outside_the_rounding_bound():
    matrix = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    quantized = fp8.quantize(matrix)
    wrong = quantized.values.float()
    wrong[5, 7] *= 1.25

    assert fp8.rounding_error(matrix, wrong.to(fp8.FP8_DTYPE), quantized.scales)[1] == 1


@pytest.mark.parametrize("shape", [(300, 200), (5, 7), (256, 130)])
def test_dequantizing_gives_every_blocks_largest_magnitude_back_exactly(shape):
    matrix = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    quantized = fp8.quantize(matrix)

    restored = fp8.dequantize(quantized.values, quantized.scales)

    for i, j in [(i, j) for i in range(quantized.scales.shape[0]) for j in range(quantized.scales.shape[1])]:
        rows, columns = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
        assert restored[rows, columns].abs().max() == matrix[rows, columns].abs().max(), (i, j)


def test_a_block_of_zeros_stays_zero():
    quantized = fp8.quantize(torch.zeros(130, 3))

    assert torch.equal(fp8.dequantize(quantized.values, quantized.scales), torch.zeros(130, 3))


@pytest.mark.parametrize(
    ("name", "quantized"),
    [
        ("model.layers.0.self_attn.q_proj.weight", True),
        ("model.layers.0.mlp.experts.3.down_proj.weight", True),
        ("model.embed_tokens.weight", False),
        ("lm_head.weight", False),
        ("model.layers.0.mlp.gate.weight", False),
        ("model.layers.0.mlp.shared_expert_gate.weight", False),
        ("visual.blocks.0.attn.qkv.weight", False),
        ("model.layers.0.self_attn.q_proj.bias", False),
    ],
)
def test_which_weights_are_quantized(name, quantized):
    shape = (8, 8) if name.endswith("weight") else (8,)

    assert fp8.quantizable(name, shape) is quantized


@pytest.mark.parametrize(("shape", "quantized"), [((256, 384), True), ((100, 44), True), ((128, 64), True), ((300, 256), False), ((256, 129), False)])
def test_a_weight_with_a_partial_block_beside_whole_ones_is_kept_unquantized(shape, quantized):
    assert fp8.quantizable("model.layers.0.mlp.up_proj.weight", shape) is quantized


@pytest.fixture(scope="module")
def merged(fixtures, megatron_fixtures, tmp_path_factory):
    """Each fixture merged in bf16 and in FP8, by the engine."""
    outputs = {}

    def get(name: str, quantize: str | None):
        if (name, quantize) not in outputs:
            backend = "megatron" if name in MEGATRON_FIXTURES else "fsdp"
            checkpoint = (megatron_fixtures if backend == "megatron" else fixtures)[name].checkpoint_dir
            target = tmp_path_factory.mktemp("fp8") / f"{name}-{quantize}"
            merge_with_engine(checkpoint, target, backend=backend, quantize=quantize)
            outputs[name, quantize] = target
        return outputs[name, quantize]

    return get


def quantized_weights(model_dir) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    weights = load_weights(model_dir)
    return {name: (tensor, weights[fp8.scale_name(name)]) for name, tensor in weights.items() if tensor.dtype == fp8.FP8_DTYPE}


@pytest.mark.parametrize("name", FSDP_FIXTURES + MEGATRON_FIXTURES)
def test_the_fp8_merge_loads_in_transformers_with_no_missing_or_unexpected_keys(merged, name):
    _, info = model_class(merged(name, "fp8")).from_pretrained(merged(name, "fp8"), output_loading_info=True)

    assert (set(info["missing_keys"]), set(info["unexpected_keys"])) == (set(), set())


@pytest.mark.parametrize("name", FSDP_FIXTURES + MEGATRON_FIXTURES)
def test_fp8_logits_are_close_to_the_bf16_merges(merged, name):
    logits = {}
    for quantize in (None, "fp8"):
        model = model_class(merged(name, quantize)).from_pretrained(merged(name, quantize), dtype=torch.bfloat16)
        with torch.no_grad():
            logits[quantize] = model.eval()(INPUT_IDS).logits.float()

    gap = (logits["fp8"] - logits[None]).abs().max()

    assert gap <= LOGITS_TOLERANCE * logits[None].abs().max(), float(gap / logits[None].abs().max())


@pytest.mark.parametrize("name", FSDP_FIXTURES + MEGATRON_FIXTURES)
def test_each_quantized_weight_has_a_scale_per_block_and_dequantizes_to_its_source_within_rounding(
    merged, fixtures, megatron_fixtures, name
):
    source = load_weights({**fixtures, **megatron_fixtures}[name].reference_dir)  # the trained weights, in fp32

    quantized = quantized_weights(merged(name, "fp8"))

    assert quantized
    for weight, (values, scales) in quantized.items():
        assert scales.dtype == torch.float32 and tuple(scales.shape) == fp8.scale_shape(values.shape), weight
        relative, outside = fp8.rounding_error(source[weight].float(), values, scales)
        assert outside == 0 and relative <= 1 / 16, weight


@pytest.mark.parametrize("name", ["qwen3moe-ws2", "qwen25vl-ws2", "llama-untied-ws3"])
def test_embeddings_heads_routers_and_vision_towers_stay_in_the_models_dtype(merged, name):
    weights = load_weights(merged(name, "fp8"))

    kept = [n for n, t in weights.items() if t.dtype == torch.bfloat16 and n.endswith(".weight") and t.dim() == 2]

    assert kept and all(fp8.KEPT_IN_BF16.search(n) for n in kept), kept
    if name == "qwen3moe-ws2":
        assert weights["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == fp8.FP8_DTYPE


def test_config_json_says_how_the_model_is_quantized(merged):
    config = json.loads((merged("qwen3moe-ws2", "fp8") / "config.json").read_text())["quantization_config"]

    assert {key: config[key] for key in ("quant_method", "activation_scheme", "weight_block_size")} == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert "model.layers.0.mlp.gate" in config["modules_to_not_convert"]
    assert config["ignored_layers"] == config["modules_to_not_convert"]


def test_a_weight_and_its_scales_are_written_next_to_each_other(merged):
    path = merged("qwen2-wide-ws2", "fp8") / "model.safetensors"
    with safe_open(path, framework="pt") as archive:
        names = list(archive.keys())
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    order = sorted(names, key=lambda name: header[name]["data_offsets"][0])

    weight = "model.layers.0.self_attn.q_proj.weight"
    assert order[order.index(weight) + 1] == fp8.scale_name(weight)


def test_folding_lora_then_quantizing_matches_quantizing_the_folded_model(fixtures, tmp_path):
    folded = tmp_path / "folded"
    merge_with_engine(fixtures["lora-ws2"].checkpoint_dir, folded, merge_lora=True, dtype="fp32")
    quantized = tmp_path / "quantized"

    merge_with_engine(fixtures["lora-ws2"].checkpoint_dir, quantized, merge_lora=True, quantize="fp8")

    source = load_weights(folded)
    for weight, (values, scales) in quantized_weights(quantized).items():
        assert fp8.rounding_error(source[weight], values, scales)[1] == 0, weight


def test_validation_against_a_reference_dequantizes_within_the_rounding_bound(merged, fixtures):
    report = validate_model_dir(merged("qwen2-wide-ws2", "fp8"), reference_dir=fixtures["qwen2-wide-ws2"].reference_dir)

    assert report.passed, report.failure_message()
    assert report.tensors_compared == len(load_weights(fixtures["qwen2-wide-ws2"].reference_dir))


@pytest.mark.usefixtures("prefect_server")
def test_the_flow_reports_each_fp8_weights_rounding_error(fixtures, tmp_path):
    saved = merge_checkpoint(
        local_dir=str(fixtures["qwen2-wide-ws2"].checkpoint_dir),
        target_dir=str(tmp_path / "out"),
        options=MergeOptions(quantize="fp8"),
        reference=Reference(str(fixtures["qwen2-wide-ws2"].reference_dir), check_logits=True),
        progress=False,
    )

    assert saved.fp8_errors and max(saved.fp8_errors.values()) <= 1 / 16
    assert "FP8 weights within FP8's rounding bound of their source" in saved.validation
    assert "FP8" in (tmp_path / "out" / "README.md").read_text()


def test_fp8_is_part_of_the_merges_identity(fixtures, tmp_path):
    from mergeflow.job import MergeJob

    checkpoint = fixtures["qwen2-ws2"].checkpoint_dir

    assert MergeJob(checkpoint, tmp_path).key() != MergeJob(checkpoint, tmp_path, MergeOptions(quantize="fp8")).key()


def test_transformers_is_told_which_class_loads_the_fp8_model(merged):
    config = transformers.AutoConfig.from_pretrained(merged("qwen2-ws2", "fp8"))

    assert config.quantization_config["quant_method"] == "fp8"

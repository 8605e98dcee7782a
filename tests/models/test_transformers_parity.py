"""bitserve's BitNet forward against transformers' BitNetForCausalLM built from the same synthetic weights
(docs/formats.md §6.2): whole-model logits in `bitnet` and `float` mode, and every projection given
identical inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from bitserve.kernels.backend import LinearMode
from bitserve.kernels.select import select_backend
from bitserve.llm import LLM
from bitserve.loader.model_loader import LoadOptions, load_model
from bitserve.models.decoder import DecoderModel
from bitserve.testing.synthetic import PROJECTIONS, SyntheticConfig, SyntheticWeights, write_synthetic_model

pytest.importorskip("transformers")
from transformers import BitNetConfig, BitNetForCausalLM, BitNetQuantConfig  # noqa: E402
from transformers.integrations.bitnet import AutoBitLinear, replace_with_bitnet_linear  # noqa: E402

PROMPTS = ["Hello world, this is", "1 2 3 4 5 6", "Ternary weights are {-1, 0, +1}; émigré 東京 🙂"]
MIN_COSINE = 0.999
# Two logits closer than this may swap order under fp32 rounding differences (reduction order, HF's
# fake-quantized float sums vs bitserve's integer dot products) without either side being wrong.
MIN_TOP2_MARGIN = 1e-3
# Float mode is continuous in its inputs, so only fp32 summation order separates the two (~1e-6 seen).
MAX_FLOAT_DIFF_FRACTION = 1e-4
# One projection on identical inputs: both sides form the same int8 q (same fp32 127/amax, product and
# half-to-even rounding), so only summation order is left (<= 4e-7 of max |y| seen); dropping the
# activation quantization moves y by >= 5e-3 of max |y| (seen) on every projection.
MAX_LINEAR_DIFF_FRACTION = 1e-5
MIN_UNQUANTIZED_DIFF_FRACTION = 1e-3
HF_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
HF_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_sub_norm": "self_attn.attn_sub_norm",
    "ffn_sub_norm": "mlp.ffn_sub_norm",
}


def hf_state_dict(
    config: SyntheticConfig, weights: SyntheticWeights, *, is_quantized: bool, is_norm_rope: bool = False
) -> dict[str, torch.Tensor]:
    """HF names -> tensors. Quantized: ternary `weight` plus `weight_scale`; float: weight = t * scale.
    `is_norm_rope` permutes q/k rows the way a `llama` converter would (a deliberately wrong copy)."""
    state = {"model.embed_tokens.weight": torch.from_numpy(weights.embedding)}  # [vocab, hidden]
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied head
    state["model.norm.weight"] = torch.from_numpy(weights.norms["output_norm.weight"])
    head_dim = config.hidden_size // config.num_heads
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        for name in PROJECTIONS:
            key = f"blk.{layer}.{name}"
            ternary = torch.from_numpy(weights.ternary[key]).to(torch.float32)  # [out, in]
            if is_norm_rope and name in ("attn_q", "attn_k"):
                num_heads = ternary.shape[0] // head_dim
                # row h*D + 2i + j <- row h*D + j*D/2 + i: pairs (2i, 2i+1) instead of (i, i+D/2)
                ternary = ternary.view(num_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(ternary.shape)
            scale = torch.tensor([weights.scales[key]], dtype=torch.float32)  # [1]
            if is_quantized:
                state[prefix + HF_PROJECTIONS[name] + ".weight"] = ternary
                state[prefix + HF_PROJECTIONS[name] + ".weight_scale"] = scale
            else:
                state[prefix + HF_PROJECTIONS[name] + ".weight"] = ternary * scale
        for name, hf_name in HF_NORMS.items():
            state[prefix + hf_name + ".weight"] = torch.from_numpy(
                weights.norms[f"blk.{layer}.{name}.weight"]
            )
    return state


def build_hf_model(
    config: SyntheticConfig, weights: SyntheticWeights, *, is_quantized: bool, is_norm_rope: bool = False
) -> BitNetForCausalLM:
    vocab_size, hidden_size = weights.embedding.shape
    hf_config = BitNetConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        rms_norm_eps=config.rms_eps,
        tie_word_embeddings=True,
        max_position_embeddings=config.context_length,
        bos_token_id=None,
        eos_token_id=None,
        dtype=torch.float32,
    )
    model = BitNetForCausalLM(hf_config)
    if is_quantized:
        # Plain BitNetForCausalLM has nn.Linear layers; offline AutoBitLinear computes
        # F.linear(ActQuant(x), weight) * weight_scale, ActQuant being per-token absmax int8
        # fake-quantization.
        quant_config = BitNetQuantConfig(linear_class="autobitlinear", quantization_mode="offline")
        model = replace_with_bitnet_linear(
            model, modules_to_not_convert=["lm_head"], quantization_config=quant_config
        )
    # strict: every parameter and buffer (weight_scale included) comes from the synthetic weights, none
    # stays random
    state = hf_state_dict(config, weights, is_quantized=is_quantized, is_norm_rope=is_norm_rope)
    model.load_state_dict(state, strict=True)
    model.eval()
    num_bitlinear = sum(isinstance(module, AutoBitLinear) for module in model.modules())
    assert num_bitlinear == (len(PROJECTIONS) * config.num_layers if is_quantized else 0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model


def run_hf(module: torch.nn.Module, *args: torch.Tensor) -> torch.Tensor:
    # transformers wraps ActQuant.forward in @torch.compile; Inductor's CPU compile costs ~25 s here, so run
    # the very same Python function eagerly (its semantics, not its speed, is what is compared).
    with torch.inference_mode(), torch.compiler.set_stance("force_eager"):
        return module(*args)


def hf_logits(model: BitNetForCausalLM, token_ids: list[int]) -> torch.Tensor:
    return run_hf(model, torch.tensor([token_ids])).logits[0]  # [num_tokens, vocab]


def bitserve_logits(model: DecoderModel, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden_states = model(torch.tensor(token_ids), torch.arange(len(token_ids)))  # [num_tokens, hidden]
        return model.compute_logits(hidden_states)  # [num_tokens, vocab]


def parity_failures(
    expected: torch.Tensor, actual: torch.Tensor, max_diff_fraction: float | None
) -> tuple[list[str], str]:
    """(failed checks, a summary with per-position cosines and max |diff|) of bitserve vs transformers
    logits."""
    max_logit = expected.abs().max().item()
    cosines = torch.nn.functional.cosine_similarity(expected, actual, dim=-1)  # [num_tokens]
    max_abs_diff = (expected - actual).abs().max().item()
    top2 = expected.topk(2, dim=-1).values  # [num_tokens, 2]
    is_decisive = (top2[:, 0] - top2[:, 1]) >= MIN_TOP2_MARGIN
    mismatched = (is_decisive & (expected.argmax(-1) != actual.argmax(-1))).nonzero().flatten().tolist()
    summary = (
        f"min cosine {cosines.min().item():.7f} (per position {[round(c, 6) for c in cosines.tolist()]}), "
        f"max |diff| {max_abs_diff:.3g} on a max |logit| {max_logit:.3g}"
    )
    failures = []
    if cosines.min().item() < MIN_COSINE:
        failures.append(f"cosine < {MIN_COSINE}")
    if max_diff_fraction is not None and max_abs_diff > max_diff_fraction * max_logit:
        failures.append(f"max |diff| > {max_diff_fraction} * max |logit|")
    if mismatched:
        failures.append(
            f"greedy argmax differs at positions {mismatched} (top-2 margin >= {MIN_TOP2_MARGIN})"
        )
    return failures, summary


def assert_not_degenerate(logits: torch.Tensor) -> None:
    # a wrong copy that zeroes or flattens the logits could agree with itself; these random weights give
    # logits of std ~0.3 that change from one position to the next
    assert torch.isfinite(logits).all()
    assert logits.std().item() > 0.05, f"logits are near-constant (std {logits.std().item():.3g})"
    assert (logits[1:] - logits[:-1]).abs().max().item() > 0.05, "every position gives the same logits"


@pytest.fixture(scope="module")
def llms(synthetic_models: dict[str, Path]) -> Iterator[dict[str, LLM]]:
    """The fixture's F32 and I2_S files, default (bitnet) linear mode."""
    out = {fmt: LLM(str(synthetic_models[fmt]), backend="reference") for fmt in ("F32", "I2_S")}
    yield out
    for llm in out.values():
        llm.close()


@pytest.fixture(scope="module")
def varied_weights(synthetic_weights) -> SyntheticWeights:  # noqa: ANN001
    """The fixture weights with non-unit norms and a distinct scale per projection, so that a norm or a scale
    read from the wrong tensor (e.g. attn_norm for ffn_norm, one layer's scale for another's) shows."""
    weights = synthetic_weights[1]
    rng = np.random.default_rng(1)
    norms = {
        name: rng.uniform(0.5, 1.5, size=vector.shape).astype(np.float32)
        for name, vector in weights.norms.items()
    }
    scales = {key: float(np.float32(rng.uniform(0.02, 0.08))) for key in weights.scales}
    return dataclasses.replace(weights, norms=norms, scales=scales)


@pytest.fixture(scope="module")
def varied_paths(
    synthetic_config: SyntheticConfig,
    synthetic_weights,
    varied_weights: SyntheticWeights,  # noqa: ANN001
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("varied")
    tokenizer = synthetic_weights[0]
    return {
        fmt: write_synthetic_model(
            folder / f"varied-{fmt}.gguf",
            fmt,
            config=synthetic_config,
            weights=varied_weights,
            tokenizer=tokenizer,
        )
        for fmt in ("F32", "I2_S")
    }


@pytest.fixture(scope="module")
def hf_models(
    synthetic_config: SyntheticConfig,
    synthetic_weights,
    varied_weights: SyntheticWeights,  # noqa: ANN001
) -> Callable[[str, bool], BitNetForCausalLM]:
    """get(weights "unit" | "varied", is_quantized) -> transformers model, each built once per module."""
    built: dict[tuple[str, bool], BitNetForCausalLM] = {}
    sources = {"unit": synthetic_weights[1], "varied": varied_weights}

    def get(name: str, is_quantized: bool) -> BitNetForCausalLM:
        if (name, is_quantized) not in built:
            built[(name, is_quantized)] = build_hf_model(
                synthetic_config, sources[name], is_quantized=is_quantized
            )
        return built[(name, is_quantized)]

    return get


@pytest.mark.parametrize("fmt", ["F32", "I2_S"])
def test_bitnet_mode_matches_transformers(llms, hf_models, fmt: str) -> None:  # noqa: ANN001
    llm = llms[fmt]
    # the default: per-token int8 activations (docs/formats.md §3.1)
    assert llm.instance.loaded.linear_mode is LinearMode.BITNET
    hf_model = hf_models("unit", True)
    for prompt in PROMPTS:
        token_ids = llm.encode(prompt)
        expected = hf_logits(hf_model, token_ids)
        assert_not_degenerate(expected)
        # No max |diff| bound here: a quantized net is discontinuous. An fp32 difference of one ulp (e.g. in
        # attention) can move x*s_act across a .5 tie, one int8 code differs, and later layers re-quantize
        # the shifted activations, a cascade measured at ~3% of the max logit (cosine ~0.9992) with the
        # varied weights; that is rounding, not a bug. test_projections_match_autobitlinear pins the math.
        failures, summary = parity_failures(
            expected, bitserve_logits(llm.instance.loaded.model, token_ids), None
        )
        assert not failures, f"{fmt} {prompt!r}: {'; '.join(failures)}; {summary}"


@pytest.mark.parametrize("fmt", ["F32", "I2_S"])
def test_projections_match_autobitlinear(hf_models, varied_paths, fmt: str) -> None:  # noqa: ANN001
    """Each of the 14 projections, fed one random input [num_tokens, in] on both sides: bitserve's bitnet
    linear (scale included) equals HF's AutoBitLinear to summation order, and visibly differs from
    F.linear without ActQuant."""
    hf_model = hf_models("varied", True)
    loaded = load_model(
        varied_paths[fmt], LoadOptions(backend=select_backend("reference"), linear_mode=LinearMode.BITNET)
    )
    generator = torch.Generator().manual_seed(0)
    try:
        for layer_id, layer in enumerate(loaded.model.layers):
            groups = {
                "attn_q": (layer.qkv, 0),
                "attn_k": (layer.qkv, 1),
                "attn_v": (layer.qkv, 2),
                "attn_output": (layer.o_proj, None),
                "ffn_gate": (layer.gate_up, 0),
                "ffn_up": (layer.gate_up, 1),
                "ffn_down": (layer.down_proj, None),
            }
            for name, (module, index) in groups.items():
                hf_linear = hf_model.model.layers[layer_id].get_submodule(HF_PROJECTIONS[name])
                # rows of different magnitudes: per-token scales must not mix across rows
                x = (
                    torch.randn(6, hf_linear.in_features, generator=generator)
                    * torch.logspace(-2, 1, 6)[:, None]
                )
                expected = run_hf(hf_linear, x)  # [6, out]
                with torch.inference_mode():
                    actual = module(x) if index is None else module(x)[index]
                    unquantized = torch.nn.functional.linear(x, hf_linear.weight) * hf_linear.weight_scale
                diff = (expected - actual).abs().max().item()
                max_y = expected.abs().max().item()
                assert diff <= MAX_LINEAR_DIFF_FRACTION * max_y, (
                    f"blk.{layer_id}.{name}: max |diff| {diff:.3g} on max |y| {max_y:.3g}"
                )
                quant_effect = (expected - unquantized).abs().max().item()
                assert quant_effect > MIN_UNQUANTIZED_DIFF_FRACTION * max_y, (
                    f"blk.{layer_id}.{name}: ActQuant had no effect"
                )
    finally:
        loaded.close()


@pytest.mark.parametrize("fmt", ["F32", "I2_S"])
def test_float_mode_matches_transformers(llms, hf_models, varied_paths, fmt: str) -> None:  # noqa: ANN001
    """bitserve's float mode (no activation quantization) against plain nn.Linear layers holding t * scale,
    on the varied norms and scales: continuous on both sides, so the whole model can be held to a tight
    bound."""
    hf_model = hf_models("varied", False)
    loaded = load_model(
        varied_paths[fmt], LoadOptions(backend=select_backend("reference"), linear_mode=LinearMode.FLOAT)
    )
    try:
        for prompt in PROMPTS:
            token_ids = llms["F32"].encode(prompt)  # same tokenizer in every synthetic file
            expected = hf_logits(hf_model, token_ids)
            assert_not_degenerate(expected)
            failures, summary = parity_failures(
                expected, bitserve_logits(loaded.model, token_ids), MAX_FLOAT_DIFF_FRACTION
            )
            assert not failures, f"varied {fmt} {prompt!r}: {'; '.join(failures)}; {summary}"
    finally:
        loaded.close()


def test_rope_pairing_is_visible(llms, synthetic_config, synthetic_weights) -> None:  # noqa: ANN001
    """`bitnet` files need no q/k permutation: HF rotate-half on the stored rows matches (tests above), while
    the same rows permuted for NORM-style pairing (what a `llama` converter does) must break parity."""
    wrong = build_hf_model(synthetic_config, synthetic_weights[1], is_quantized=True, is_norm_rope=True)
    token_ids = llms["F32"].encode(PROMPTS[2])
    failures, summary = parity_failures(
        hf_logits(wrong, token_ids), bitserve_logits(llms["F32"].instance.loaded.model, token_ids), None
    )
    assert any(failure.startswith("cosine") for failure in failures), summary

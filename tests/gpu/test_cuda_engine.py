"""The engine on a CUDA device gives the tokens of the reference backend on CPU (issue 11).

Run on a GPU machine: `pytest -m gpu tests/gpu tests/kernels` (CI deselects `gpu`). Models: a small
bitnet-b1.58 I2_S file (the CUDA decoder's fused ternary path, GQA) written with the 2B-4T writer, and
the synthetic upstream `bitnet` TQ2_0 file of the CPU golden tests (per-projection output scales: the
unfused path). The KV cache is f32 where tokens are compared with the f32 CPU reference, and f16 where
they are compared with a CPU engine that also keeps an f16 cache (both round K/V the same way).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from bitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ENGINE_GOLDEN = Path(__file__).resolve().parent.parent / "engine" / "test_engine_golden.py"
COVERAGE_GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden" / "coverage.json"


def _golden_helpers():  # noqa: ANN202 - the CPU golden test's prompt set and staggered driver
    import importlib.util

    spec = importlib.util.spec_from_file_location("engine_golden", ENGINE_GOLDEN)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _gemma3_golden() -> tuple[int, list[dict]]:
    """(tokens per continuation, the prompts of llama.cpp's gemma3 F32 case: ids, continuation, margins,
    ranges), tests/fixtures/golden/coverage.json."""
    golden = json.loads(COVERAGE_GOLDEN.read_text(encoding="utf-8"))
    case = next(c for c in golden["cases"] if (c["arch"], c["weight_type"]) == ("gemma3", "F32"))
    return golden["num_tokens"], case["prompts"]


def engine_config(
    path: Path, device: str, *, kv: str, graphs: bool = True, backend: str = "auto", **tuning: bool
) -> EngineConfig:
    """tuning: ModelConfig's kernel knobs (cuda_lookahead, cuda_greedy_head, ...)."""
    return EngineConfig(
        model=ModelConfig(
            model=str(path), device=device, backend=backend, kv_cache_dtype=kv, cuda_graphs=graphs, **tuning
        ),
        cache=CacheConfig(block_size=4, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
    )


def staggered_tokens(config: EngineConfig) -> dict[str, list[int]]:
    golden = _golden_helpers()
    llm = LLM(config=config)
    try:
        return golden.run_engine_staggered(llm, golden.make_prompts(llm))
    finally:
        llm.close()


@pytest.mark.parametrize("graphs", [True, False])
def test_fused_ternary_path_equals_cpu_reference(b158_file: Path, graphs: bool) -> None:
    expected = staggered_tokens(engine_config(b158_file, "cpu", kv="float32", backend="reference"))
    got = staggered_tokens(engine_config(b158_file, "cuda", kv="float32", graphs=graphs))
    assert got == expected


def test_f16_cache_equals_cpu_f16_cache(b158_file: Path) -> None:
    expected = staggered_tokens(engine_config(b158_file, "cpu", kv="float16", backend="reference"))
    assert staggered_tokens(engine_config(b158_file, "cuda", kv="float16")) == expected


def test_unfused_output_scale_path_equals_cpu_reference(synthetic_models: dict[str, Path]) -> None:
    path = synthetic_models["TQ2_0"]
    expected = staggered_tokens(engine_config(path, "cpu", kv="float32", backend="reference"))
    assert staggered_tokens(engine_config(path, "cuda", kv="float32")) == expected


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0", "Q1_0", "Q2_0"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_architectures_equal_cpu_reference(hf_gguf, arch: str, weight_type: str) -> None:  # noqa: ANN001
    """Converted random-init Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) checkpoints, in F32,
    Q8_0 (block GEMV) and llama.cpp's Q1_0 / Q2_0 (dequantized at load): staggered requests with prefix
    caching, CUDA graphs on, give the CPU reference backend's greedy tokens."""
    _, path = hf_gguf(arch, weight_type)
    expected = staggered_tokens(engine_config(path, "cpu", kv="float32", backend="reference"))
    assert staggered_tokens(engine_config(path, "cuda", kv="float32")) == expected


def test_many_sequences_in_one_graph_bucket(b158_file: Path) -> None:
    """33 sequences (bucket 64, 31 padded rows) decode exactly as each does alone."""
    config = dataclasses.replace(
        engine_config(b158_file, "cuda", kv="float32"),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
    )
    llm = LLM(config=config)
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        prompts = [[(11 * i + j) % 500 + 20 for j in range(3 + i % 7)] for i in range(33)]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts[:5]]
        assert together[:5] == alone
    finally:
        llm.close()


def lookahead_run(
    path: Path, enabled: bool, monkeypatch: pytest.MonkeyPatch, slot: bool = False
) -> tuple[list, object]:
    """Greedy tokens of sequences that end at different steps (a batch that shrinks, blocks of 4 so
    guesses stop at every fourth position unless the scheduler reserves the next slot), with a seeded
    sampled one among them for half of the run, and the runner's lookahead counts."""
    config = engine_config(path, "cuda", kv="float32", cuda_lookahead=enabled, cuda_lookahead_slot=slot)
    llm = LLM(config=config)
    try:
        prompts = [[(13 * i + j) % 400 + 30 for j in range(2 + 3 * i)] for i in range(4)]
        greedy = [SamplingParams(max_tokens=12 + 9 * i, temperature=0, ignore_eos=True) for i in range(4)]
        tokens = [llm.generate([p], g)[0].outputs[0].token_ids for p, g in zip(prompts, greedy, strict=True)]
        both = llm.generate(prompts, greedy[3])  # all four at once, ending together
        tokens += [o.outputs[0].token_ids for o in both]
        sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True)
        mixed = [llm.generate([prompts[0]], sampled)[0].outputs[0].token_ids]
        return tokens + mixed, dataclasses.replace(llm.instance.engine.runner.lookahead_stats)
    finally:
        llm.close()


def test_greedy_head_tokens_equal_the_full_head(b158_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy decode steps launched ahead end in the greedy head (the argmax from an int8 copy of the F16
    head, kernels/cuda/greedy_head.py): the same tokens as with it off (BITSERVE_CUDA_GREEDY_HEAD=0)."""
    runs = {}
    for enabled in (True, False):
        llm = LLM(config=engine_config(b158_file, "cuda", kv="float32", cuda_greedy_head=enabled))
        try:
            assert (llm.instance.engine.runner.decoder.greedy_head is not None) is enabled
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            prompts = [[(17 * i + j) % 450 + 25 for j in range(3 + 4 * i)] for i in range(3)]
            alone = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
            together = [output.outputs[0].token_ids for output in llm.generate(prompts[:2], params)]
            runs[enabled] = (alone, together, llm.instance.engine.runner.lookahead_stats.hits)
        finally:
            llm.close()
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][2] > 0  # steps launched ahead (the greedy graphs) were used


@pytest.mark.parametrize("slot", [False, True])
def test_lookahead_tokens_equal_lookahead_off(
    b158_file: Path, monkeypatch: pytest.MonkeyPatch, slot: bool
) -> None:
    """Steps launched ahead are used (most decode steps) and change no token; with the next KV slot
    reserved (the default; BITSERVE_CUDA_LOOKAHEAD_SLOT=0 stops it) the launch ahead crosses block
    boundaries too, so its device block table must take the blocks appended since
    (cuda_graphs.replay_next)."""
    on, on_stats = lookahead_run(b158_file, True, monkeypatch, slot)
    off, off_stats = lookahead_run(b158_file, False, monkeypatch)
    assert on == off
    assert off_stats.launched == 0
    assert on_stats.hits > 0.5 * on_stats.launched > 0
    if slot:  # every decode step is guessed, block boundaries included, but six that no launch can know:
        # each greedy call's first all-decode step (after a prefill: 4 calls alone, then 4 sequences at
        # once), and the batch's last: its fourth prompt is prefilled in two chunks (16-token budget), so
        # it ends a step after the others and that step runs alone (the scheduler's steps, replayed on
        # CPU, 2026-11-28: 130 of 136)
        engine_steps = sum(len(tokens) - 1 for tokens in on[:5])
        assert on_stats.hits == on_stats.launched == engine_steps - 6


@pytest.mark.parametrize("graphs", [True, False])
def test_dense_q4_model_matches_cpu(tmp_path: Path, tokenizer_source: Path, graphs: bool) -> None:
    """A SmolLM2-shaped Q4_1 llama (Q8_0 tied head): the prefill step (cuBLAS on the f32 copies) and the
    decode steps (block_gemv on the packed blocks, norm / activation / residual in its launch; with and
    without CUDA graphs) give the CPU reference backend's greedy tokens, and each step's top-5 logprobs
    within fp32 summation-order tolerance."""
    from benchmarks.make_gpu_models import write_smollm2

    path = write_smollm2(tmp_path / "smollm2-q4_1.gguf", tokenizer_source)
    prompt = list(range(100, 140))
    outputs = {}
    for device, backend in (("cpu", "reference"), ("cuda", "auto")):
        config = engine_config(path, device, kv="float32", backend=backend, graphs=graphs)
        llm = LLM(config=config)
        try:
            out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, logprobs=5))
            outputs[device] = out[0].outputs[0]
        finally:
            llm.close()
    assert outputs["cuda"].token_ids == outputs["cpu"].token_ids
    for step_cuda, step_cpu in zip(outputs["cuda"].logprobs, outputs["cpu"].logprobs, strict=True):
        top_cuda, top_cpu = step_cuda.top_logprobs, step_cpu.top_logprobs
        assert [t for t, _ in top_cuda] == [t for t, _ in top_cpu]
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in top_cuda]),
            torch.tensor([lp for _, lp in top_cpu]),
            rtol=1e-4,
            atol=1e-4,
        )


def test_minicpm_equals_cpu_reference(hf_gguf) -> None:  # noqa: ANN001
    """MiniCPM's three scales through the engine: staggered requests, CUDA graphs on, give the CPU
    reference backend's greedy tokens."""
    _, path = hf_gguf("minicpm")
    expected = staggered_tokens(engine_config(path, "cpu", kv="float32", backend="reference"))
    assert staggered_tokens(engine_config(path, "cuda", kv="float32")) == expected


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_gemma3_equals_cpu_reference(hf_gguf, weight_type: str) -> None:  # noqa: ANN001
    """Gemma 3 (sliding layers over 5 positions, post-norms, GELU-tanh, scaled embeddings) in F32 and
    Q8_0 (block GEMV): staggered requests with chunked prefill and prefix caching, CUDA graphs on, give
    the CPU reference backend's greedy tokens; every prompt and continuation passes the window."""
    _, path = hf_gguf("gemma3", weight_type)
    expected = staggered_tokens(engine_config(path, "cpu", kv="float32", backend="reference"))
    assert staggered_tokens(engine_config(path, "cuda", kv="float32")) == expected


@pytest.mark.parametrize("graphs", [True, False])
def test_gemma3_batched_generation_equals_llamacpp(hf_gguf, graphs: bool) -> None:  # noqa: ANN001
    """The three golden prompts (8-15 tokens, window 5) batched, then again from the prefix cache: the
    greedy continuations are llama.cpp's (tests/fixtures/golden/coverage.json) up to its own near-ties
    (tests/models/test_gemma3.py's rule), with the decode steps in CUDA graphs (launched ahead) or eager."""
    from bitserve.testing.teacher_forced import continuation_agrees

    num_tokens, cases = _gemma3_golden()
    _, path = hf_gguf("gemma3")
    llm = LLM(config=engine_config(path, "cuda", kv="float32", graphs=graphs))
    try:
        prompts = [case["ids"] for case in cases]
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        for attempt in ("cold", "prefix cache"):
            outputs = [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]
            for ours, case in zip(outputs, cases, strict=True):
                assert continuation_agrees(ours, case), f"{attempt}: {ours} vs {case}"
            assert sum(o == c["continuation"] for o, c in zip(outputs, cases, strict=True)) >= 2
        if graphs:
            assert llm.instance.engine.runner.lookahead_stats.hits > 0  # the graphs' decode steps ran
    finally:
        llm.close()


def test_gemma3_logprobs_equal_cpu_reference(hf_gguf) -> None:  # noqa: ANN001
    """Each step's top-5 logprobs of the golden prompts, batched (prefill, then decode steps in CUDA
    graphs: the decode graphs' embedding scale and windows), within f32 tolerance of the CPU reference's."""
    _, path = hf_gguf("gemma3")
    prompts = [case["ids"] for case in _gemma3_golden()[1]]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True)
    outputs = {}
    for device, backend in (("cpu", "reference"), ("cuda", "auto")):
        llm = LLM(config=engine_config(path, device, kv="float32", backend=backend))
        try:
            outputs[device] = [out.outputs[0] for out in llm.generate(prompts, params)]
        finally:
            llm.close()
    for cuda, cpu in zip(outputs["cuda"], outputs["cpu"], strict=True):
        assert cuda.token_ids == cpu.token_ids
        for step_cuda, step_cpu in zip(cuda.logprobs, cpu.logprobs, strict=True):
            top_cuda, top_cpu = step_cuda.top_logprobs, step_cpu.top_logprobs
            assert [t for t, _ in top_cuda] == [t for t, _ in top_cpu]
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in top_cuda]),
                torch.tensor([lp for _, lp in top_cpu]),
                rtol=1e-4,
                atol=1e-4,
            )

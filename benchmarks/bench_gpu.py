"""GPU benchmarks of issue 11, one command on a CUDA machine; every row names the card.

    python benchmarks/bench_gpu.py --out results.jsonl [--quick] [--skip transformers,served]

Rows (one JSON object per line, also appended to --out):
- `copy`: device-to-device copy bandwidth of a 1 GiB buffer (bytes read + written per second): the
  measured bound every share below divides by.
- `kernel`: the largest ternary GEMVs (T = 1) and the F16 LM head, µs per call from CUDA-graph replays of
  back-to-back calls, each GEMV call on its own weight copy (together over twice the L2, so every call
  reads DRAM as in a decode step; until 2026-11-27 the calls re-read one copy from L2): GB/s of weight
  bytes, share of the copy bandwidth, and the read floor (gpu_read_floor.py: the fastest kernel that
  only reads those bytes, timed the same way) with the GEMV's share of it.
- `decode`: 2B-4T-shaped I2_S and SmolLM2-135M-shaped Q4_1, batch 1, greedy, 128 tokens after a short
  prompt: tok/s and ms per step (prefill excluded: the time of a max_tokens=1 run is subtracted), and for
  the 2B model the bandwidth bound (weight bytes per token / copy bandwidth) and its share.
- `offline`: 2B-4T at 16 / 64 / 256 concurrent sequences, 128 new tokens each: bitserve's LLM.generate
  beside transformers' BitNetForCausalLM (bf16, random weights of the same shape, greedy batched
  generate with min_new_tokens = max_new_tokens) in the same process: tok/s and the ratio.
- `formats`: the 2B weights as llama.cpp's Q2_0 (arch `bitnet`) beside I2_S, batch-1 decode of each
  loaded in turn, and the ratio.
- `served`: `bitserve serve --device cuda` on the 2B model and `bitserve bench` at 100 concurrent
  100-token completions: p50 / p99 end-to-end latency.
Models are written first where missing (benchmarks/make_gpu_models.py) from the carried vocab file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bitserve import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ROOT / ".carry" / "smollm2-vocab.gguf"
MODEL_2B = Path("/tmp/bitserve-gpu/2b4t-i2s.gguf")
MODEL_SMOL = Path("/tmp/bitserve-gpu/smollm2-q4_1.gguf")
MODEL_2B_Q2 = Path("/tmp/bitserve-gpu/2b4t-q2_0.gguf")  # the same weights in llama.cpp's Q2_0 (`formats`)
HIDDEN_2B, VOCAB_2B, LAYERS_2B = 2560, 128256, 30
TERNARY_2B = [(2560, 2560, 2), (640, 2560, 2), (6912, 2560, 2), (2560, 6912, 1)]  # (M, K, count) per layer


def emit(row: dict[str, Any], out: Path | None) -> None:
    row = {"card": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), **row}
    line = json.dumps(row)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if out is not None:
        with out.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def graph_time_us(fn: Callable[[int], Any], calls: int = 20, replays: int = 20) -> float:
    """Median µs per call of fn(i), from replays of a CUDA graph of `calls` back-to-back calls i = 0, 1,
    ... (fn picks its operands by i: distinct weight copies make every call read DRAM, not L2)."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes per second read + written by a 1 GiB device-to-device copy (median of 10)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * (1 << 30) / sorted(times[2:])[len(times[2:]) // 2]


def bench_kernels(bandwidth: float, out: Path | None) -> None:
    """Each GEMV timed over distinct weight copies (together over twice the L2: every call streams its
    weights from DRAM, as in a decode step), beside the floor of a kernel that only reads those bytes
    (gpu_read_floor.py), measured the same way."""
    from benchmarks.gpu_read_floor import distinct_copies, read_floor_us
    from bitserve.kernels.cuda.quantize import norm_quantize
    from bitserve.kernels.cuda.ternary_matmul import ternary_linear
    from bitserve.kernels.cuda.ternary_pack import pack_ternary_planes

    for m, k in [(6912, 2560), (2560, 6912), (13824, 2560), (3840, 2560), (2560, 2560)]:
        values = torch.randint(-1, 2, (m, k), dtype=torch.int8, device="cuda")
        packed, scale = pack_ternary_planes(values), torch.full((m,), 0.5, device="cuda")
        copies = [packed.clone() for _ in range(distinct_copies(packed.numel()))]
        x = torch.randn(1, k, device="cuda")
        q, s_act = norm_quantize(x, None, 0.0)
        us = graph_time_us(lambda i: ternary_linear(q, s_act, copies[i], scale), len(copies))  # noqa: B023
        floor_us = read_floor_us(packed.numel(), graph_time_us)
        gbps = packed.numel() / (us * 1e-6) / 1e9
        row = {"bench": "kernel", "kernel": f"ternary {m}x{k} T=1", "us": round(us, 2), "GB_s": round(gbps)}
        row |= {"share_of_copy_bw": round(gbps * 1e9 / bandwidth, 3), "read_floor_us": round(floor_us, 2)}
        emit(row | {"share_of_read_floor": round(floor_us / us, 3)}, out)
    head = torch.randn(VOCAB_2B, HIDDEN_2B, device="cuda").half()
    x = torch.randn(1, HIDDEN_2B, device="cuda")
    us = graph_time_us(lambda i: torch.nn.functional.linear(x.half(), head))  # 657 MB: DRAM every call
    gbps = head.numel() * 2 / (us * 1e-6) / 1e9
    row = {"bench": "kernel", "kernel": f"F16 LM head {VOCAB_2B}x{HIDDEN_2B} T=1", "us": round(us, 2)}
    emit(row | {"GB_s": round(gbps), "share_of_copy_bw": round(gbps * 1e9 / bandwidth, 3)}, out)
    bench_greedy_head(head, bandwidth, us, out)


def bench_greedy_head(head: torch.Tensor, bandwidth: float, full_us: float, out: Path | None) -> None:
    """The greedy head (kernels/cuda/greedy_head.py: the argmax from an int8 copy of the head, plus the
    exact logits of the candidate rows) on the same F16 head at T = 1, beside the full head's µs; each
    input's argmax checked against cuBLAS's, and the rows it scored exactly."""
    from bitserve.kernels.cuda.argmax import cast_argmax_rows
    from bitserve.kernels.cuda.greedy_head import GreedyHead

    greedy = GreedyHead(head)
    inputs = [torch.randn(1, HIDDEN_2B, device="cuda").half() for _ in range(8)]
    for x in inputs:
        _, expected = cast_argmax_rows(torch.nn.functional.linear(x, head))
        _, got = cast_argmax_rows(greedy(x))
        if got.tolist() != expected.tolist():
            raise AssertionError(f"greedy head argmax {got.tolist()} != cuBLAS {expected.tolist()}")
    us = graph_time_us(lambda i: greedy(inputs[i % len(inputs)]))
    gbps = greedy.quantized.numel() / (us * 1e-6) / 1e9  # the int8 copy: the bytes every call reads
    row = {"bench": "kernel", "kernel": f"greedy head (int8 copy + exact candidates) {VOCAB_2B}x{HIDDEN_2B}"}
    row |= {"us": round(us, 2), "full_head_us": round(full_us, 2), "GB_s": round(gbps)}
    row |= {"share_of_copy_bw": round(gbps * 1e9 / bandwidth, 3)}
    emit(row | {"max_candidates": int(max(int(greedy.candidates(x).max()) for x in inputs))}, out)


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return time.perf_counter() - start


def decode_rate(
    llm: LLM, num_seqs: int, new_tokens: int, prompt_len: int = 16, repeats: int = 3
) -> dict[str, float]:
    """Decode tok/s: the median over `repeats` of (a full generate - a prefill-only generate), after a
    full-length warm-up. (One timed pair after a 4-token warm-up read 1.16 ms a SmolLM2 step on an H100
    whose engine-step median was 0.50 ms on the same build minutes later, 2026-11-27: a single pair
    carries whatever one-off cost or host hiccup lands in it.)"""
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(num_seqs)]
    timed_generate(llm, prompts, new_tokens + 1)  # warm-up: prefill shapes, every decode bucket
    runs = []
    for _ in range(repeats):
        prefill_s = timed_generate(llm, prompts, 1)
        total_s = timed_generate(llm, prompts, new_tokens + 1)
        runs.append((max(total_s - prefill_s, 1e-9), total_s))
    decode_s, total_s = sorted(runs)[len(runs) // 2]
    stats = llm.engine.runner.lookahead_stats  # steps launched ahead / used, over all runs
    return {
        "tok_s": round(num_seqs * new_tokens / decode_s, 1),
        "ms_per_step": round(decode_s / new_tokens * 1000, 3),
        "wall_tok_s": round(num_seqs * (new_tokens + 1) / total_s, 1),
        "lookahead_hits": f"{stats.hits}/{stats.launched}",
    }


def bytes_per_token_2b() -> int:
    ternary = sum(m * k * c for m, k, c in TERNARY_2B) * LAYERS_2B // 4
    return ternary + VOCAB_2B * HIDDEN_2B * 2  # + the F16 head, read whole every step


def transformers_rate(num_seqs: int, new_tokens: int, prompt_len: int = 16) -> float:
    """tok/s of transformers' BitNetForCausalLM, bf16, 2B-4T shape, random weights, greedy batched."""
    from transformers import BitNetConfig, BitNetForCausalLM

    config = BitNetConfig(
        vocab_size=VOCAB_2B,
        hidden_size=HIDDEN_2B,
        intermediate_size=6912,
        num_hidden_layers=LAYERS_2B,
        num_attention_heads=20,
        num_key_value_heads=5,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    )
    model = _transformers_model(BitNetForCausalLM, config)
    ids = torch.randint(10, 1000, (num_seqs, prompt_len), device="cuda")
    mask = torch.ones_like(ids)

    def run(tokens: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(2)  # warm-up
    return num_seqs * new_tokens / run(new_tokens)


_TRANSFORMERS_CACHE: dict[str, Any] = {}


def _transformers_model(cls: Any, config: Any) -> Any:
    if "model" not in _TRANSFORMERS_CACHE:
        with torch.device("cuda"):
            _TRANSFORMERS_CACHE["model"] = cls(config).to(torch.bfloat16).eval()
    return _TRANSFORMERS_CACHE["model"]


def bench_offline(llm: LLM, levels: list[int], skip_transformers: bool, out: Path | None) -> None:
    for num_seqs in levels:
        ours = decode_rate(llm, num_seqs, 128)
        row = {"bench": "offline", "model": "2b4t-i2s", "num_seqs": num_seqs, "new_tokens": 128}
        row |= {"bitserve_wall_tok_s": ours["wall_tok_s"], "bitserve_decode_tok_s": ours["tok_s"]}
        if not skip_transformers:
            theirs = transformers_rate(num_seqs, 128)
            row |= {
                "transformers_bf16_tok_s": round(theirs, 1),
                "ratio": round(ours["wall_tok_s"] / theirs, 2),
            }
        emit(row, out)


def bench_served(out: Path | None, server_args: list[str], port: int = 8123) -> None:
    """bitserve serve on the 2B model (plus server_args), then bitserve bench at 100 concurrent
    100-token completions."""
    import httpx

    server = subprocess.Popen(
        [sys.executable, "-m", "bitserve", "serve", "--model", str(MODEL_2B), "--device", "cuda"]
        + ["--port", str(port), "--kv-cache-memory-bytes", str(8 << 30), "--log-level", "WARNING"]
        + server_args,
        cwd=ROOT,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise RuntimeError("the server did not become ready in 300 s")
        bench = subprocess.run(
            [sys.executable, "-m", "bitserve", "bench", "--url", f"http://127.0.0.1:{port}"]
            + ["--concurrency", "100", "--num-requests", "300", "--max-tokens", "100", "--ignore-eos"]
            + ["--num-warmup", "20", "--endpoint", "completions", "--json"],  # as in the earlier rows
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        level = json.loads(bench.stdout)["levels"][0]
        e2e, ttft = level["e2e_s"], level["ttft_s"]
        row = {"bench": "served", "model": "2b4t-i2s", "concurrency": 100, "max_tokens": 100}
        row |= {"server_args": " ".join(server_args)} if server_args else {}
        row |= {"num_ok": level["num_ok"], "num_errors": level["num_errors"]}
        row |= {"e2e_p50_s": e2e["p50"], "e2e_p99_s": e2e["p99"], "ttft_p99_s": ttft["p99"]}
        emit(row | {"output_tok_s": round(level["output_tokens_per_s"], 1)}, out)
    finally:
        server.terminate()
        server.wait(timeout=60)


def ensure_models(skip: set[str]) -> None:
    maker = [sys.executable, str(ROOT / "benchmarks" / "make_gpu_models.py")]
    for what, path in (("2b4t", MODEL_2B), ("smollm2", MODEL_SMOL)):
        if not path.exists():
            subprocess.run(maker + [what, str(path), "--tokenizer-from", str(VOCAB)], check=True)
    if "formats" not in skip and not MODEL_2B_Q2.exists():
        twin = ["2b4t", str(MODEL_2B_Q2), "--format", "Q2_0", "--tokenizer-from", str(VOCAB)]
        subprocess.run(maker + twin, check=True)


def bench_formats(out: Path | None) -> None:
    """Batch-1 decode of the 2B weights as Q2_0 beside I2_S, each loaded in turn (a BitNet model in Q2_0
    runs as ternary codes on the same CUDA kernels: loader/model_loader.linear)."""
    rates = {}
    for name, path in (("2b4t-i2s", MODEL_2B), ("2b4t-q2_0", MODEL_2B_Q2)):
        llm = load_on_cuda(path, 1 << 30)
        rates[name] = decode_rate(llm, 1, 128)
        emit({"bench": "formats", "model": name, "batch": 1} | rates[name], out)
        llm.close()
        del llm
        torch.cuda.empty_cache()
    ratio = rates["2b4t-q2_0"]["tok_s"] / rates["2b4t-i2s"]["tok_s"]
    emit({"bench": "formats", "ratio_q2_0_over_i2s": round(ratio, 3)}, out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="append the JSON rows to this file")
    parser.add_argument(
        "--skip", default="", help="comma-separated: kernels,decode,offline,transformers,served,formats"
    )
    parser.add_argument("--levels", default="16,64,256", help="offline concurrency levels")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="an extra `bitserve serve` argument of the served row (repeat: --server-arg=--http-parser=h11)",
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    ensure_models(skip)
    bandwidth = copy_bandwidth()
    emit({"bench": "copy", "GB_s": round(bandwidth / 1e9)}, args.out)
    if "kernels" not in skip:
        bench_kernels(bandwidth, args.out)
    kv = 8 << 30
    if "decode" not in skip:
        smol = LLM(str(MODEL_SMOL), device="cuda")
        emit(
            {"bench": "decode", "model": "smollm2-135m-q4_1-shaped", "batch": 1} | decode_rate(smol, 1, 128),
            args.out,
        )
        del smol
    if not {"decode", "offline"} <= skip:
        llm = _load_2b(kv)
        if "decode" not in skip:
            rate = decode_rate(llm, 1, 128)
            bound = bandwidth / bytes_per_token_2b()
            row = {"bench": "decode", "model": "2b4t-i2s", "batch": 1, **rate}
            share = round(rate["tok_s"] / bound, 3)
            emit(row | {"bound_tok_s": round(bound), "share_of_bound": share}, args.out)
        if "offline" not in skip:
            levels = [int(v) for v in args.levels.split(",")]
            bench_offline(llm, levels, "transformers" in skip, args.out)
        del llm
        torch.cuda.empty_cache()
    if "formats" not in skip:
        bench_formats(args.out)
    if "served" not in skip:
        bench_served(args.out, args.server_arg)


def _load_2b(kv_bytes: int) -> LLM:
    return load_on_cuda(MODEL_2B, kv_bytes)


def load_on_cuda(path: Path | str, kv_bytes: int, **model_options: Any) -> LLM:
    """An LLM on the model file with a KV cache of kv_bytes on the CUDA device; model_options: further
    ModelConfig fields (the kernel knobs: cuda_lookahead, cuda_greedy_head, ...)."""
    from bitserve.config import EngineConfig, ModelConfig

    model = ModelConfig(model=str(path), device="cuda", **model_options)
    return LLM(config=EngineConfig(model=model, kv_cache_memory_bytes=kv_bytes))


if __name__ == "__main__":
    main()

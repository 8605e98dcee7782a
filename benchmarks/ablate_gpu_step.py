"""What each class of kernel costs inside the batch-1 decode chain on CUDA: the step's CUDA graph replayed
with one class swapped for a trivial PDL kernel, against the full graph, in one process on one card.

    python benchmarks/ablate_gpu_step.py /tmp/bitserve-gpu/2b4t-i2s.gguf [--classes norm,rope,...]

Per-kernel profiler times do not answer this under PDL (a kernel launched early is timed while it waits),
and a kernel's standalone time is not its cost in the chain (its loads before the PDL wait overlap the
kernel before it). Here each class in turn (`norm` = norm_quantize, `rope` = RoPE + KV write, `attention`
= decode attention, `ternary` = the W2A8 linears, `block` = the Q4 / Q8 GEMVs, `head` = the LM head) is
replaced by `_trivial`: one program that waits for its predecessor, reads one value, writes one value,
and lets the next kernel launch, the cheapest link a chain can have. `saved_us` is what the class costs
beyond such links; `all` swaps every class (the chain of trivial links alone, plus the embedding and the
final norm). Outputs of an ablated step are garbage (buffers are zeros, written once): only time counts.
`norm_free` and `rope_free` remove norm_quantize / RoPE + KV write with no link at all (their outputs are
zeros buffers): the most a fusion of that class into a neighbour could save. One JSON line per variant.

The greedy head's time depends on its input (an ablated step's garbage hidden state can make every head
row a candidate for exact scoring: ~190 µs more on an H200), so every class but `head` is measured with
the head already trivial, against that step (the `head` row, always measured); `head` against the full
step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.profile_gpu_step import replay_us  # noqa: E402
from bitserve import LLM  # noqa: E402
from bitserve.kernels.cuda import decoder as cuda_decoder  # noqa: E402
from bitserve.kernels.cuda import decoder_layer  # noqa: E402
from bitserve.kernels.cuda.linears import CudaBlockLinear, CudaTernaryLinear  # noqa: E402
from bitserve.kernels.cuda.pdl import launch_options, pdl_enter  # noqa: E402

CLASSES = ("norm", "rope", "attention", "ternary", "block", "head")
FREE_CLASSES = ("norm_free", "rope_free")  # removed without a stand-in link (not part of "all")
_BUFFERS: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}


@triton.jit
def _trivial_kernel(src_ptr, dst_ptr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    tl.store(dst_ptr, tl.load(src_ptr).to(dst_ptr.dtype.element_ty))


def _trivial(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """One link: dst[0] = src[0] after the previous kernel; returns dst."""
    _trivial_kernel[(1,)](src, dst, **launch_options(src.device))
    return dst


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeros tensor per shape and dtype, made on first use: in the eager warm-up that precedes each
    graph capture, so the capture itself records no allocation or memset."""
    key = (tuple(shape), dtype)
    if key not in _BUFFERS:
        _BUFFERS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return _BUFFERS[key]


def _no_norm_quantize(x, norm_weight, eps, *, activation=None, out_q=None, out_scale=None):  # noqa: ANN001, ANN202
    width = x.shape[1] // 2 if activation is not None else x.shape[1]
    return _buffer((x.shape[0], width), torch.int8, x.device), _buffer((x.shape[0],), torch.float32, x.device)


def _fake_norm_quantize(x, norm_weight, eps, **kwargs):  # noqa: ANN001, ANN003, ANN202
    q, scale = _no_norm_quantize(x, norm_weight, eps, **kwargs)
    return q, _trivial(x, scale)


def _fake_rotary(q, k, v, *args, **kwargs) -> None:  # noqa: ANN001
    _trivial(q, q)


def _no_rotary(q, k, v, *args, **kwargs) -> None:  # noqa: ANN001
    return None


def _fake_attention(q, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    return _trivial(q, _buffer(tuple(q.shape), torch.float32, q.device))


def _fake_rows(x: torch.Tensor, columns: int) -> torch.Tensor:
    """A stand-in for a projection's output: [T, columns] zeros behind one trivial link."""
    return _trivial(x, _buffer((x.shape[0], columns), torch.float32, x.device))


def _fake_head(matrix):  # noqa: ANN001, ANN202
    """cuda_decoder._device_head's stand-in: (a trivial link writing [n, vocab] f32, its input dtype)."""
    vocab = matrix.shape[0] if isinstance(matrix, torch.Tensor) else matrix.out_features
    return (lambda hidden: _fake_rows(hidden, vocab)), torch.float32


@contextlib.contextmanager
def ablated(classes: set[str]) -> Iterator[None]:
    """Swap the named classes for trivial links while the model loads and captures its graphs."""
    saved: list[tuple[object, str, object]] = []

    def swap(owner: object, name: str, value: object) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if "norm" in classes:
        swap(decoder_layer, "norm_quantize", _fake_norm_quantize)
    if "norm_free" in classes:
        swap(decoder_layer, "norm_quantize", _no_norm_quantize)
    if "rope" in classes:
        swap(cuda_decoder, "rotary_and_cache_", _fake_rotary)
    if "rope_free" in classes:
        swap(cuda_decoder, "rotary_and_cache_", _no_rotary)
    if "attention" in classes:
        swap(cuda_decoder, "paged_decode_attention", _fake_attention)
    if "ternary" in classes:
        swap(
            CudaTernaryLinear,
            "run_quantized",
            lambda self, q, s, residual=None: _fake_rows(q, self.out_features),
        )
        swap(CudaTernaryLinear, "run_paired", lambda self, q, s, pair: _fake_rows(q, self.out_features // 2))
    if "block" in classes:
        swap(CudaBlockLinear, "run_fused", lambda self, x, *args, **kwargs: _fake_rows(x, self.out_features))
    if "head" in classes:
        swap(cuda_decoder, "_device_head", _fake_head)  # the decode graphs and compute_logits call it
        swap(cuda_decoder, "_greedy_head", lambda matrix: None)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        _BUFFERS.clear()


def measure(path: str, classes: set[str]) -> float:
    with ablated(classes):
        llm = LLM(path, device="cuda")
        graphs = llm.engine.runner.graphs
        # batch 1, the shortest-context bucket (one key, as after the load): best of 5 means of 200 replays
        # the graph a greedy decode step runs
        micros = replay_us(graphs.held_graph(1, graphs.widths[0], 1, greedy=True), count=200, rounds=5)
        llm.close()
    del llm
    torch.cuda.empty_cache()
    return micros


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument(
        "--classes",
        default=",".join(CLASSES),
        help="comma-separated, of " + ", ".join(CLASSES + FREE_CLASSES),
    )
    parser.add_argument("--rounds", type=int, default=2, help="passes over the variants (alternating)")
    args = parser.parse_args()
    variants = [name for name in args.classes.split(",") if name] + ["all"]
    unknown = set(variants) - set(CLASSES) - set(FREE_CLASSES) - {"all"}
    if unknown:
        parser.error(f"unknown classes {sorted(unknown)}")
    card = torch.cuda.get_device_name(0)
    # variant -> (classes swapped, the variant it is measured against); "head" is every other class's base
    plan: dict[str, tuple[set[str], str]] = {"full": (set(), "full"), "head": ({"head"}, "full")}
    for name in variants:
        if name == "all":
            plan[name] = (set(CLASSES), "full")
        elif name not in plan:
            plan[name] = ({name, "head"}, "head")
    results: dict[str, list[float]] = {name: [] for name in plan}
    for _ in range(args.rounds):
        for name, (classes, _) in plan.items():
            results[name].append(measure(args.model, classes))
    for name, (_classes, against) in plan.items():
        row = {
            "model": Path(args.model).name,
            "card": card,
            "ablated": name,
            "replay_us": [round(t, 1) for t in results[name]],
        }
        if name != "full":
            row["against"] = against
            row["saved_us"] = round(min(results[against]) - min(results[name]), 1)
        sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

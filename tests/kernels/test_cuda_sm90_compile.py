"""The 2B-4T decode step's newest Triton kernels compile for sm_90 (H100 / H200) on a machine without a GPU.

Triton lowers a kernel for a named target without a device, and its wheel carries ptxas: this catches what
the CPU interpreter cannot (a construct the GPU backend does not lower, an operand it rejects) before a
device session spends its time on it. Decode attention (split, its early reads before the PDL wait), its
reduce kernel, the ternary GEMV of each projection and the greedy head's two passes, at the 2B-4T shapes.
No timing and no numerics: tests/kernels' other files check those (interpreter, GPU).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
    pytest.skip("this Triton wheel carries no ptxas", allow_module_level=True)

from benchmarks.sass_count_gemv import PROJECTIONS, compile_for_sm90, compile_projection  # noqa: E402
from bitserve.kernels.cuda import greedy_head, paged_attention, paged_prefill  # noqa: E402


@pytest.fixture(autouse=True)
def _compiled_not_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET"):
        monkeypatch.delenv("TRITON_INTERPRET")


def _compile(kernel, types: dict[str, str], constexprs: dict, **options):  # noqa: ANN001, ANN003, ANN202
    """kernel compiled for sm_90: every argument not in constexprs needs its type in `types`."""
    signature = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
    return compile_for_sm90(kernel, signature, constexprs, **options)


@pytest.mark.parametrize("window", [0, 512])  # 0: full attention; 512: a sliding layer (Gemma 3 1B's)
def test_decode_attention_compiles(window: int) -> None:
    pointers = dict.fromkeys(("q_ptr", "out_ptr", "lse_ptr"), "*fp32")
    pointers |= {"k_ptr": "*fp16", "v_ptr": "*fp16", "table_ptr": "*i32", "lens_ptr": "*i32"}
    strides = [name for name in paged_attention._decode_kernel.arg_names if "stride" in name]
    types = pointers | dict.fromkeys(strides, "i32") | {"qk_scale": "fp32"}
    constexprs = {
        "GROUP": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "NUM_SPLITS": 4, "BLOCK_G": 16, "BLOCK_D": 128,
        "BLOCK_N": 64, "TERMS": 2, "P_SCALE": 16384.0, "USE_PDL": True, "WINDOW": window,
    }  # fmt: skip
    ptx = _compile(paged_attention._decode_kernel, types, constexprs, num_warps=4, num_stages=2).asm["ptx"]
    assert "griddepcontrol.wait" in ptx


@pytest.mark.parametrize("window", [0, 512])
def test_prefill_attention_compiles(window: int) -> None:
    """The varlen prefill kernel, and its sliding-window variant (a band-masked loop before the others)."""
    pointers = {"q_ptr": "*fp32", "out_ptr": "*fp32", "k_ptr": "*fp16", "v_ptr": "*fp16"}
    pointers |= {"table_ptr": "*i32", "lens_ptr": "*i32", "starts_ptr": "*i32"}
    strides = [name for name in paged_prefill._prefill_kernel.arg_names if "stride" in name]
    types = pointers | dict.fromkeys(strides, "i32") | {"qk_scale": "fp32"}
    constexprs = {
        "GROUP": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "GROUP_PAD": 4, "BLOCK_M": 64, "BLOCK_D": 128,
        "BLOCK_N": 64, "TERMS": 2, "P_SCALE": 16384.0, "WINDOW": window,
    }  # fmt: skip
    _compile(paged_prefill._prefill_kernel, types, constexprs, num_warps=4, num_stages=2)


def test_decode_reduce_compiles() -> None:
    types = {
        "part_ptr": "*fp32",
        "lse_ptr": "*fp32",
        "out_ptr": "*fp32",
        "out_stride_b": "i32",
        "out_stride_h": "i32",
    }
    constexprs = {"NUM_SPLITS": 4, "HEAD_DIM": 128, "BLOCK_S": 4, "BLOCK_D": 128, "USE_PDL": True}
    _compile(paged_attention._decode_reduce_kernel, types, constexprs, num_warps=2)


@pytest.mark.parametrize(("m", "k", "pair"), PROJECTIONS)
def test_ternary_gemv_compiles(m: int, k: int, pair: bool) -> None:
    compiled, _ = compile_projection(m, k, 1, pair)  # as launch_gemv launches it at T = 1
    assert "dp4a.s32.s32" in compiled.asm["ptx"]


@pytest.mark.parametrize("rows", [1, 2])
def test_greedy_head_compiles(rows: int) -> None:
    hidden = 2560
    block_bytes, _ = greedy_head.APPROX_TILES[rows]
    block = min(16, block_bytes // hidden)
    approx_types = dict.fromkeys(("scale_ptr", "approx_ptr", "partial_ptr", "bound_ptr"), "*fp32")
    approx_types |= {"x_ptr": "*fp16", "q_ptr": "*i32", "V": "i32", "programs": "i32", "e_factor": "fp32"}
    approx = {
        "ITERATIONS": 20, "B": rows, "HW": hidden // 4, "CW": 128, "BLOCK_V": block, "USE_ASM": True,
        "USE_PDL": True,
    }  # fmt: skip
    _compile(greedy_head._approx_kernel, approx_types, approx, num_warps=greedy_head.NUM_WARPS)
    rescore_types = dict.fromkeys(("scale_ptr", "approx_ptr", "partial_ptr", "bound_ptr"), "*fp32")
    rescore_types |= {"x_ptr": "*fp16", "w_ptr": "*fp16", "list_ptr": "*i32", "out_ptr": "*fp16", "V": "i32"}
    rescore_types |= dict.fromkeys(("out_max", "out_step", "out_tiny"), "fp32")
    rescore = {
        "B": rows, "H": hidden, "NUM_PARTIALS": 396, "PARTIALS_BLOCK": 512, "BLOCK_H": 512, "USE_PDL": True,
        "BLOCK_R": greedy_head.RESCORE_ROWS, "TILE": greedy_head.RESCORE_TILE,
    }  # fmt: skip
    _compile(
        greedy_head._rescore_kernel,
        rescore_types,
        rescore,
        num_warps=greedy_head.NUM_WARPS,
        enable_fp_fusion=False,
    )

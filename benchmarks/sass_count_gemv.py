"""SASS instruction counts of the ternary decode GEMV, compiled for sm_90 on a machine without a GPU.

    python benchmarks/sass_count_gemv.py [--tokens 1] [--set bitserve.kernels.cuda.ternary_matmul:ATTR=value]

Triton compiles for a named target without a device, and its wheel carries ptxas and cuobjdump. For each
of the 2B-4T step's four projections (with gemv_config's tile and the launch's constexprs, pointer
arguments specialized as 16-byte aligned as at run time) this prints the SASS instructions of one program
(the kernel is fully unrolled, so the static count is what each warp issues), the IDP (dp4a), LDG and
shared-memory operations among them, and the warp instructions one SM issues for the whole matrix. Inside
the decode chain a GEMV's weights arrive under the kernel before it (PDL), so the issue after the wait
is what the step pays for it: a count to compare variants before spending device time on them. No timing.
`cycles` is a rough issue time (scheduler_cycles); `--sweep` ranks other tiles by it.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # profile_gpu_step, also when imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import triton  # noqa: E402
from profile_gpu_step import apply_settings  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bitserve.kernels.cuda import ternary_matmul  # noqa: E402
from bitserve.kernels.cuda.pair_epilogue import GATED_PAIRS, PAIR_NONE  # noqa: E402

SM_COUNT = 132  # an H100 / H200 SXM
SM90 = GPUTarget("cuda", 90, 32)
# the 2B-4T step's projections: (M, K, gated pair epilogue)
PROJECTIONS = [(3840, 2560, False), (2560, 2560, False), (13824, 2560, True), (2560, 6912, False)]
POINTERS = ("q_ptr", "w_ptr", "s_ptr", "scale_ptr", "res_ptr", "out_ptr")
POINTER_TYPES = ("*i32", "*i32", "*fp32", "*fp32", "*fp32", "*fp32")


def compile_projection(
    m: int, k: int, num_tokens: int, pair: bool, tile: tuple[int, int, int] | None = None
) -> tuple[object, ternary_matmul.GemvConfig]:
    """The GEMV of an M x K projection at T tokens, as launch_gemv would launch it (with `tile`, a
    KernelTuning.cuda_gemv_tiles override: (block_m, block_w, num_warps)), compiled for sm_90."""
    overrides = None if tile is None else {(m, k, num_tokens): tile}
    cfg = ternary_matmul.gemv_config(m, k, num_tokens, overrides)
    pair_code = GATED_PAIRS["relu2"] if pair else PAIR_NONE
    constexprs = ternary_matmul.gemv_constexprs(m, k, num_tokens, cfg, pair_code, not pair, True)
    constexprs["USE_PDL"] = True
    kernel = ternary_matmul._gemv_kernel
    signature = dict(zip(POINTERS, POINTER_TYPES, strict=True)) | {"M": "i32"}
    signature |= {name: "constexpr" for name in constexprs}
    aligned = [*POINTERS, "M"] if m % 16 == 0 else list(POINTERS)
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    options = {"num_warps": cfg.num_warps, "enable_fp_fusion": False}
    return compile_for_sm90(kernel, signature, constexprs, attrs, **options), cfg


def compile_for_sm90(kernel, signature: dict, constexprs: dict, attrs: dict | None = None, **options):  # noqa: ANN001, ANN003, ANN201
    """A Triton kernel compiled for sm_90 without a device (Triton's bundled ptxas); `options` are the
    launch's (num_warps, enable_fp_fusion, ...)."""
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=SM90, options=options)


def sass_opcodes(compiled: object) -> collections.Counter:
    """Opcode (without modifiers) -> count in the kernel's SASS (Triton's bundled cuobjdump)."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])  # type: ignore[attr-defined]
        dump = subprocess.run(
            [str(tools / "cuobjdump"), "--dump-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    opcodes: collections.Counter = collections.Counter()
    for line in dump.splitlines():
        match = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if match:
            opcodes[match.group(1)] += 1
    return opcodes


def scheduler_cycles(per_warp: int, m: int, cfg: ternary_matmul.GemvConfig) -> int:
    """A rough issue time of the GEMV: its warps dealt over SM_COUNT SMs of 4 schedulers, each warp's
    instructions one a cycle: ceil(warps an SM / 4) x instructions a warp."""
    warps_per_sm = triton.cdiv(triton.cdiv(m, cfg.block_m) * cfg.num_warps, SM_COUNT)
    return triton.cdiv(warps_per_sm, 4) * per_warp


def sweep(m: int, k: int, num_tokens: int, pair: bool, best: int = 5) -> list[dict]:
    """Tiles (rows 2-16, chunk words 32-256, warps 1-4) of one projection, fewest cycles first."""
    rows = []
    for tile in itertools.product((2, 4, 8, 16), (32, 64, 128, 256), (1, 2, 4)):
        compiled, cfg = compile_projection(m, k, num_tokens, pair, tile)
        per_warp = sum(sass_opcodes(compiled).values())
        rows.append({"tile": tile, "per_program": per_warp, "cycles": scheduler_cycles(per_warp, m, cfg)})
    return sorted(rows, key=lambda row: row["cycles"])[:best]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="module:ATTR=literal before compiling")
    parser.add_argument("--sweep", action="store_true", help="also rank 48 tiles a projection (minutes)")
    args = parser.parse_args()
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        raise SystemExit("this Triton wheel carries no cuobjdump: install triton from PyPI")
    os.environ.pop("TRITON_INTERPRET", None)
    apply_settings(args.set)
    total_per_sm = 0.0
    for m, k, pair in PROJECTIONS:
        compiled, cfg = compile_projection(m, k, args.tokens, pair)
        ops = sass_opcodes(compiled)
        per_program = sum(ops.values())
        per_sm = per_program * triton.cdiv(m, cfg.block_m) * cfg.num_warps / SM_COUNT
        total_per_sm += per_sm
        row = {
            "matrix": f"{m}x{k}", "tokens": args.tokens, "config": cfg._asdict(), "per_program": per_program,
            "IDP": ops["IDP"], "LDG": ops["LDG"], "shared_ops": ops["LDS"] + ops["STS"] + ops["BAR"],
            "warp_instructions_per_sm": round(per_sm), "cycles": scheduler_cycles(per_program, m, cfg),
        }  # fmt: skip
        if args.sweep:
            row["best_tiles"] = sweep(m, k, args.tokens, pair)
        sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.write(json.dumps({"layer_warp_instructions_per_sm": round(total_per_sm)}) + "\n")


if __name__ == "__main__":
    main()

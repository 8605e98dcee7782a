"""The F16 LM head in numba, summing exactly as torch's single-token GEMV does, one pass over the weights
for any number of rows.

A 2B-4T decode step reads a 657 MB F16 head (tied embedding, 128256 x 2560): half its bytes. For one
token torch runs `fp16_gemv_trans` (ATen ReducedPrecisionFloatGemvFastPathKernel.cpp, fp32 arithmetic):
per row, 8 f32 accumulators of 8 lanes; each 64-element block adds x[j + 8 r + lane] * w[...] into
accumulator r with one FMA; the 8 accumulators are summed as a tree (r + 4, r + 2, r + 1), the 8 lanes as
vec_reduce_all does on AVX2 (lane i + lane i ^ 4, then i ^ 2, then i ^ 1), and the result is stored as
F16 (measured: torch's AVX-512 build runs the same 8-lane code for its F16 GEMV). This kernel does the
same operations in the same order (an @intrinsic writing the LLVM IR, as kernels/cpu/int8_tile.py does),
so its logits equal torch's bit for bit (tests/kernels/test_f16head.py): one token at 1.14-1.27x torch's
speed (AVX2, benchmarks/RESULTS.md, "Issue 10: the 2B-4T I2_S decode step vs bitnet.cpp"). Each thread
reads its rows as one sequential stream, which the hardware prefetchers follow: a software prefetch 1-8
rows ahead, as the int8 kernels have, measured no faster, so there is none.

Several rows (a speculative verify, batched decode): torch's F16 GEMM gives each row the single-token
GEMV's bits (torch 2.13, every capability) at about T passes over the head. Here each weight row is read
once and dotted with every token's activations while it sits in L1, so the rows' logits cost one pass.

Only widths that are whole 64-element blocks take it (torch has tails past them); others stay on torch.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

ACCUMULATORS = 8  # torch's kF32RegistersPerIteration: 4 register pairs
LANES = 8  # f32 lanes of each accumulator
# torch capabilities whose F16 GEMV sums this way: the AVX-512 build too runs it on 8-lane vectors (torch
# 2.13, measured: 0 of 20,000 logits differ at widths 128-2560; 16-lane sums differ in 6-26 of them)
TORCH_CAPABILITIES = ("AVX2", "AVX512")
ROWS_PER_TASK = 64  # rows per prange task

BLOCK = ACCUMULATORS * LANES  # elements per step of torch's loop

_I16, _I32 = ir.IntType(16), ir.IntType(32)
_F32 = ir.FloatType()
_V8xF32 = ir.VectorType(_F32, LANES)
_V16xF32 = ir.VectorType(_F32, 2 * LANES)
_V16xI16 = ir.VectorType(_I16, 2 * LANES)
_V16xHalf = ir.VectorType(ir.HalfType(), 2 * LANES)


def supports(width: int) -> bool:
    """Whether a head of `width` input features takes this kernel (whole blocks: no torch tail)."""
    return width > 0 and width % BLOCK == 0


def _lanes(builder: ir.IRBuilder, vector: ir.Value, first: int) -> ir.Value:
    """<8 x float> of vector's lanes first .. first + 7."""
    mask = ir.Constant(ir.VectorType(_I32, LANES), [ir.Constant(_I32, first + i) for i in range(LANES)])
    return builder.shuffle_vector(vector, vector, mask)


def _swap(builder: ir.IRBuilder, vector: ir.Value, partner: int) -> ir.Value:
    """vector + its lanes permuted (lane i takes lane i ^ partner): one step of vec_reduce_all."""
    mask = ir.Constant(ir.VectorType(_I32, LANES), [ir.Constant(_I32, i ^ partner) for i in range(LANES)])
    return builder.fadd(vector, builder.shuffle_vector(vector, vector, mask))


def _accumulate_block(
    builder: ir.IRBuilder, fma: ir.Function, w_row: ir.Value, x: ir.Value, start: ir.Value, slots: list
) -> None:
    """Elements start .. start + 63 into the accumulators: 16 F16 weights at a time, widened, the low 8
    FMA'd into accumulator 2 p and the high 8 into 2 p + 1 (torch's register pairs)."""
    for pair in range(ACCUMULATORS // 2):
        offset = builder.add(start, ir.Constant(start.type, 2 * LANES * pair))
        w_ptr = builder.bitcast(builder.gep(w_row, [offset]), _V16xI16.as_pointer())
        widened = builder.fpext(builder.bitcast(builder.load(w_ptr, align=2), _V16xHalf), _V16xF32)
        for part in range(2):
            x_ptr = builder.gep(x, [builder.add(offset, ir.Constant(start.type, LANES * part))])
            x_vec = builder.load(builder.bitcast(x_ptr, _V8xF32.as_pointer()), align=4)
            slot = slots[2 * pair + part]
            w_vec = _lanes(builder, widened, LANES * part)
            builder.store(builder.call(fma, [x_vec, w_vec, builder.load(slot)]), slot)


def _reduce(builder: ir.IRBuilder, slots: list) -> ir.Value:
    """The accumulators summed as torch does: a tree over them (x[i] += x[i + half], halving), then the
    lanes as vec_reduce_all on AVX2 (128-bit, 64-bit, 32-bit swaps) -> f32."""
    accs = [builder.load(slot) for slot in slots]
    while len(accs) > 1:
        half = len(accs) // 2
        accs = [builder.fadd(accs[i], accs[i + half]) for i in range(half)]
    total = accs[0]
    for partner in (4, 2, 1):
        total = _swap(builder, total, partner)
    return builder.extract_element(total, ir.Constant(_I32, 0))


@intrinsic
def _row_dot(typingctx: object, w: types.Type, row: types.Type, x: types.Type) -> tuple | None:
    """_row_dot(w uint16 [V, K] C order (F16 bits), row, x f32 [K] C order) -> f32: torch's sum of
    x * w[row] (see the module docstring), rounded to F16 and widened back. K a multiple of BLOCK."""
    if not (isinstance(w, types.Array) and w.dtype == types.uint16 and w.ndim == 2 and w.layout == "C"):
        return None
    if not (isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1 and x.layout == "C"):
        return None
    sig = types.float32(w, row, x)

    def codegen(context: object, builder: ir.IRBuilder, signature: object, llargs: tuple) -> ir.Value:
        w_arr = context.make_array(w)(context, builder, llargs[0])
        x_arr = context.make_array(x)(context, builder, llargs[2])
        width = builder.extract_value(w_arr.shape, 1)
        w_row = builder.gep(w_arr.data, [builder.mul(llargs[1], width)])
        fma_type = ir.FunctionType(_V8xF32, [_V8xF32] * 3)
        fma = cgutils.get_or_insert_function(builder.module, fma_type, "llvm.fma.v8f32")
        zeros = ir.Constant(_V8xF32, [ir.Constant(_F32, 0.0)] * LANES)
        slots = [cgutils.alloca_once_value(builder, zeros) for _ in range(ACCUMULATORS)]
        num_blocks = builder.udiv(width, ir.Constant(width.type, BLOCK))
        with cgutils.for_range(builder, num_blocks) as loop:
            start = builder.mul(loop.index, ir.Constant(width.type, BLOCK))
            _accumulate_block(builder, fma, w_row, x_arr.data, start, slots)
        # stored as F16 (y is Half in fp16_gemv_trans), then widened back, as `.to(torch.float32)` does
        rounded = builder.fptrunc(_reduce(builder, slots), ir.HalfType())
        return builder.fpext(rounded, _F32)

    return sig, codegen


@njit(parallel=True, nogil=True, cache=True)
def f16_head_rows(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """w uint16 [V, K] (the F16 head's bits), x f32 [T, K] (the activations, already rounded to F16) ->
    out f32 [T, V]: each logit as torch's single-token F16 linear gives it, for every row of x. Each
    weight row is read from memory once for all T rows (it stays in L1 across them): a speculative
    verify's 5 rows cost one pass over the head, where torch's F16 GEMM costs ~T passes."""
    num_rows = w.shape[0]
    for task in prange((num_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for row in range(task * ROWS_PER_TASK, min(num_rows, (task + 1) * ROWS_PER_TASK)):
            for t in range(x.shape[0]):
                out[t, row] = _row_dot(w, row, x[t])


class F16HeadGemv:
    """The cpu backend's F16 LM head (CpuBackend.half_head_gemv) over f16_head_rows."""

    def __init__(self, weight: torch.Tensor, num_threads: int | None) -> None:
        self.weight = weight  # kept alive: `bits` is a view of its memory
        self.bits = weight.view(torch.int16).numpy().view(np.uint16)  # the F16 bit patterns
        self.num_threads = num_threads

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """f32 [T, hidden] -> f32 [T, vocab] logits, each row as torch's single-token F16 linear gives it
        (and its F16 GEMM too, which on torch 2.13 equals a loop of them: tests/kernels/test_f16head.py)."""
        if self.num_threads is not None:
            numba.set_num_threads(self.num_threads)
        # the activations rounded to F16 as torch's path rounds them, then widened for the f32 FMAs
        x = hidden_states.to(torch.float16).to(torch.float32).contiguous().numpy()
        logits = torch.empty(x.shape[0], self.bits.shape[0], dtype=torch.float32)
        f16_head_rows(self.bits, x, logits.numpy())
        return logits

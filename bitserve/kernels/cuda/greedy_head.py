"""Greedy decoding's LM head from an int8 copy: the exact argmax of a float head at a fraction of its bytes.

At batch 1 the 2B-4T model's F16 head is 657 MB of the 1.18 GB a decode step reads (155 µs of a ~945 µs
step on an H200, 233 µs on an H100); the int8 copy is half of it (a quarter of an f32 head, which a small
model's F16 table is widened to). A greedy step needs only the argmax of the logits, so:

1. `_approx_kernel` streams an int8 copy of the head (one f32 scale a row: W[j] ~ s[j] * Q[j], |Q| <= 127)
   and computes approximate logits A[b, j] = s[j] * sum_c Q[j, c] * x'[b, c], x' the head's input x split
   into two int8 planes (x = s1 q1 + s2 q2 + xi, |xi| ~ |x|max / 127^2) so the sums are exact dp4a integer
   dots, and each row's error bound E[b, j] = s[j] * (e_factor |x[b]|_1 + 127 |xi[b]|_1). Every program
   keeps the max over its rows of A - E: a lower bound of the row's largest logit.
2. `_rescore_kernel` reduces those partial maxima to L[b], keeps as candidates the rows that could reach
   it (A + E >= L minus one rounding step of the output dtype), computes their logits (the float weight
   row times x, f32 sums in one fixed order, rounded to the head's dtype), and writes -inf for every
   other row. A program checks its RESCORE_ROWS rows in one vectorized pass (for each input row, one
   round trip for A, the partial maxima and the bound), compacts its candidates into a scratch list, and
   scores them RESCORE_TILE at a time (a read of the list, then the candidates' weight rows): only the
   candidates cost dependent round trips.

The argmax of that row (kernels/cuda/argmax.py) is the argmax of every row's logit as the rescoring
pass computes it: a row j outside the candidates has R[j] <= A[j] + E[j] < L <= max_k R[k] (R the f32
logit before rounding), less the rounding step, so it can neither be the maximum nor tie with it after
rounding. Ties keep torch's rule (the first index), since every tied row is a candidate. A NaN anywhere
makes rows candidates (comparisons with NaN are false), so NaN logits come out as the full head's would.
cuBLAS (the full head) sums each logit in another order than the rescoring pass, so where the two top
logits straddle a rounding boundary of the head's dtype the two can round them apart: the tolerance of
any two float paths (the CPU reference's included), not a bound violation.

The bound: |W - s Q| <= s / 2 per weight (round to nearest, s = max |W[j]| / 127), so
|sum_c (W - s Q) x| <= s / 2 * |x|_1, and |sum_c s Q xi| <= 127 s |xi|_1; the f32 sums of A and of
the exact logit each add at most gamma_H * 127 * s * |x|_1 (gamma_H = H u / (1 - H u), u = 2^-24), which
`error_factor` adds to the 1/2 with slack. Rows of the copy that are all zero cost nothing (s = 0:
A = E = 0, exact); a row holding a non-finite value, or so small that its scale would be subnormal in f32
(where s / 2 no longer bounds the rounding), gets s = inf and is always a candidate. The analysis assumes
no f32 overflow inside a sum (an overflowing logit is inf on both paths only where each sum overflows).

Only the logits' argmax is exact: every other row is -inf, so these logits are for greedy rows alone
(no sampling, no logprobs). Up to MAX_ROWS rows a launch (the decode graphs' small batches), where the
head is a bandwidth-bound GEMV; larger batches keep the F16 GEMM. Hidden sizes: multiples of 128 up to
MAX_HIDDEN (supports_hidden), where a program's row block and the input's planes fit its registers.
Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.pdl import launch_options, pdl_enter
from bitserve.kernels.cuda.ternary_matmul import dp4a

MAX_ROWS = 2  # rows (sequences) of one launch: at 4 the activation planes alone take 160 registers
# widest head input: at 5120 the approximate pass spills (sm_90 SASS); at 4096 one row takes 221 registers
# a thread, so two of APPROX_TILES' three programs an SM are resident at once (not tuned on a device)
MAX_HIDDEN = 4096
F32_TINY = torch.finfo(torch.float32).tiny  # the smallest normal f32
QUANT_CHUNK_ROWS = 8192  # head rows quantized at once at load (an f32 temporary of this many rows)
# rows of a launch -> (int8 bytes of a program's row block, programs an SM): at H 2560, (16 rows, 3) and
# (8, 3): 168 registers a thread, no spills (sm_90 SASS), so three 4-warp programs fit an SM with 120 /
# 60 KB of weights in flight. On an H200 the tile moved the pass by 1% (RESULTS.md, 2026-11-29); loading
# each next block ahead of the dot products was no faster at 1 row and 11% slower at 2.
APPROX_TILES: dict[int, tuple[int, int]] = {1: (16 * 2560, 3), 2: (8 * 2560, 3)}
# head rows a program of the rescoring pass checks at once. The pass had checked 16-row tiles one after
# another, a dependent L2 round trip and a block reduction each: ~20-30 µs of a 101-106 µs head on an
# H200. Checked at once: 80.3 µs at 512 rows, 82.1 at 1,024, 84.1 at 2,048, 88.9 at 4,096 (RESULTS.md,
# 2026-11-29)
RESCORE_ROWS = 512
RESCORE_TILE = 16  # candidate rows it scores at once
NUM_WARPS = 4
# margin below L, relative: twice what rounding to the head's dtype can merge (two values that round to
# one f16 differ by less than 2^-9 of it, one bf16 2^-6; an f32 head's logits are not rounded again: a
# margin all the same), plus OUTPUT_TINY for values near zero (past the subnormals and the products'
# underflow, H * 2^-149 at most)
OUTPUT_STEP = {torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5, torch.float32: 2.0**-20}
OUTPUT_MAX = {dtype: torch.finfo(dtype).max for dtype in OUTPUT_STEP}  # past it every value is inf
OUTPUT_TINY = {torch.float16: 2.0**-20, torch.bfloat16: 2.0**-100, torch.float32: 2.0**-100}


def error_factor(hidden: int) -> float:
    """E = s * |x|_1 * error_factor(H): 1/2 for the int8 rounding, plus the f32 summation error of the
    approximate and the exact logit (each gamma_H * 127 * s * |x|_1), with slack."""
    unit = 2.0**-24
    gamma = hidden * unit / (1 - hidden * unit)
    return 0.5 * (1 + 1e-3) + 2 * 127 * gamma * 1.01 + 1e-3


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """F16 / BF16 / F32 [V, H] -> (int8 [V, H], f32 scale [V]): Q = rne(W / s) clamped to +-127,
    s = max |W| / 127 per row; s = 0 for an all-zero row, s = inf (Q = 0) for a row holding a non-finite
    value or whose scale would be subnormal."""
    rows = weight.shape[0]
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, QUANT_CHUNK_ROWS):
        chunk = weight[start : start + QUANT_CHUNK_ROWS].to(torch.float32)
        scale = chunk.abs().amax(dim=1) / 127.0
        # a subnormal scale breaks |W - s Q| <= s / 2: such rows are scored exactly every step, as
        # non-finite ones
        finite = torch.isfinite(chunk).all(dim=1) & ((scale == 0) | (scale >= F32_TINY))
        safe = torch.where(finite & (scale > 0), scale, torch.ones_like(scale))
        values = torch.round(chunk / safe[:, None]).clamp_(-127, 127)
        values[~finite | (scale == 0)] = 0
        quantized[start : start + QUANT_CHUNK_ROWS] = values.to(torch.int8)
        scales[start : start + QUANT_CHUNK_ROWS] = torch.where(
            finite, scale, torch.full_like(scale, math.inf)
        )
    return quantized, scales


@triton.jit
def _quantize_plane(v, scale):
    """f32 values, f32 scale -> f32 integers round(v / scale) (nearest, or next to it on a rounded add)
    clamped to +-127, 0 where scale is 0."""
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.floor(v / safe + 0.5)  # nearest or next to it: the bound uses the residual as computed
    return tl.where(scale > 0, tl.minimum(tl.maximum(q, -127.0), 127.0), 0.0)


@triton.jit
def _pack_words(b0, b1, b2, b3):
    """Four int32 [N] tensors of byte values (-127..127) -> int32 [N] words, byte i at bits 8i."""
    return (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | ((b3 & 0xFF) << 24)


@triton.jit
def _activation_planes(x_ptr, HW: tl.constexpr, CW: tl.constexpr):
    """x [4 * HW] in the head's dtype as two int8 planes, x = s1 * q1 + s2 * q2 + xi: (q1 words, q2 words)
    as tuples of [CW]-word chunks (byte i of word w is column 4w + i), s1, s2, |x|_1 and |xi|_1 (f32
    scalars)."""
    words = tl.arange(0, CW)
    amax = tl.zeros([CW], tl.float32)
    for c in tl.static_range(0, HW, CW):
        for i in tl.static_range(4):
            amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + 4 * (c + words) + i).to(tl.float32)))
    s1 = tl.max(amax, axis=0) / 127.0
    rmax = tl.zeros([CW], tl.float32)
    for c in tl.static_range(0, HW, CW):
        for i in tl.static_range(4):
            x = tl.load(x_ptr + 4 * (c + words) + i).to(tl.float32)
            rmax = tl.maximum(rmax, tl.abs(x - _quantize_plane(x, s1) * s1))
    s2 = tl.max(rmax, axis=0) / 127.0
    first = ()
    second = ()
    norm = tl.zeros([CW], tl.float32)
    rest = tl.zeros([CW], tl.float32)
    for c in tl.static_range(0, HW, CW):
        q1 = ()
        q2 = ()
        for i in tl.static_range(4):
            x = tl.load(x_ptr + 4 * (c + words) + i).to(tl.float32)
            a = _quantize_plane(x, s1)
            r = x - a * s1
            b = _quantize_plane(r, s2)
            q1 = q1 + (a.to(tl.int32),)
            q2 = q2 + (b.to(tl.int32),)
            norm += tl.abs(x)
            rest += tl.abs(r - b * s2)
        first = first + (_pack_words(q1[0], q1[1], q1[2], q1[3]),)
        second = second + (_pack_words(q2[0], q2[1], q2[2], q2[3]),)
    return first, second, s1, s2, tl.sum(norm, axis=0), tl.sum(rest, axis=0)


@triton.jit
def _load_rows(q_ptr, block, V, HW: tl.constexpr, CW: tl.constexpr, BLOCK_V: tl.constexpr):
    """The int8 rows of row block `block` read as int32 words, [BLOCK_V, CW] chunks (a tuple; rows past V
    read as 0)."""
    rows = block * BLOCK_V + tl.arange(0, BLOCK_V)
    ptrs = q_ptr + rows[:, None].to(tl.int64) * HW + tl.arange(0, CW)[None, :]
    mask = (rows < V)[:, None]
    chunks = ()
    for c in tl.static_range(0, HW, CW):
        # read once per step: stream past the caches
        chunks = chunks + (tl.load(ptrs + c, mask=mask, other=0, eviction_policy="evict_first"),)
    return chunks


@triton.jit
def _approx_block(
    w, block, planes, bests, scale_ptr, approx_ptr, V, B: tl.constexpr, HW: tl.constexpr,
    CW: tl.constexpr, BLOCK_V: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """A[b, rows] of one row block from its int8 words `w`, stored; returns each b's running max of A - E.
    planes[b] = (q1 chunks, q2 chunks, s1, s2, bound): E = s * bound."""
    rows = block * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < V
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    new_bests = ()
    for b in tl.static_range(B):
        first, second, s1, s2, bound = planes[b]
        acc1 = tl.zeros([BLOCK_V, CW], tl.int32)
        acc2 = tl.zeros([BLOCK_V, CW], tl.int32)
        for i in tl.static_range(HW // CW):
            acc1 = dp4a(w[i], first[i][None, :], acc1, USE_ASM)
            acc2 = dp4a(w[i], second[i][None, :], acc2, USE_ASM)
        exact1 = tl.sum(acc1, axis=1).to(tl.float32)
        exact2 = tl.sum(acc2, axis=1).to(tl.float32)
        approx = scale * (s1 * exact1 + s2 * exact2)
        tl.store(approx_ptr + b * V + rows, approx, mask=row_ok)
        low = approx - scale * bound
        new_bests = new_bests + (tl.where(row_ok, tl.maximum(bests[b], low), bests[b]),)
    return new_bests


@triton.jit
def _approx_kernel(
    x_ptr,  # [B, H] in the head's dtype: the head's input
    q_ptr,  # int8 [V, H], read as int32 words [V, H / 4]
    scale_ptr,  # f32 [V]
    approx_ptr,  # f32 [B, V] out: A
    partial_ptr,  # f32 [B, programs] out: each program's max of A - E
    bound_ptr,  # f32 [B] out: E / s of every row
    V,
    programs,  # the grid's size
    e_factor,
    ITERATIONS: tl.constexpr,  # row blocks a program takes: cdiv(cdiv(V, BLOCK_V), programs)
    B: tl.constexpr,
    HW: tl.constexpr,  # H / 4
    CW: tl.constexpr,  # words a chunk
    BLOCK_V: tl.constexpr,
    USE_ASM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    # the first block's weights travel under the kernel before this one (the final norm)
    first_rows = _load_rows(q_ptr, pid, V, HW, CW, BLOCK_V)
    pdl_enter(USE_PDL)
    planes = ()
    bests = ()
    for b in tl.static_range(B):
        first, second, s1, s2, norm, rest = _activation_planes(x_ptr + b * 4 * HW, HW, CW)
        # |sum_c (W - s Q) x| + |sum_c s Q xi| <= s (e_factor |x|_1 + 127 |xi|_1). xi as computed is off
        # by the roundings of a * s1, x - a s1, b * s2 and r - b s2: at most 3u (|x_c| + s1) an element
        # (|a s1| <= |x_c| + s1), which the 2.4e-7 (4u) terms bound over the row
        xi_bound = rest + 2.4e-7 * (norm + 4 * HW * s1)
        bound = e_factor * norm + 127.0 * 1.01 * xi_bound
        planes = planes + ((first, second, s1, s2, bound),)
        bests = bests + (tl.full([BLOCK_V], float("-inf"), tl.float32),)
        if pid == 0:
            tl.store(bound_ptr + b, bound)
    bests = _approx_block(
        first_rows, pid, planes, bests, scale_ptr, approx_ptr, V, B, HW, CW, BLOCK_V, USE_ASM
    )
    for i in range(1, ITERATIONS):
        block = pid + i * programs  # rows past V (the last round's) read 0 and are not stored
        w = _load_rows(q_ptr, block, V, HW, CW, BLOCK_V)
        bests = _approx_block(w, block, planes, bests, scale_ptr, approx_ptr, V, B, HW, CW, BLOCK_V, USE_ASM)
    for b in tl.static_range(B):
        tl.store(partial_ptr + b * programs + pid, tl.max(bests[b], axis=0))


@triton.jit
def _rescore_kernel(
    x_ptr,  # [B, H] in the head's dtype
    w_ptr,  # [V, H]: the head (f16 / bf16 / f32)
    scale_ptr,  # f32 [V]
    approx_ptr,  # f32 [B, V]
    partial_ptr,  # f32 [B, NUM_PARTIALS]
    bound_ptr,  # f32 [B]: E / s
    list_ptr,  # int32 [B, programs * BLOCK_R]: scratch, each program's candidate rows
    out_ptr,  # [B, V] in the head's dtype, out: the candidates' logits, -inf elsewhere
    V,
    out_max,
    out_step,
    out_tiny,
    B: tl.constexpr,
    H: tl.constexpr,
    NUM_PARTIALS: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr,  # next power of two of NUM_PARTIALS
    BLOCK_R: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < V
    scales = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)  # a weight: read before the wait
    pdl_enter(USE_PDL)
    partial_offs = tl.arange(0, PARTIALS_BLOCK)
    for b in tl.static_range(B):
        # three independent loads, one round trip (per input row): every check is vectorized, and only the
        # candidates (a few hundred rows of 128,256 at the 2B shape) go through the dependent loop below
        partials = tl.load(
            partial_ptr + b * NUM_PARTIALS + partial_offs,
            mask=partial_offs < NUM_PARTIALS,
            other=float("-inf"),
        )
        approx = tl.load(approx_ptr + b * V + rows, mask=row_ok, other=0.0)
        bound = tl.load(bound_ptr + b)
        low = tl.minimum(tl.max(partials, axis=0), out_max)  # L: past the dtype's max every value is inf
        threshold = low - (tl.abs(low) * out_step + out_tiny)
        # NOTE: "not below" rather than ">=": a NaN bound makes a row a candidate
        candidate = row_ok & ~(approx + scales * bound < threshold)
        minus_inf = tl.full([BLOCK_R], float("-inf"), tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * V + rows, minus_inf, mask=row_ok & ~candidate)
        # the candidates' rows, compacted into the program's own scratch list in row order
        flags = candidate.to(tl.int32)
        count = tl.sum(flags, axis=0)
        listed = list_ptr + (b * tl.num_programs(0) + pid) * BLOCK_R
        tl.store(listed + tl.cumsum(flags, axis=0) - 1, rows, mask=candidate)
        tl.debug_barrier()  # the list's stores before any thread reads them back
        done = 0
        while done < count:
            slots = done + tl.arange(0, TILE)
            in_list = slots < count
            tile_rows = tl.load(listed + slots, mask=in_list, other=0)
            logits = _exact_logits(x_ptr + b * H, w_ptr, tile_rows, in_list, H, TILE, BLOCK_H)
            tl.store(out_ptr + b * V + tile_rows, logits.to(out_ptr.dtype.element_ty), mask=in_list)
            done += TILE


@triton.jit
def _exact_logits(x_ptr, w_ptr, rows, candidate, H: tl.constexpr, TILE: tl.constexpr, BLOCK_H: tl.constexpr):
    """f32 [TILE]: sum_c W[j, c] * x[c] of each candidate row j, widened products summed in f32 in one fixed
    order (the rounding to the head's dtype is the caller's); only the candidates' rows are read."""
    cols = tl.arange(0, BLOCK_H)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * H + cols[None, :]
    acc = tl.zeros([TILE], tl.float32)
    for c in tl.static_range(0, H, BLOCK_H):
        w = tl.load(ptrs + c, mask=candidate[:, None], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + c + cols).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    return acc


def supports_hidden(hidden: int) -> bool:
    """Whether GreedyHead takes a head of this input width: a multiple of 128 up to MAX_HIDDEN."""
    return 0 < hidden <= MAX_HIDDEN and hidden % 128 == 0


def _pow2_floor(n: int) -> int:
    """The largest power of two at most n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def _pow2_divisor(n: int, limit: int) -> int:
    """The largest power of two, at most `limit`, that divides n."""
    block = limit
    while n % block:
        block //= 2
    return block


class GreedyHead:
    """The greedy rows' head of a float matrix [V, H] (F16 / BF16 / F32) on the device (see the module
    docstring): an int8 copy of it (V * H bytes more device memory) and the two kernels' scratch buffers."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype not in OUTPUT_STEP or weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError(f"a greedy head needs a contiguous float [V, H] matrix, got {weight.dtype}")
        vocab, hidden = weight.shape
        if not supports_hidden(hidden):
            raise ValueError(f"a greedy head takes a hidden size of 128, 256, ... {MAX_HIDDEN}, got {hidden}")
        self.weight = weight
        self.quantized, self.scales = quantize_rows(weight)
        self.block_h = _pow2_divisor(hidden, 512)
        self.chunk_words = _pow2_divisor(hidden // 4, 128)
        self.e_factor = error_factor(hidden)
        device = weight.device
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
        # rows of a launch -> (head rows a program takes at once, programs)
        self.tiles = {}
        for rows, (block_bytes, per_sm) in APPROX_TILES.items():
            block = min(16, _pow2_floor(max(1, block_bytes // hidden)))
            self.tiles[rows] = (block, max(1, min(triton.cdiv(vocab, block), sms * per_sm)))
        most_programs = max(programs for _, programs in self.tiles.values())
        self._approx = torch.empty(MAX_ROWS * vocab, dtype=torch.float32, device=device)
        self._partials = torch.empty(MAX_ROWS * most_programs, dtype=torch.float32, device=device)
        self._bounds = torch.empty(MAX_ROWS, dtype=torch.float32, device=device)
        # read once: the grid, the list and the kernel's block agree even if the constant changes later
        self._rescore_rows = RESCORE_ROWS
        self._rescore_programs = triton.cdiv(vocab, self._rescore_rows)
        listed = MAX_ROWS * self._rescore_programs * self._rescore_rows
        self._candidate_rows = torch.empty(listed, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] in the head's dtype, n <= MAX_ROWS -> logits [n, V] in the head's dtype: the
        candidates' logits (f32 sums in one fixed order), every other logit -inf, so each row's argmax is
        that of every logit so computed (the module docstring). No host sync."""
        vocab, hidden = self.weight.shape
        if x.dtype != self.weight.dtype or x.dim() != 2 or x.shape[1] != hidden or not x.is_contiguous():
            raise ValueError(
                f"x must be contiguous {self.weight.dtype} [n, {hidden}], got {x.dtype} {tuple(x.shape)}"
            )
        rows = x.shape[0]
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"a greedy head launch takes 1..{MAX_ROWS} rows, got {rows}")
        out = torch.empty(rows, vocab, dtype=self.weight.dtype, device=x.device)
        block, programs = self.tiles[rows]
        approx = self._approx[: rows * vocab]
        partials = self._partials[: rows * programs]
        options = launch_options(x.device)
        _approx_kernel[(programs,)](
            x, self.quantized.view(torch.int32), self.scales, approx, partials, self._bounds, vocab, programs,
            self.e_factor, ITERATIONS=triton.cdiv(triton.cdiv(vocab, block), programs),
            B=rows, HW=hidden // 4, CW=self.chunk_words, BLOCK_V=block, USE_ASM=x.is_cuda,
            num_warps=NUM_WARPS, **options,
        )  # fmt: skip
        dtype = self.weight.dtype
        _rescore_kernel[(self._rescore_programs,)](
            x, self.weight, self.scales, approx, partials, self._bounds, self._candidate_rows, out, vocab,
            OUTPUT_MAX[dtype], OUTPUT_STEP[dtype], OUTPUT_TINY[dtype],
            B=rows, H=hidden, NUM_PARTIALS=programs, PARTIALS_BLOCK=triton.next_power_of_2(programs),
            BLOCK_R=self._rescore_rows, TILE=RESCORE_TILE, BLOCK_H=self.block_h, num_warps=NUM_WARPS,
            enable_fp_fusion=False, **options,
        )  # fmt: skip
        return out

    def candidates(self, x: torch.Tensor) -> torch.Tensor:
        """For tests and benchmarks: int64 [n] rows each launch scored exactly (its finite logits)."""
        return torch.isfinite(self(x).float()).sum(dim=1)

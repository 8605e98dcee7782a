"""kernels/cpu/blockdot.py: Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q2_0 / Q1_0 / Q2_K / Q4_K / Q5_K / Q6_K dots on
int8 activations, on every ISA variant this CPU runs.

The activation quantizer is checked against gguf-py's numpy Q8_0 quantizer (an independent implementation
of the same per-32-block scheme); the kernels against a float64 product of the dequantized weights
(gguf-py's dequantizer; for Q2_0 / Q1_0 the reference decoders, which equal llama.cpp's bit for bit:
tests/models/test_coverage_golden.py) and the dequantized int8 activations: the integer dots are exact,
so only the f32 epilogue's rounding remains (RTOL of max |y|). The weights run as 4-row interleaved records
(kernels/cpu/interleaved.py): a row's result must not depend on its slot in a record, records stack in
CpuBackend.fuse_group only when whole, and decode_rows reads them back to gguf's values.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from bitserve.kernels.cpu import blockdot, five_bit_records, interleaved, k_quant_records, low_bit_records
from bitserve.kernels.cpu.backend import CpuBackend
from bitserve.kernels.cpu.isa import Isa, supported_isas
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.dequant import dequantize
from bitserve.loader.low_bit_quantize import QUANTIZERS
from bitserve.testing.mixed_formats import random_k_quant

RTOL = 1e-5
INT8_ISAS = [isa for isa in supported_isas() if isa is not Isa.GENERIC]
GGML_TYPES = {
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
    "q5_1": gguf.GGMLQuantizationType.Q5_1,
}
LOW_BIT = ("q2_0", "q1_0")  # llama.cpp's own types: bitserve's quantizers (bytes equal to llama.cpp's)
K_QUANTS = ("q2_k", "q4_k", "q5_k", "q6_k")  # random super-blocks (gguf-py has no K-quant quantizer)
KINDS = [*GGML_TYPES, *LOW_BIT, *K_QUANTS]


def quantized(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """f32 [M, K] -> (file rows uint8 [M, row_bytes], their dequantized values f64 [M, K])."""
    num_rows, num_cols = w.shape
    if kind in LOW_BIT:
        rows = QUANTIZERS[kind.upper()](w).reshape(num_rows, -1)
        packed = PackedWeight(torch.from_numpy(rows.reshape(-1)), w.shape, Layout[kind.upper()], kind.upper())
        return rows, dequantize(packed).numpy().astype(np.float64)
    if kind in K_QUANTS:
        rows = random_k_quant(num_rows, num_cols, kind.upper(), int(np.abs(w).sum() * 1000) % 2**32)
        values = gguf.dequantize(rows, gguf.GGMLQuantizationType[kind.upper()]).reshape(num_rows, num_cols)
        return rows, values.astype(np.float64)
    raw = gguf.quantize(w, GGML_TYPES[kind])
    values = gguf.dequantize(raw, GGML_TYPES[kind]).reshape(num_rows, num_cols)
    return np.ascontiguousarray(raw.reshape(num_rows, -1).view(np.uint8)), values.astype(np.float64)


def repacked(rows: np.ndarray, kind: str) -> np.ndarray:
    if kind in LOW_BIT:
        return low_bit_records.repack_low_bit(rows, interleaved.KINDS[kind])
    if kind in ("q5_0", "q5_1"):
        return five_bit_records.repack_five_bit(rows, interleaved.KINDS[kind])
    if kind in K_QUANTS:
        if kind == "q6_k":
            return k_quant_records.repack_q6_k(rows)
        if kind == "q2_k":
            return k_quant_records.repack_q2_k(rows)
        return k_quant_records.repack_q4_k(rows, interleaved.KINDS[kind])
    return interleaved.repack(rows, interleaved.KINDS[kind])


def test_activation_codes_agree_with_gguf_q8_0() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 1536)) * rng.uniform(0.01, 30, size=(7, 1))).astype(np.float32)
    x[3, 64:96] = 0.0  # an all-zero block: codes and scale 0
    q, dx, sx = blockdot.quantize_block_q8(x, 8)
    assert q.shape == (8, 1536) and dx.shape == sx.shape == (8, 48)
    assert not q[7].any() and not dx[7].any()  # the padding row
    assert not q[3, 64:96].any() and dx[3, 2] == 0.0
    raw = gguf.quantize(x, gguf.GGMLQuantizationType.Q8_0).reshape(7, 48, 34)
    theirs = raw[:, :, 2:].copy().view(np.int8).reshape(7, 1536)
    diff = np.abs(q[:7].astype(np.int32) - theirs)
    # gguf divides by the f32 scale and rounds half away from zero; ggml's AVX2 path (and ours)
    # multiplies by 127 / amax and rounds half to even: codes may differ by one where x sits at a tie
    assert diff.max() <= 1 and (diff == 0).mean() > 0.999
    amax = np.abs(x.reshape(7, 48, 32)).max(axis=2)
    np.testing.assert_array_equal(dx[:7], amax / np.float32(127.0))
    np.testing.assert_allclose(sx[:7], dx[:7] * q[:7].reshape(7, 48, 32).sum(axis=2), rtol=1e-6)


@pytest.mark.skipif(not INT8_ISAS, reason="no avx2 / vnni on this CPU")
@pytest.mark.parametrize("isa", INT8_ISAS, ids=lambda isa: isa.value)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(70, 640), (33, 128), (16, 1536)])
def test_kernels_equal_the_exact_product_of_what_they_multiply(
    isa: Isa, kind: str, shape: tuple[int, int]
) -> None:
    rng = np.random.default_rng(shape[0] + shape[1])
    num_rows, num_cols = shape
    if kind in K_QUANTS:
        num_cols = -(-num_cols // 256) * 256  # whole super-blocks
    w = (rng.standard_normal((num_rows, num_cols)) * 0.05).astype(np.float32)
    w[5] = 0.0  # zero blocks in the weights too
    w[6, :64] *= 40.0  # Q2_0: a block whose codes reach 3 (+2 d)
    rows, w_values = quantized(w, kind)
    records = repacked(rows, kind)  # 70 and 33 rows: a padded last record
    kernels = blockdot.KERNELS[(isa, kind)]
    for num_tokens in (1, 2, 3, 5, 16):  # every tile: gemv, the 2-token GEMM with padding and without
        x = rng.standard_normal((num_tokens, num_cols)).astype(np.float32) * 3
        q, dx, sx = blockdot.quantize_block_q8(x, blockdot.padded_tokens(num_tokens))
        out = np.full((num_tokens, num_rows), np.nan, dtype=np.float32)
        kernels.for_tokens(num_tokens)(records, q, dx, sx, out)
        x_values = q[:num_tokens].reshape(num_tokens, -1, 32) * dx[:num_tokens, :, None].astype(np.float64)
        expected = x_values.reshape(num_tokens, num_cols) @ w_values.T
        err = np.abs(out - expected).max()
        assert err <= RTOL * np.abs(expected).max(), f"T={num_tokens}: {err:.3g}"
        # batch invariance: each token's row is the same whatever the batch size and tile
        for t in range(num_tokens):
            single = np.empty((1, num_rows), dtype=np.float32)
            q1, dx1, sx1 = blockdot.quantize_block_q8(x[t : t + 1], 1)
            kernels.gemv(records, q1, dx1, sx1, single)
            np.testing.assert_array_equal(single[0], out[t])


def test_q8_roundtrip_is_what_the_kernels_multiply() -> None:
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    q, dx, _ = blockdot.quantize_block_q8(x, 3)
    expected = (q.reshape(3, 2, 32).astype(np.float32) * dx[:, :, None]).reshape(3, 64)
    np.testing.assert_array_equal(blockdot.q8_roundtrip(x), expected)


@pytest.mark.skipif(not INT8_ISAS, reason="no avx2 / vnni on this CPU")
@pytest.mark.parametrize("isa", INT8_ISAS, ids=lambda isa: isa.value)
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_result_does_not_depend_on_its_slot_in_the_interleaved_record(isa: Isa, kind: str) -> None:
    """The 4-row records change where each row's lanes sit, not its arithmetic: the same rows repacked one
    slot over (row r in slot (r + 1) % 4 of another record) give bit-identical outputs, for every tile."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((21, 256)) * 0.05).astype(np.float32)
    rows, _ = quantized(w, kind)
    shifted = np.concatenate([rows[:1], rows])  # a leading row: every row moves one slot
    kernels = blockdot.KERNELS[(isa, kind)]
    for num_tokens in (1, 2, 5):
        x = rng.standard_normal((num_tokens, 256)).astype(np.float32)
        acts = blockdot.quantize_block_q8(x, blockdot.padded_tokens(num_tokens))
        out = np.empty((num_tokens, 21), dtype=np.float32)
        out_shifted = np.empty((num_tokens, 22), dtype=np.float32)
        kernels.for_tokens(num_tokens)(repacked(rows, kind), *acts, out)
        kernels.for_tokens(num_tokens)(repacked(shifted, kind), *acts, out_shifted)
        np.testing.assert_array_equal(out_shifted[:, 1:].view(np.uint32), out.view(np.uint32))


@pytest.mark.skipif(not INT8_ISAS, reason="no avx2 / vnni on this CPU")
@pytest.mark.parametrize("kind", ["q4_1", "q5_0", "q5_1", *K_QUANTS, *LOW_BIT])
@pytest.mark.parametrize("rows", [(72, 33), (70, 33)], ids=["stacked", "not-stacked"])
def test_interleaved_weights_stack_only_on_whole_records_and_decode_their_rows(
    rows: tuple[int, int], kind: str
) -> None:
    """CpuBackend.fuse_group concatenates records only when every weight but the last fills its last
    record (70 rows would leave 2 padding rows in the middle); stacked or not, each output row equals its
    weight run alone, and decode_rows (the sgemm path) reads the records back to gguf's dequantized rows."""
    rng = np.random.default_rng(3)
    backend = CpuBackend(isa=INT8_ISAS[0], block_activations="q8")
    weights, values = [], []
    for m in rows:
        w = (rng.standard_normal((m, 256)) * 0.05).astype(np.float32)
        file_rows, w_values = quantized(w, kind)
        values.append(w_values.astype(np.float32))
        data = torch.from_numpy(file_rows.reshape(-1))
        weights.append(
            backend.prepare_block(PackedWeight(data, (m, 256), Layout[kind.upper()], kind.upper()))
        )
    for weight, expected in zip(weights, values, strict=True):
        assert weight.kernel_format == kind
        decoded = np.empty((weight.out_features, 256), dtype=np.float32)
        weight.decode_rows(0, decoded)
        np.testing.assert_array_equal(decoded, expected)
    fused = backend.fuse_group(weights)
    assert (fused is not None) == (rows[0] % interleaved.GROUP_ROWS == 0)
    if fused is None:
        return
    stacked, offsets = fused
    x = torch.from_numpy(rng.standard_normal((3, 256)).astype(np.float32))
    together = stacked.run(x, stacked.quantize(x))
    for weight, start in zip(weights, offsets, strict=True):
        alone = weight.run(x, weight.quantize(x))
        assert torch.equal(together[:, start : start + weight.out_features], alone)


def test_ggml_activations_round_as_llama_cpp_does() -> None:
    """block_activations="ggml" (kernels/cpu/ggml_activations.py): Q8_0 keeps the q8 mode's codes with d
    rounded to f16 (block_q8_0.d); Q8_1 also stores s = f16(d * sum q); Q8_K is ggml's
    quantize_row_q8_K_ref per 256 values (the reference quantize_q8k), its d on each 32-value block."""
    from bitserve.kernels.cpu.ggml_activations import quantize_ggml
    from bitserve.kernels.reference.ternary import quantize_q8k

    rng = np.random.default_rng(11)
    x = (rng.standard_normal((3, 512)) * rng.uniform(0.1, 20, size=(3, 1))).astype(np.float32)
    x[1, :256] = 0.0  # an all-zero super-block: d = 0, q = 0
    q, dx, sx = blockdot.quantize_block_q8(x, 4)
    sums = q.reshape(4, 16, 32).astype(np.int32).sum(axis=2).astype(np.float32)
    q0, dx0, sx0 = quantize_ggml(x, 4, "q8_0")
    np.testing.assert_array_equal(q0, q)
    np.testing.assert_array_equal(dx0, dx.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(sx0, dx0 * sums)
    q1, dx1, sx1 = quantize_ggml(x, 4, "q8_1")
    np.testing.assert_array_equal(q1, q)
    np.testing.assert_array_equal(dx1, dx0)
    np.testing.assert_array_equal(sx1, (dx * sums).astype(np.float16).astype(np.float32))
    qk, dxk, sxk = quantize_ggml(x, 4, "q8_k")
    codes, d = quantize_q8k(torch.from_numpy(x))
    np.testing.assert_array_equal(qk[:3], codes.numpy())
    assert not qk[3].any() and not dxk[3].any()  # the padding row
    np.testing.assert_array_equal(dxk[:3], np.repeat(d.numpy(), 8, axis=1))
    assert (dxk[1, :8] == 0).all() and not qk[1, :256].any()
    ksums = qk.reshape(4, 16, 32).astype(np.int32).sum(axis=2).astype(np.float32)
    np.testing.assert_array_equal(sxk, dxk * ksums)


@pytest.mark.skipif(not INT8_ISAS, reason="no avx2 / vnni on this CPU")
@pytest.mark.parametrize("kind", ["q5_0", "q8_0", "q2_k", "q4_k", "q5_k", "q6_k"])
def test_kernels_on_ggml_activations_equal_the_exact_product(kind: str) -> None:
    """The tile multiplies whatever codes and scales it is given: on the Q8_0 and Q8_K activations (Q8_K's
    scale per 256 values, negative where the signed max is positive) the result is the exact product of
    the dequantized weights and the dequantized activations, within the f32 epilogue's rounding. (Q8_1's
    min term reads its f16 s, as ggml's does: not the exact product; its rounding is checked above.)"""
    from bitserve.kernels.cpu.ggml_activations import activation_family, quantize_ggml

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((37, 512)) * 0.05).astype(np.float32)
    rows, w_values = quantized(w, kind)
    records = repacked(rows, kind)
    family = activation_family(interleaved.KINDS[kind])
    kernels = blockdot.KERNELS[(INT8_ISAS[0], kind)]
    for num_tokens in (1, 3):
        x = rng.standard_normal((num_tokens, 512)).astype(np.float32)
        q, dx, sx = quantize_ggml(x, blockdot.padded_tokens(num_tokens), family)
        out = np.empty((num_tokens, 37), dtype=np.float32)
        kernels.for_tokens(num_tokens)(records, q, dx, sx, out)
        x_values = q[:num_tokens].reshape(num_tokens, -1, 32) * dx[:num_tokens, :, None].astype(np.float64)
        expected = x_values.reshape(num_tokens, 512) @ w_values.T
        assert np.abs(out - expected).max() <= RTOL * np.abs(expected).max()


@pytest.mark.skipif(not INT8_ISAS, reason="no avx2 / vnni on this CPU")
def test_q3_k_runs_as_q6_k_records_with_its_own_values() -> None:
    """A Q3_K weight (k_quant_records.q3_k_as_q6_k): the same values as Q6_K blocks, so it takes the Q6_K
    records and tile; its decoded rows are gguf's Q3_K values bit for bit and the kernel gives the exact
    product of those and the int8 activations."""
    rng = np.random.default_rng(9)
    rows = random_k_quant(37, 512, "Q3_K", seed=9)
    values = gguf.dequantize(rows, gguf.GGMLQuantizationType.Q3_K).reshape(37, 512)
    backend = CpuBackend(isa=INT8_ISAS[0], block_activations="q8")
    weight = backend.prepare_block(
        PackedWeight(torch.from_numpy(rows.reshape(-1)), (37, 512), Layout.Q3_K, "Q3_K")
    )
    assert weight.kernel_format == "q6_k"
    decoded = np.empty((37, 512), dtype=np.float32)
    weight.decode_rows(0, decoded)
    np.testing.assert_array_equal(decoded, values)
    for num_tokens in (1, 3):
        x = torch.from_numpy(rng.standard_normal((num_tokens, 512)).astype(np.float32))
        acts = weight.quantize(x)
        out = weight.run(x, acts).numpy()
        q, dx = acts[0][:num_tokens], acts[1][:num_tokens]
        x_values = (q.reshape(num_tokens, -1, 32) * dx[:, :, None].astype(np.float64)).reshape(
            num_tokens, 512
        )
        expected = x_values @ values.astype(np.float64).T
        assert np.abs(out - expected).max() <= RTOL * np.abs(expected).max()

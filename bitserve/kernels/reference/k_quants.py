"""Reference decoders of Q5_1 and the K-quants (Q2_K .. Q6_K), the types llama.cpp's common mixes hold
(Q3_K_M, Q4_K_M, Q5_K_M): uint8 blocks [N, type_size] -> float32 [N, values], equal bit for bit to ggml's
dequantize_row_* (ggml-quants.c) and gguf-py: each product and difference in ggml's order, in f32.

K-quant super-blocks are 256 values. Below, a value's index is written as the nested loop of ggml's
decoder that visits it, e.g. Q2_K's 128 n + 32 j + 16 h + l (half n, shift j, half-row h, lane l).
"""

from __future__ import annotations

import torch

from bitserve.kernels.reference.packed_bytes import f16_to_f32


def low_high(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 16] -> [N, 32]: value j < 16 is the low nibble of qs[j], j + 16 the high one."""
    return torch.cat((qs & 15, qs >> 4), dim=1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, B] -> [N, 8 B]: bit b of byte i at 8 i + b (a little-endian bit field)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, :, None] >> shifts) & 1).reshape(packed.shape[0], -1)


def five_bit_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's qh uint8 [N, 4] (a little-endian u32) and qs [N, 16] -> codes uint8 [N, 32] in 0..31:
    code j = nibble j | bit j of qh << 4."""
    return low_high(qs) | (_bits(qh) << 4)


def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """d f16, m f16, qh u32, qs[16]: code j = nibble j | bit j of qh << 4; value code d + m."""
    codes = five_bit_codes(blocks[:, 4:8], blocks[:, 8:])
    return codes.float().mul_(f16_to_f32(blocks[:, :2])).add_(f16_to_f32(blocks[:, 2:4]))


def scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> (scale, min) int32 [N, 8] (get_scale_min_k4)."""
    s = s.to(torch.int32)
    sc = torch.cat((s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)), dim=1)
    mn = torch.cat((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), dim=1)
    return sc, mn


def q2_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K blocks -> codes uint8 [N, 256] in 0..3 (value 128 n + 32 j + 16 h + l: (qs[32 n + 16 h + l] >>
    2 j) & 3)."""
    qs = blocks[:, 16:80].reshape(blocks.shape[0], 2, 1, 32)  # [N, n, -, 16 h + l]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    return ((qs >> shifts) & 3).reshape(blocks.shape[0], 256)


def q2_k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q2_K blocks -> (d sc, dmin m) f32 [N, 16]: each 16-value sub-block's scale and min, ggml's products."""
    scales = blocks[:, :16].to(torch.int32)
    d, dmin = f16_to_f32(blocks[:, 80:82]), f16_to_f32(blocks[:, 82:84])
    return d * (scales & 15).float(), dmin * (scales >> 4).float()


def q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """scales[16] (low nibble scale, high min), qs[64], d f16, dmin f16. Value 128 n + 32 j + 16 h + l:
    code (qs[32 n + 16 h + l] >> 2 j) & 3, sub-block 8 n + 2 j + h; value (d sc) code - dmin m."""
    dl, ml = q2_k_scales(blocks)
    codes = q2_k_codes(blocks).reshape(-1, 16, 16).float()  # [N, 8 n + 2 j + h, l]
    return codes.mul_(dl[:, :, None]).sub_(ml[:, :, None]).reshape(-1, 256)


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes -> the 16 signed 6-bit scales, int32 [N, 16] (ggml's kmask unpacking, bytewise)."""
    s = s.to(torch.int32)
    low, high = s[:, 0:8], s[:, 8:12]
    parts = (
        (low[:, 0:4] & 15) | (((high >> 0) & 3) << 4),
        (low[:, 4:8] & 15) | (((high >> 2) & 3) << 4),
        (low[:, 0:4] >> 4) | (((high >> 4) & 3) << 4),
        (low[:, 4:8] >> 4) | (((high >> 6) & 3) << 4),
    )
    return torch.cat(parts, dim=1) - 32


def q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """hmask[32], qs[64], scales[12], d f16. Value 128 n + 32 j + 16 h + l: low bits
    (qs[32 n + 16 h + l] >> 2 j) & 3, minus 4 where bit 4 n + j of hmask[16 h + l] is clear; sub-block
    8 n + 2 j + h; value (d sc) code."""
    codes, scales = q3_k_codes(blocks)
    dl = f16_to_f32(blocks[:, 108:110]) * scales.float()  # [N, 16]
    return codes.reshape(-1, 16, 16).float().mul_(dl[:, :, None]).reshape(-1, 256)


def q3_k_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K blocks -> (codes int32 [N, 256] in -4..3, the 16 sub-block scales int32 [N, 16] in -32..31)."""
    num_blocks = blocks.shape[0]
    hmask = blocks[:, :32].reshape(num_blocks, 1, 1, 32)  # [N, -, -, 16 h + l]
    qs = blocks[:, 32:96].reshape(num_blocks, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    low = ((qs >> shifts) & 3).to(torch.int32)  # [N, n, j, 32]
    halves, shifts_j = torch.arange(2, device=blocks.device), torch.arange(4, device=blocks.device)
    bit = (halves.view(1, 2, 1, 1) * 4 + shifts_j.view(1, 1, 4, 1)).to(torch.uint8)  # 4 n + j
    high_clear = ((hmask >> bit) & 1) == 0  # [N, n, j, 32]
    codes = (low - 4 * high_clear.to(torch.int32)).reshape(num_blocks, 256)
    return codes, _q3_k_scales(blocks[:, 96:108]).to(torch.int32)


def k4_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K blocks -> (d sc, dmin m) f32 [N, 8]: each 32-value sub-block's scale and min."""
    d, dmin = f16_to_f32(blocks[:, :2]), f16_to_f32(blocks[:, 2:4])
    sc, mn = scale_min_k4(blocks[:, 4:16])
    return d * sc.float(), dmin * mn.float()


def q4_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks -> codes uint8 [N, 256] in 0..15 (value 64 g + 32 h + l: nibble h of qs[32 g + l])."""
    qs = blocks[:, 16:].reshape(blocks.shape[0], 4, 1, 32)  # group g: low nibbles sub-block 2g, high 2g+1
    return torch.cat((qs & 15, qs >> 4), dim=2).reshape(blocks.shape[0], 256)


def q5_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks -> codes uint8 [N, 256] in 0..31 (value 64 g + 32 h + l: nibble h of qs[32 g + l], plus
    16 where bit 2 g + h of qh[l] is set)."""
    num_blocks = blocks.shape[0]
    qh = blocks[:, 16:48].reshape(num_blocks, 1, 32)
    qs = blocks[:, 48:].reshape(num_blocks, 4, 1, 32)
    low = torch.cat((qs & 15, qs >> 4), dim=2).reshape(num_blocks, 8, 32)  # [N, 2 g + h, l]
    bit = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    return (low | (((qh >> bit) & 1) << 4)).reshape(num_blocks, 256)


def _k4_values(codes: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K codes [N, 256] -> (d sc) code - dmin m per 32-value sub-block, f32 [N, 256]."""
    scale, minimum = k4_scales(blocks)
    q = codes.reshape(-1, 8, 32).float()
    return q.mul_(scale[:, :, None]).sub_(minimum[:, :, None]).reshape(-1, 256)


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """d f16, dmin f16, scales[12], qs[128]. Value 64 g + 32 h + l: nibble h of qs[32 g + l], sub-block
    2 g + h; value (d sc) code - dmin m."""
    return _k4_values(q4_k_codes(blocks), blocks)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """d f16, dmin f16, scales[12], qh[32], qs[128]. Value 64 g + 32 h + l: nibble h of qs[32 g + l]
    plus 16 where bit 2 g + h of qh[l] is set, sub-block 2 g + h; value (d sc) code - dmin m."""
    return _k4_values(q5_k_codes(blocks), blocks)


def q6_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks -> codes uint8 [N, 256] in 0..63 (the value is (d sc) (code - 32))."""
    num_blocks = blocks.shape[0]
    ql = blocks[:, :128].reshape(num_blocks, 2, 2, 32)  # [N, half, l+32*(s%2), 32]
    low4 = torch.cat((ql & 15, ql >> 4), dim=2)  # [N, half, s, 32]: s<2 low nibbles, s>=2 high
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    top2 = (blocks[:, 128:192].reshape(num_blocks, 2, 1, 32) >> shifts) & 3  # [N, half, s, 32]
    return (low4 | top2 << 4).reshape(num_blocks, 256)


def q6_k_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks -> d sc f32 [N, 16], each 16-value sub-block's scale."""
    return f16_to_f32(blocks[:, 208:210]) * blocks[:, 192:208].contiguous().view(torch.int8).float()


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """ql[128], qh[64], scales[16] int8, d f16; value (d sc) (code - 32)."""
    q = q6_k_codes(blocks).reshape(-1, 16, 16).float().sub_(32)
    return q.mul_(q6_k_scales(blocks)[:, :, None]).reshape(-1, 256)

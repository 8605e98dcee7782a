"""llama.cpp (ggml CPU, x86 AVX2) numerics for quantized dense matmuls, in pure torch.

ggml never multiplies a Q4_1 / Q8_0 weight by float activations: it first quantizes each activation
row to the weight type's "vec_dot type" (Q8_1 for Q4_1, Q8_0 for Q4_0 / Q5_0 / Q8_0) in blocks of 32
and then sums integer block dot products scaled by both block scales. Those activation roundings
move logits by up to ~5% (spec 6.3), enough to flip greedy near-ties; emulating them reproduces
llama.cpp's tokens. Only the float summation order differs (ggml: 8 SIMD lanes with FMA).

AVX2 quantize_row_q8_0 / q8_1 per 32-value block: amax = max|x|; d = amax / 127 (f32), stored f16;
id = 127 / amax (f32; 0 when amax is 0); q = round-half-even(x * id). Q8_1 also stores
s = f16(d * sum(q)) with the f32 d.
Dot products: Q4_1 x Q8_1 = sum_b d_w d_x sum_j code_j q_j + sum_b m_w s_x (codes 0..15);
Q4_0 x Q8_0 = sum_b d_w d_x sum_j (code_j - 8) q_j; Q8_0 x Q8_0 = sum_b d_w d_x sum_j w_j q_j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitserve.kernels.packed import Layout, PackedWeight

BLOCK = 32
# bytes per block and the offset of the quantized values inside it
_BLOCK_BYTES = {Layout.Q8_0: 34, Layout.Q4_0: 18, Layout.Q4_1: 20}
GGML_EMULATED_LAYOUTS = frozenset(_BLOCK_BYTES)


@dataclass(frozen=True, slots=True)
class GgmlBlockWeight:
    """A block-quantized weight split for batched block dot products.

    values: float32 [num_blocks, M, 32], the integer codes (exact in float32);
    scale:  float32 [M, num_blocks] (the f16 d); offset: float32 [M, num_blocks] (Q4_1's f16 m) or None.
    activation_type: "q8_1" or "q8_0", the vec_dot type ggml quantizes activations to.
    """

    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    activation_type: str


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    # blocks uint8 [M, nb, block_bytes] -> float32 [M, nb] from the little-endian f16 at `start`
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    # packed uint8 [M, nb, 16] -> codes [M, nb, 32]: low nibbles are values 0..15, high 16..31
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def split_block_weight(weight: PackedWeight) -> GgmlBlockWeight:
    """Decode a Q4_0 / Q4_1 / Q8_0 PackedWeight into codes and per-block scales."""
    num_rows, num_cols = weight.shape
    num_blocks = num_cols // BLOCK
    blocks = weight.data.reshape(num_rows, num_blocks, _BLOCK_BYTES[weight.layout])
    scale = _f16_field(blocks, 0)
    offset = None
    if weight.layout is Layout.Q8_0:
        codes = blocks[..., 2:].contiguous().view(torch.int8).to(torch.float32)
        activation_type = "q8_0"
    elif weight.layout is Layout.Q4_0:
        codes = _nibbles(blocks[..., 2:]).to(torch.float32) - 8.0
        activation_type = "q8_0"
    else:
        offset = _f16_field(blocks, 2)
        codes = _nibbles(blocks[..., 4:]).to(torch.float32)
        activation_type = "q8_1"
    values = codes.permute(1, 0, 2).contiguous()  # [num_blocks, M, 32]
    return GgmlBlockWeight(values, scale, offset, activation_type)


def quantize_activations_q8(x: torch.Tensor, with_sum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x f32 [T, K] -> q f32 [T, nb, 32] (integers), d f32 [T, nb] (f16-rounded), s f32 [T, nb] or None."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)  # [T, nb, 32]
    amax = blocks.abs().amax(dim=-1)  # [T, nb]
    d = amax / 127.0
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv.unsqueeze(-1))  # half-to-even, like _mm256_round_ps(NEAREST)
    d16 = d.to(torch.float16).to(torch.float32)
    s = (d * q.sum(dim=-1)).to(torch.float16).to(torch.float32) if with_sum else None
    return q, d16, s


def ggml_block_linear(x: torch.Tensor, weight: GgmlBlockWeight) -> torch.Tensor:
    """x f32 [T, K] -> f32 [T, M] with ggml's activation quantization and block-scaled integer sums."""
    q, dx, sx = quantize_activations_q8(x, with_sum=weight.activation_type == "q8_1")
    # integer block sums, exact in float32: [nb, M, 32] @ [nb, 32, T] -> [nb, M, T]
    sums = torch.bmm(weight.values, q.permute(1, 2, 0))
    scales = weight.scale.t().unsqueeze(-1) * dx.t().unsqueeze(1)  # [nb, M, T] = d_w * d_x
    out = (scales * sums).sum(dim=0).t()  # [T, M]
    if weight.offset is not None and sx is not None:
        out = out + sx @ weight.offset.t()  # sum_b s_x[t,b] * m_w[m,b]
    return out.contiguous()

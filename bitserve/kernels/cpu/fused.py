"""numba kernels for the small per-layer ops of a decode step: RMSNorm, RoPE and paged decode attention.

Each replaces 5-15 eager torch ops (each ~5-15 us of dispatch on this CPU, more than their arithmetic at
decode shapes) with one call. RMSNorm and RoPE do the reference's arithmetic in the reference's order
(f64 sum of squares, separate f32 roundings, no FMA contraction), so they are bit-identical to the torch
layers; decode attention sums in its own order (tolerance-level parity, like any attention kernel).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange


@numba.njit(cache=True)
def rms_norm_kernel(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """x f32 [T, N] -> out f32 [T, N] = x * (1 / sqrt(f32(mean_f64(x^2)) + eps)) * weight."""
    num_tokens, width = x.shape
    eps32 = np.float32(eps)
    for t in range(num_tokens):
        acc = 0.0  # f64, as ggml and the torch layer accumulate
        for i in range(width):
            value = np.float64(x[t, i])
            acc += value * value
        inv_rms = np.float32(1.0) / np.sqrt(np.float32(acc / width) + eps32)
        for i in range(width):
            out[t, i] = (x[t, i] * inv_rms) * weight[i]


@numba.njit(cache=True)
def _rotate_rows(
    x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_dim: int, is_neox: bool
) -> None:
    """In place: x f32 [T, heads, head_dim]; cos / sin f32 [max_positions, rope_dim / 2]."""
    half = rope_dim // 2
    for t in range(x.shape[0]):
        position = positions[t]
        for h in range(x.shape[1]):
            for i in range(half):
                c, s = cos[position, i], sin[position, i]
                a_index, b_index = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
                first, second = x[t, h, a_index], x[t, h, b_index]
                x[t, h, a_index] = first * c - second * s
                x[t, h, b_index] = first * s + second * c


@numba.njit(cache=True)
def rotary_kernel(
    q: np.ndarray,
    k: np.ndarray,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    rope_dim: int,
    is_neox: bool,
) -> None:
    """RoPE on q [T, heads, D] and k [T, kv_heads, D] in place (first rope_dim dims of each head)."""
    _rotate_rows(q, positions, cos, sin, rope_dim, is_neox)
    _rotate_rows(k, positions, cos, sin, rope_dim, is_neox)


@numba.njit(cache=True, parallel=True, fastmath=True)
def paged_decode_attention_kernel(
    q: np.ndarray,
    key_pages: np.ndarray,
    value_pages: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    window: int,
    out: np.ndarray,
) -> None:
    """One query per sequence, keys read from the pages in place (no gather copy).

    q f32 [n, heads, D]; key_pages / value_pages f32 [num_blocks, block_size, kv_heads, D];
    block_table int64 [n, max_blocks]; seq_lens int64 [n]; out f32 [n, heads, D]. window > 0 (a sliding
    layer, Gemma): a query at position p = seq_len - 1 reads only keys p - window + 1 .. p (0: all).
    One task per (sequence, kv head): the query heads of its group share each key and value row as it is
    read (GQA), and the output sums in a small local array, not in `out` (16 sequences x 70 keys, SmolLM2's
    9 / 3 heads: 0.31-0.34 ms of CPU a layer against 0.38-0.50 for a task per query head; most of what
    remains is the scalar exp of the softmax)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_pages.shape[1], key_pages.shape[2]
    group = num_heads // num_kv_heads
    for index in prange(num_seqs * num_kv_heads):
        seq, kv_head = index // num_kv_heads, index % num_kv_heads
        first = kv_head * group
        # keys start .. seq_len - 1 (scores column j is key start + j)
        start = max(0, seq_lens[seq] - window) if window > 0 else 0
        length = seq_lens[seq] - start
        queries = q[seq, first : first + group]
        scores = np.empty((group, length), dtype=np.float32)
        for j in range(length):
            key = start + j
            keys = key_pages[block_table[seq, key // block_size], key % block_size, kv_head]
            for g in range(group):
                acc = np.float32(0.0)
                for d in range(head_dim):
                    acc += queries[g, d] * keys[d]
                scores[g, j] = acc * np.float32(scale)
        totals = np.empty(group, dtype=np.float32)
        for g in range(group):
            best = -np.inf
            for j in range(length):
                best = max(best, scores[g, j])
            total = np.float32(0.0)
            for j in range(length):
                weight = np.float32(math.exp(scores[g, j] - best))
                scores[g, j] = weight
                total += weight
            totals[g] = total
        summed = np.zeros((group, head_dim), dtype=np.float32)
        for j in range(length):
            key = start + j
            values = value_pages[block_table[seq, key // block_size], key % block_size, kv_head]
            for g in range(group):
                weight = scores[g, j] / totals[g]
                for d in range(head_dim):
                    summed[g, d] += weight * values[d]
        out[seq, first : first + group] = summed

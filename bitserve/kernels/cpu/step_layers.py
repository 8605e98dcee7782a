"""One layer of the compiled cpu decode step as the step reads it, and the helpers both weight kinds'
tables share (kernels/cpu/ternary_step.py, block_step.py). Built from a `LayerPlan` (kernels/plan.py).

fast_decode.py imports this module and the two table modules; they import this one only (no circle).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bitserve.kernels.cpu.prepared import Int8BitnetLinear, Int8BlockLinear
from bitserve.kernels.plan import LayerPlan, Projection

Int8Weight = Int8BlockLinear | Int8BitnetLinear
# A projection's weights in the order of its output rows: one stacked weight, or (block weights of mixed
# formats, which do not stack: kernels/cpu/group_stacking.stackable_records) one per original weight.
Parts = tuple[Int8Weight, ...]


@dataclass(frozen=True, slots=True)
class StepLayer:
    attn_norm: np.ndarray  # f32 [hidden]
    qkv: Parts  # q, k, v rows (one stacked weight where they stack)
    qkv_bias: np.ndarray | None  # f32 [(H + 2 KVH) * D] (Qwen2), added to qkv's output
    q_norm: np.ndarray | None  # f32 [head_dim] (Qwen3): RMSNorm of each head of q, before RoPE
    k_norm: np.ndarray | None  # f32 [head_dim]: of each head of k
    attn_sub_norm: np.ndarray | None  # f32 [heads * head_dim] (BitNet), before o_proj
    o_proj: Parts
    ffn_norm: np.ndarray  # f32 [hidden]
    gate_up: Parts  # gate, up rows
    ffn_sub_norm: np.ndarray | None  # f32 [intermediate] (BitNet), before down
    down: Parts
    # the `bitnet` arch's `.scale` multipliers as f32 [M] per output row of qkv, o_proj, gate_up, down
    # (1.0 for a weight without one, a product that changes nothing)
    output_scales: tuple[np.ndarray, ...]
    attn_post_norm: np.ndarray | None = None  # f32 [hidden] (Gemma): RMSNorm of o_proj's output
    ffn_post_norm: np.ndarray | None = None  # f32 [hidden] (Gemma): RMSNorm of down's output
    sliding_window: int = 0  # > 0: attends to the last that many positions only


def _int8_parts(projection: Projection) -> Parts | None:
    """The projection's weights when every one is an int8 weight of one kind (block or ternary), else None."""
    weights = tuple(projection.weights)
    kinds = {type(weight) for weight in weights}
    return weights if len(kinds) == 1 and kinds <= {Int8BlockLinear, Int8BitnetLinear} else None  # type: ignore[return-value]


def _norm_weight(norm: torch.Tensor | None) -> np.ndarray | None:
    return None if norm is None else norm.detach().numpy()


def step_layer(layer: LayerPlan) -> StepLayer | None:
    """One layer's weights, or None where it does not qualify: int8 weights of one kind (ternary ones
    stacked into one weight a projection), output scales only on ternary weights, gate/up two equal halves."""
    plans = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    parts = [_int8_parts(plan) for plan in plans]
    if None in parts or len({type(weight) for weights in parts for weight in weights}) != 1:  # type: ignore[union-attr]
        return None
    qkv, o_proj, gate_up, down = parts
    output_scales = tuple(plan.row_output_scales().numpy() for plan in plans)
    if type(qkv[0]) is Int8BitnetLinear and any(len(weights) != 1 for weights in parts):  # type: ignore[index, arg-type]
        return None  # the ternary step (kernels/cpu/ternary_step.py) reads one stacked weight a projection
    if type(qkv[0]) is Int8BlockLinear and any((s != 1.0).any() for s in output_scales):  # type: ignore[index]
        return None  # only the ternary step (kernels/cpu/decode_step.py) applies output scales
    halves = layer.gate_up.out_features
    if len(halves) != 2 or halves[0] != halves[1]:  # the glue splits gate|up's output in two equal halves
        return None
    return StepLayer(
        _norm_weight(layer.attn_norm),  # type: ignore[arg-type]
        qkv,  # type: ignore[arg-type]
        _norm_weight(layer.qkv_bias),
        _norm_weight(layer.q_norm),
        _norm_weight(layer.k_norm),
        _norm_weight(layer.attn_sub_norm),
        o_proj,  # type: ignore[arg-type]
        _norm_weight(layer.ffn_norm),  # type: ignore[arg-type]
        gate_up,  # type: ignore[arg-type]
        _norm_weight(layer.ffn_sub_norm),
        down,  # type: ignore[arg-type]
        output_scales,
        _norm_weight(layer.attn_post_norm),
        _norm_weight(layer.ffn_post_norm),
        layer.sliding_window,
    )


def projection_columns(layers: list[StepLayer]) -> list[list[Parts]]:
    """The layers' weights, one list [L] per projection, in the step's order: qkv, o, gate/up, down."""
    return [
        [layer.qkv for layer in layers],
        [layer.o_proj for layer in layers],
        [layer.gate_up for layer in layers],
        [layer.down for layer in layers],
    ]


def stack(vectors: list[np.ndarray], dtype: type = np.float32) -> np.ndarray:
    """Per-layer vectors of one length -> C-contiguous [L, n] of `dtype`."""
    return np.ascontiguousarray(np.stack(vectors), dtype=dtype)


def stacked_norms(layers: list[StepLayer]) -> tuple[tuple, tuple | None]:
    """The layers' norm weights as the step reads them: (attn, ffn) f32 [L, hidden], and the sub-norms
    (attn f32 [L, H D], ffn f32 [L, I]) or None for a model without them."""
    norms = (stack([lay.attn_norm for lay in layers]), stack([lay.ffn_norm for lay in layers]))
    if layers[0].attn_sub_norm is None:
        return norms, None
    return norms, (
        stack([lay.attn_sub_norm for lay in layers]),  # type: ignore[misc]
        stack([lay.ffn_sub_norm for lay in layers]),  # type: ignore[misc]
    )


def stacked_qkv_extras(layers: list[StepLayer]) -> tuple:
    """(qkv biases f32 [L, (H + 2 KVH) * D] or None, (q norms, k norms) f32 [L, head_dim] each or None):
    what the step adds to q|k|v's output before RoPE, for a model that has it."""
    first = layers[0]
    biases = None if first.qkv_bias is None else stack([lay.qkv_bias for lay in layers])  # type: ignore[misc]
    if first.q_norm is None:
        return biases, None
    q_norms = stack([lay.q_norm for lay in layers])  # type: ignore[misc]
    return biases, (q_norms, stack([lay.k_norm for lay in layers]))  # type: ignore[misc]


def stacked_post_norms(layers: list[StepLayer]) -> tuple | None:
    """(attn, ffn) post-norm weights f32 [L, hidden] each (Gemma: RMSNorm of o_proj's and down's
    outputs before the residual adds), or None for a model without them."""
    if layers[0].attn_post_norm is None:
        return None
    attn = stack([lay.attn_post_norm for lay in layers])  # type: ignore[misc]
    return attn, stack([lay.ffn_post_norm for lay in layers])  # type: ignore[misc]


def shared_tables(layers: list[StepLayer]) -> tuple:
    """What both weight kinds' step tables hold after their weights (decode_step._decode_layers'
    model[4:]): norms, sub-norms, q|k|v extras (stacked_norms, stacked_qkv_extras), post-norms
    (stacked_post_norms) and each layer's sliding window int64 [L] (0: none)."""
    norms, sub_norms = stacked_norms(layers)
    windows = np.array([lay.sliding_window for lay in layers], dtype=np.int64)
    return norms, sub_norms, stacked_qkv_extras(layers), stacked_post_norms(layers), windows


def pooled_layers(kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The per-layer caches as one [L, ...] tensor when they are consecutive views of one storage (as
    runner/kv_cache.allocate_kv_caches makes them), without a copy; None otherwise."""
    first = kv_caches[0]
    layer_elements = first.numel()
    storage = first.untyped_storage().data_ptr()
    for index, cache in enumerate(kv_caches):
        same_storage = cache.untyped_storage().data_ptr() == storage and cache.is_contiguous()
        if not same_storage or cache.storage_offset() != first.storage_offset() + index * layer_elements:
            return None
    shape = (len(kv_caches), *first.shape)
    return torch.as_strided(first, shape, (layer_elements, *first.stride()), first.storage_offset())

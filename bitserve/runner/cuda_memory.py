"""The default KV cache of a CUDA replica, sized from the device's memory (vLLM's gpu_memory_utilization
rule, adapted to a server that holds two versions of a model during a swap).

At load, after the weights are on the device and before the KV pages exist:
1. a profile step measures the activations' peak: one prefill chunk of max_num_batched_tokens tokens
   (the largest step the scheduler builds) with the logits of max_num_seqs rows, plus the same for a
   max_num_seqs-row step, which the decode CUDA graphs' private pool holds on top (the two pools do
   not share memory), the graphs' outputs that stay live in that pool, and the device sampler's work on
   max_num_seqs rows of logits;
2. the device's free memory is read (every process's use counts, the weights just loaded included);
3. the KV cache gets the smallest of: what is left of `gpu_memory_utilization x total` after what is in
   use and the reserve; CUDA_KV_REPLICA_SHARE of that share after this replica's own weights and reserve
   (a swap loads the next version beside the serving one, so one replica leaves it room); and the bytes
   of max_num_seqs sequences at max_model_len (every admitted sequence at its full context: more would
   only ever hold prefix cache, and memory a replica cannot use is better left to the device's co-tenants).
Torch only at import (the decoder's Triton kernels are the caller's): the CPU path imports it cheaply.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bitserve.config import CUDA_KV_REPLICA_SHARE
from bitserve.errors import ModelLoadError
from bitserve.kernels.attention_metadata import AttentionMetadata

if TYPE_CHECKING:  # NOTE: Triton, CUDA only: the CPU path imports this module without it
    from bitserve.kernels.cuda.decoder import CudaDecoder

logger = logging.getLogger(__name__)

# The device sampler's temporaries per logits element (f32 logits, softmax probabilities, the sorted
# copy and its indices of top-k / top-p): counted on top of the profiled step, which stops at the logits.
SAMPLER_BYTES_PER_LOGIT = 16


@dataclass(frozen=True, slots=True)
class DeviceMemoryPlan:
    """How the default KV cache of a CUDA replica was sized (logged at load; the KV pool itself is what
    /health and /v1/models show)."""

    baseline: DeviceBaseline  # this process's allocator counters before the replica loaded
    total_bytes: int  # the device's memory
    in_use_bytes: int  # by every process, after this replica's weights and the profile step
    weight_bytes: int  # this replica's weights and tables on the device
    reserve_bytes: int  # activations, CUDA-graph pool and sampler work still to come
    utilization: float  # gpu_memory_utilization
    kv_bytes: int  # what the KV cache gets

    def describe(self) -> str:
        gib = 2**30
        return (
            f"{self.kv_bytes / gib:.2f} GiB of KV cache: {self.utilization:.0%} of the device's "
            f"{self.total_bytes / gib:.1f} GiB is usable, {self.in_use_bytes / gib:.2f} GiB is in use "
            f"(this replica's weights {self.weight_bytes / gib:.2f} GiB), {self.reserve_bytes / gib:.2f} GiB "
            f"is kept for activations and CUDA graphs, and one replica takes at most "
            f"{CUDA_KV_REPLICA_SHARE:.0%} of the usable share (a swap loads the next version beside it) "
            "and no more than its max_num_seqs sequences at full context"
        )


def kv_bytes_from_memory(
    *, total: int, free: int, weight_bytes: int, reserve: int, utilization: float, most_useful: int
) -> int:
    """The KV bytes of the rule in the module docstring (`most_useful`: max_num_seqs full-context
    sequences' KV); ModelLoadError when nothing is left."""
    usable = int(utilization * total)
    left_now = usable - (total - free) - reserve
    own_share = int(CUDA_KV_REPLICA_SHARE * (usable - weight_bytes - reserve))
    kv_bytes = min(left_now, own_share, most_useful)
    if kv_bytes <= 0:
        gib = 2**30
        raise ModelLoadError(
            f"no device memory left for a KV cache: {(total - free) / gib:.2f} of {total / gib:.1f} GiB is "
            f"in use, {reserve / gib:.2f} GiB is needed for activations, and gpu_memory_utilization "
            f"{utilization} allows {usable / gib:.2f} GiB",
            hint="raise --gpu-memory-utilization, free the device, or set --kv-cache-memory-bytes",
        )
    return kv_bytes


@torch.inference_mode()
def profile_step_peak(
    decoder: CudaDecoder,
    *,
    num_tokens: int,
    num_sampled: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Peak bytes one step of `num_tokens` prefill tokens allocates beyond what is held before it, its
    logits of `num_sampled` rows included. The step writes no KV (negative slots) and reads one
    scratch page per layer, as the runner's warm-up does: the activations' shapes are a real step's."""
    shape = (2, 1, block_size, decoder.num_kv_heads, decoder.head_dim)
    caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in decoder.layers]
    pages = -(-num_tokens // block_size)
    metadata = AttentionMetadata.one_sequence(
        torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        torch.zeros((1, pages), dtype=torch.int32, device=device),
        num_tokens,
        block_size,
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = decoder(ids, positions, caches, metadata)
    decoder.compute_logits(hidden[-num_sampled:])
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def plan_device_kv(
    decoder: CudaDecoder,
    *,
    baseline: DeviceBaseline,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    kv_dtype: torch.dtype,
    kv_bytes_per_token: int,
    vocab_size: int,
    graph_output_bytes: int,
    utilization: float,
    device: torch.device,
) -> DeviceMemoryPlan:
    """Profile, read the device's memory, and size the KV cache (the module docstring's steps).
    `baseline`: the allocator counters before this replica's weights loaded (what it allocated since is
    its weights);
    `graph_output_bytes`: what the decode graphs' outputs will hold (cuda_graphs.held_output_bytes)."""
    weight_bytes = baseline.allocated_since()  # before the profile allocates anything
    longest = min(max_num_batched_tokens, max_model_len, decoder.cos.shape[0])
    rows = min(max_num_seqs, longest)
    profile = dict(block_size=block_size, kv_dtype=kv_dtype, device=device)
    prefill_peak = profile_step_peak(decoder, num_tokens=longest, num_sampled=rows, **profile)
    graph_peak = profile_step_peak(decoder, num_tokens=rows, num_sampled=rows, **profile)
    sampler = SAMPLER_BYTES_PER_LOGIT * max_num_seqs * vocab_size
    reserve = prefill_peak + graph_peak + graph_output_bytes + sampler
    torch.cuda.empty_cache()  # the profile's blocks back to the device, so free memory reads true
    free, total = torch.cuda.mem_get_info(device)
    kv_bytes = kv_bytes_from_memory(
        total=total,
        free=free,
        weight_bytes=weight_bytes,
        reserve=reserve,
        utilization=utilization,
        most_useful=max_num_seqs * max_model_len * kv_bytes_per_token,
    )
    return DeviceMemoryPlan(baseline, total, total - free, weight_bytes, reserve, utilization, kv_bytes)


@dataclass(frozen=True, slots=True)
class DeviceBaseline:
    """This process's allocator counters on a device before a replica loads: other replicas and versions
    served by the same process stay out of the new one's numbers."""

    device: torch.device
    allocated: int
    reserved: int

    @classmethod
    def now(cls, device: torch.device) -> DeviceBaseline:
        torch.cuda.synchronize(device)
        return cls(device, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))

    def allocated_since(self) -> int:
        return torch.cuda.memory_allocated(self.device) - self.allocated


def log_memory_after_load(plan: DeviceMemoryPlan, kv_bytes: int) -> None:
    """Compare what the replica holds once its graphs are captured with the plan's reserve: a reserve
    too small is a warning (the next step's activations might not fit), never silent."""
    device = plan.baseline.device
    held = torch.cuda.memory_reserved(device) - plan.baseline.reserved - plan.weight_bytes - kv_bytes
    free, total = torch.cuda.mem_get_info(device)
    level = logging.WARNING if held > plan.reserve_bytes else logging.INFO
    logger.log(
        level,
        "%s: after the warm-up and graph capture it holds %.2f GiB besides weights and KV "
        "(reserve %.2f GiB); %.2f of %.1f GiB of the device is free",
        device,
        held / 2**30,
        plan.reserve_bytes / 2**30,
        free / 2**30,
        total / 2**30,
    )

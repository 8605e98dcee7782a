"""Decode-step CUDA graphs, one per batch-size bucket (1, 2, 4, ..., 256, capped by max_num_seqs).

At batch 1 a 2B ternary decode step is ~300 short kernels; launched from Python they cost more than
the whole memory traffic of the step. A graph replays them with one launch. Each bucket's graph reads
static input buffers (token ids, positions, slots, block tables, sequence lengths) and writes static
logits; a step of n sequences copies its inputs into the first n rows of the smallest bucket >= n, pads
the rest with a harmless row (token 0 at position 0, one key, writing to the scratch KV slot), replays,
and reads the first n rows of the logits. All buckets share one memory pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from bitserve.core.scheduler_output import ScheduledRequest
from bitserve.models.cuda_decoder import CudaDecoder, DeviceAttentionMetadata

logger = logging.getLogger(__name__)

MAX_BUCKET = 256


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two from 1 up to the first one >= min(max_batch, MAX_BUCKET)."""
    limit = min(max(max_batch, 1), MAX_BUCKET)
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        decoder: CudaDecoder,
        kv_caches: list[torch.Tensor],
        *,
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_slot: int,
        device: torch.device,
    ) -> None:
        self.decoder = decoder
        self.kv_caches = kv_caches
        self.sizes = bucket_sizes(max_batch)
        self.scratch_slot = scratch_slot
        self.device = device
        size = self.sizes[-1]
        scratch_block = scratch_slot // kv_caches[0].shape[2]  # shape[2]: block_size
        # static inputs, on the device; padded rows stay as written here
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), scratch_slot, dtype=torch.int64, device=device)
        self.block_table = torch.full(
            (size, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device
        )
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        # host staging (pinned): one copy per buffer per step
        self._host = {
            name: torch.empty_like(getattr(self, name), device="cpu").pin_memory()
            for name in ("input_ids", "positions", "slot_mapping", "block_table", "seq_lens")
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def _metadata(self, size: int) -> DeviceAttentionMetadata:
        return DeviceAttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_table=self.block_table[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            decode_only=True,
        )

    def _step(self, size: int) -> torch.Tensor:
        hidden = self.decoder(
            self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size)
        )
        return self.decoder.compute_logits(hidden)  # [size, vocab]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up (Triton compiles each kernel specialization on first use) and capture every bucket,
        largest first so the smaller graphs reuse its pool."""
        started = time.perf_counter()
        for size in reversed(self.sizes):
            self._step(size)  # eager warm-up: compilation and autotuning happen outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = self._step(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s",
            self.sizes,
            time.perf_counter() - started,
        )

    def run(self, requests: Sequence[ScheduledRequest], block_size: int) -> torch.Tensor:
        """A decode-only step of len(requests) sequences -> logits f32 [len(requests), vocab] (a view of
        the bucket's static output: read it before the next step)."""
        num = len(requests)
        size = next(s for s in self.sizes if s >= num)
        width = self.block_table.shape[1]
        scratch_block = self._scratch_block()
        ids, positions, slots, lens, tables = [], [], [], [], []
        for request in requests:
            position = request.start_position
            ids.append(request.token_ids[0])
            positions.append(position)
            slots.append(request.block_ids[position // block_size] * block_size + position % block_size)
            lens.append(position + 1)
            tables.append(request.block_ids + [scratch_block] * (width - len(request.block_ids)))
        padding = size - num  # harmless rows: token 0 at position 0, one key, in the scratch block
        host = self._host
        host["input_ids"][:size] = torch.tensor(ids + [0] * padding, dtype=torch.int64)
        host["positions"][:size] = torch.tensor(positions + [0] * padding, dtype=torch.int64)
        host["slot_mapping"][:size] = torch.tensor(slots + [self.scratch_slot] * padding, dtype=torch.int64)
        host["seq_lens"][:size] = torch.tensor(lens + [1] * padding, dtype=torch.int32)
        host["block_table"][:size] = torch.tensor(
            tables + [[scratch_block] * width] * padding, dtype=torch.int32
        )
        for name, staged in host.items():
            getattr(self, name)[:size].copy_(staged[:size], non_blocking=True)
        self.graphs[size].replay()
        return self.logits[size][:num]

    def _scratch_block(self) -> int:
        return self.scratch_slot // self.kv_caches[0].shape[2]

"""CudaModelRunner: the ModelRunner of a model on a CUDA device.

Differences from the CPU runner: the KV pages live on the device (one extra scratch block that the
padded rows of a CUDA-graph bucket write to), the batch's small tensors are built on the host and sent
in one pinned, non-blocking copy, the forward is the CUDA backend's compiled one (`CudaDecoder`,
built at load: `model.compiled`), embeddings included, and decode-only steps replay a CUDA
graph captured per batch-size bucket (runner/cuda_graphs.py). Sampling runs on the device on the logits
the step produced; the sampled ids are the step's one host sync. Plain greedy decode steps launch the
step after them before that sync (runner/cuda_lookahead.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from bitserve.core.scheduler_output import RunnerOutput, ScheduledRequest, SchedulerOutput
from bitserve.errors import UnsupportedModel
from bitserve.kernels.attention_metadata import AttentionMetadata
from bitserve.kernels.cuda.decoder import CudaDecoder
from bitserve.kernels.cuda.ternary_matmul import GEMV_MAX_T
from bitserve.kernels.tuning import DEFAULT_TUNING, KernelTuning
from bitserve.models.decoder import DecoderModel
from bitserve.runner import embeddings
from bitserve.runner.cuda_graphs import DecodeGraphs
from bitserve.runner.cuda_lookahead import (
    Lookahead,
    LookaheadStats,
    ends_with_this_step,
    is_plain_greedy,
    next_positions,
)
from bitserve.runner.input_batch import build_batch_inputs
from bitserve.runner.kv_cache import CacheLayout
from bitserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class CudaModelRunner(ModelRunner):
    def __init__(
        self,
        model: DecoderModel,
        layout: CacheLayout,
        device: torch.device,
        *,
        max_num_seqs: int,
        max_model_len: int,
        use_cuda_graphs: bool = True,
        tuning: KernelTuning = DEFAULT_TUNING,
    ) -> None:
        self.device = device
        super().__init__(model, layout)
        self.decoder = prepared_decoder(model, use_cuda_graphs=use_cuda_graphs, tuning=tuning)
        self.lookahead = use_cuda_graphs and tuning.cuda_lookahead
        self.scratch_block = layout.num_blocks  # the extra page allocate_kv_caches adds
        self.max_blocks_per_seq = -(-max_model_len // layout.block_size)
        self.max_model_len = max_model_len
        self._warm_up_prefill(max_model_len)
        self.graphs: DecodeGraphs | None = None
        if use_cuda_graphs:
            self.graphs = DecodeGraphs(
                self.decoder,
                self.kv_caches,
                max_batch=max_num_seqs,
                max_blocks_per_seq=self.max_blocks_per_seq,
                scratch_block=self.scratch_block,
                device=device,
            )
            self.graphs.capture_all()
        # the guessed step's KV slot, reserved by the scheduler (see cuda_lookahead.py)
        self.num_lookahead_tokens = 1 if self.lookahead and tuning.cuda_lookahead_slot else 0
        self.lookahead_stats = LookaheadStats()
        self._pending: Lookahead | None = None  # the step launched ahead, if any

    @torch.inference_mode()
    def _warm_up_prefill(self, max_model_len: int) -> None:
        """Compile, at load, the kernel variants a prefill step can need, so that none compiles in the
        serving path (a Triton compile takes 1-2 s: a stall of every running stream). The GEMV has one
        variant per token count up to GEMV_MAX_T; the GEMM's token count and split are run-time values,
        so one step in each of its tile buckets covers every length. Decode steps are warmed by the
        graph capture. The warm-up sequence writes no KV (negative slots) and reads the scratch page."""
        block_size = self.layout.block_size
        longest = min(max_model_len, self.decoder.cos.shape[0])  # positions the RoPE tables hold
        for num_tokens in (*range(1, GEMV_MAX_T + 1), 12, 100, 200):
            if num_tokens > longest:
                break
            pages = -(-num_tokens // block_size)
            metadata = AttentionMetadata.one_sequence(
                torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
                torch.full((1, pages), self.scratch_block, dtype=torch.int32, device=self.device),
                num_tokens,
                block_size,
            )
            ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            positions = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
            hidden = self.decoder(ids, positions, self.kv_caches, metadata)
            self.decoder.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)

    def embed(
        self, inputs: Sequence[Sequence[int]], pooling: str, dimensions: int | None
    ) -> list[list[float]]:
        """As ModelRunner.embed, on the compiled forward (CudaDecoder.forward_sequence: a temporary cache,
        so the served KV cache is not touched)."""
        layout, device = self.layout, self.device

        def forward(input_ids: torch.Tensor) -> torch.Tensor:
            return self.decoder.forward_sequence(input_ids.to(device), layout.dtype, layout.block_size)

        return embeddings.embed(forward, inputs, pooling, dimensions)

    def allocate_kv_caches(self, layout: CacheLayout) -> list[torch.Tensor]:
        """[2, num_blocks + 1, block_size, kv_heads, head_dim] per layer, zeroed (padded key slots are
        masked, but NaN * 0 would still poison the output), on the device."""
        shape = (2, layout.num_blocks + 1, layout.block_size, layout.num_kv_heads, layout.head_dim)
        return [torch.zeros(shape, dtype=layout.dtype, device=self.device) for _ in range(layout.num_layers)]

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """As ModelRunner.execute; a plain greedy decode step in a CUDA graph also launches the step after
        it before its own tokens reach the host, and uses that step's tokens if it is the one asked next."""
        requests = scheduler_output.requests
        pending, self._pending = self._pending, None  # a guess not used now is dropped
        if not self.lookahead:
            return super().execute(scheduler_output)
        if pending is not None and pending.matches(requests):
            self.lookahead_stats.hits += 1
            readback = pending.readback
        elif self._can_look_ahead(requests):
            self.graphs.run(requests, greedy=True)  # type: ignore[union-attr]  (plain greedy rows only)
            readback = self.graphs.readback()  # type: ignore[union-attr]
        else:
            return super().execute(scheduler_output)
        self.free_request_state(scheduler_output.finished_request_ids)
        self._pending = self._launch_next(requests)
        host_ids = readback.read()  # the one host sync; the step launched ahead runs on
        if self._pending is not None:
            self._pending.fed_token_ids = host_ids
        sampled = {request.request_id: [token] for request, token in zip(requests, host_ids, strict=True)}
        return RunnerOutput(sampled_token_ids=sampled, logprobs=None)

    def _can_look_ahead(self, requests: Sequence[ScheduledRequest]) -> bool:
        return (
            self.lookahead
            and self.graphs is not None
            and bool(requests)
            and self.graphs.fits(len(requests))
            and all(is_plain_greedy(request) for request in requests)
        )

    def _launch_next(self, requests: Sequence[ScheduledRequest]) -> Lookahead | None:
        """Launch the step after `requests` (each fed the token the last launch computed, on the device),
        or None where a sequence ends with this step or its next position has no block yet."""
        if any(ends_with_this_step(request) for request in requests):
            return None
        positions = next_positions(requests, self.max_model_len, self.layout.block_size)
        if positions is None:
            return None
        logits = self.graphs.replay_next(requests, positions)  # type: ignore[union-attr]
        if logits is None:  # a table outgrew the last launch's context bucket
            return None
        self.lookahead_stats.launched += 1
        return Lookahead(
            request_ids=tuple(request.request_id for request in requests),
            positions=tuple(positions),
            num_blocks=tuple(len(request.block_ids) for request in requests),
            readback=self.graphs.readback(),  # type: ignore[union-attr]
        )

    @torch.inference_mode()
    def forward_logits(self, requests: Sequence[ScheduledRequest]) -> torch.Tensor | None:
        sample_rows = [row for row, request in enumerate(requests) if request.sample]
        decode_only = all(len(request.token_ids) == 1 for request in requests)
        if decode_only and self.graphs is not None and self.graphs.fits(len(requests)):
            logits = self.graphs.run(requests)  # [num_requests, vocab]
            if len(sample_rows) == len(requests):
                return logits
            return logits[sample_rows] if sample_rows else None
        # the CPU runner's host-side batch layout, sent to the device in pinned, non-blocking copies
        batch = build_batch_inputs(requests, self.layout.block_size)
        metadata = batch.attn.to_device(self._send)
        input_ids, positions = self._send(batch.input_ids), self._send(batch.positions)
        hidden = self.decoder(input_ids, positions, self.kv_caches, metadata)
        if not batch.sampled_request_ids:
            return None
        return self.decoder.compute_logits(hidden[self._send(batch.sample_indices)])

    def _send(self, cpu: torch.Tensor) -> torch.Tensor:
        return cpu.pin_memory().to(self.device, non_blocking=True)


def prepared_decoder(model: DecoderModel, *, use_cuda_graphs: bool, tuning: KernelTuning) -> CudaDecoder:
    """The CUDA backend's compiled forward of `model` (built at load, DecoderModel.compiled), with what the
    runner will add to it on the device already there (the KV sizing profiles it before the runner exists):
    the greedy head, which serves only the launch ahead's graphs, so no int8 copy of the head without them."""
    if not isinstance(model.compiled, CudaDecoder):
        raise UnsupportedModel(
            "a CUDA replica needs a model loaded on the cuda backend",
            hint="load it with --device cuda:N (the backend follows the device)",
        )
    if use_cuda_graphs and tuning.cuda_lookahead and tuning.cuda_greedy_head:
        model.compiled.enable_greedy_head()
    return model.compiled

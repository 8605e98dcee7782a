"""ModelRunner: SchedulerOutput -> one forward pass over the paged KV cache -> sampled token ids.

Owns the model, the per-layer KV tensors, the sampler and each request's seeded generator. Called
from the engine thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from bitserve.core.scheduler_output import RunnerOutput, ScheduledRequest, SchedulerOutput
from bitserve.layers.sampler import Sampler, SamplingRequestState, make_generator
from bitserve.models.decoder import DecoderModel
from bitserve.runner import embeddings, speculative
from bitserve.runner.input_batch import build_batch_inputs
from bitserve.runner.kv_cache import CacheLayout, allocate_kv_caches
from bitserve.structured.masks import GuidedRows

logger = logging.getLogger(__name__)

DEVICE_MEMORY_REFRESH_S = 0.5  # how stale bitserve_device_memory_bytes may be (scrapes come every ~15 s)


class ModelRunner:
    """The CPU runner (and the base of runner/cuda_runner.py, which overrides `forward_logits`)."""

    device = torch.device("cpu")
    num_lookahead_tokens = 0  # KV slots the scheduler reserves past each decode token (cuda_runner.py: 1)

    def __init__(self, model: DecoderModel, layout: CacheLayout) -> None:
        self.model = model
        self.layout = layout
        self.kv_caches = self.allocate_kv_caches(layout)
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator | None] = {}
        # Grammar matchers of guided requests; set by ModelInstance, which owns the tokenizer.
        self.guided: GuidedRows | None = None
        self._device_memory: int | None = None
        self._device_memory_read_at = float("-inf")

    def allocate_kv_caches(self, layout: CacheLayout) -> list[torch.Tensor]:
        return allocate_kv_caches(layout)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run the scheduled tokens; return one sampled token per request whose `sample` is set, or for
        a speculative decode its accepted drafts and one token more (runner/speculative.py).

        Preconditions (kept by the scheduler): every position written has a slot in the request's
        block table, and cached positions below start_position already hold this request's KV.
        """
        # preempted requests keep their generator: a resumed seeded request continues its stream
        self.free_request_state(scheduler_output.finished_request_ids)
        requests = scheduler_output.requests
        if not requests:
            return RunnerOutput(sampled_token_ids={}, logprobs=None)
        logits = self.forward_logits(requests)  # [num_rows, vocab] (1 + k rows a verify), or None
        if logits is None:
            return RunnerOutput(sampled_token_ids={}, logprobs=None)
        sampled_requests = [r for r in requests if r.sample]
        rows = self._sampling_rows(sampled_requests)
        row_requests = [r for r in sampled_requests for _ in range(speculative.num_rows(r))]
        saved_states = speculative.save_generators(sampled_requests, self._generators)
        sampled = self.sampler(logits, rows, self._constrainer(row_requests))
        return speculative.collect(sampled_requests, sampled, self._generators, saved_states)

    def device_memory_bytes(self) -> int | None:
        """Bytes the device allocator holds for tensors (CUDA replicas), None on the CPU (the process RSS,
        process_resident_memory_bytes, covers it).

        Read at most every DEVICE_MEMORY_REFRESH_S: the engine asks after every step, and
        torch.cuda.memory_allocated flattens the allocator's whole stats tree (~0.1 ms, measured on an
        H100 host as 17% of a batch-1 step's host time); the nested form is read without flattening.
        """
        if self.device.type != "cuda":
            return None
        now = time.monotonic()
        if now - self._device_memory_read_at >= DEVICE_MEMORY_REFRESH_S:
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)
            self._device_memory = stats.get("allocated_bytes", {}).get("all", {}).get("current", 0)
            self._device_memory_read_at = now
        return self._device_memory

    def forward_logits(self, requests: Sequence[ScheduledRequest]) -> torch.Tensor | None:
        """One forward over the scheduled tokens -> f32 [num_rows, vocab] logits of the requests whose
        `sample` is set (in order; a speculative decode's 1 + k rows together), or None when none is."""
        batch = build_batch_inputs(requests, self.layout.block_size)
        hidden_states = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        if not batch.sampled_request_ids:
            return None
        return self.model.compute_logits(hidden_states[batch.sample_indices])

    def embed(
        self, inputs: Sequence[Sequence[int]], pooling: str, dimensions: int | None
    ) -> list[list[float]]:
        """Pooled, normalised final hidden states of each input (runner/embeddings.py)."""
        return embeddings.embed(embeddings.module_forward(self.model), inputs, pooling, dimensions)

    def _sampling_rows(self, requests: Sequence[ScheduledRequest]) -> list[SamplingRequestState]:
        rows = []
        for request in requests:
            if request.request_id not in self._generators:
                self._generators[request.request_id] = make_generator(request.params.seed, self.device)
            rows.extend(speculative.sampling_rows(request, self._generators[request.request_id]))
        return rows

    def _constrainer(self, requests: Sequence[ScheduledRequest]) -> Callable[[torch.Tensor], None] | None:
        """The grammar masks of this step's guided rows, or None when no row has a guide."""
        if self.guided is None or all(request.params.guide is None for request in requests):
            return None
        guided = self.guided
        return lambda logits: guided.mask_logits(logits, requests)

    def free_request_state(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)
        if self.guided is not None:
            self.guided.free(request_ids)

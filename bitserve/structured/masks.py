"""GuidedRows: the runner's per-request grammar matchers and the batched token mask of one step.

Each step, for the sampled rows whose params carry a Guide (and only those: a batch without one pays
one list scan), every matcher first catches up with the request's outputs (the scheduler's snapshot,
so it advances with every token the engine accepted, and a preempted request keeps its matcher),
then fills its row of one int32 bitmask [num_rows, ceil(vocab / 32)]; one call applies the rows to
the logits. A matcher allows the stop (EOS) tokens only where its grammar may end, and only them
once it is complete, so a guided sequence ends with EOS (finish "stop") or on its length cap.

A matcher that cannot be built (a guide that never passed the server's validation, e.g. from the
offline LLM) or that refuses a token allows only EOS from then on: the request ends, the engine does
not (anything raised in a step would stop it for every request).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bitserve.core.scheduler_output import ScheduledRequest
from bitserve.errors import InvalidRequest
from bitserve.structured.grammars import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Matcher:
    matcher: Any  # xgrammar.GrammarMatcher, or None once broken (then only EOS is allowed)
    num_consumed: int = 0


class GuidedRows:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, _Matcher] = {}
        self._bitmask = torch.empty(0)  # reused across steps; grown to the largest batch seen
        self._stop_only: torch.Tensor | None = None

    def mask_logits(self, logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> None:
        """Apply each guided row's grammar mask to its row of logits [len(requests), vocab], in place."""
        rows = [i for i, request in enumerate(requests) if request.params.guide is not None]
        if not rows:
            return
        import xgrammar  # NOTE: deferred (grammars.py); already imported by the matchers' compiler

        bitmask = self._bitmask_for(len(requests))
        for row in rows:
            self._fill(requests[row], bitmask, row)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(
            logits, bitmask[: len(requests)], vocab_size=self.compiler.vocab_size, indices=rows
        )

    def free(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def _fill(self, request: ScheduledRequest, bitmask: torch.Tensor, row: int) -> None:
        state = self._matchers.get(request.request_id)
        if state is None:
            state = self._matchers[request.request_id] = _Matcher(self._new_matcher(request))
        outputs = request.output_token_ids
        while state.matcher is not None and state.num_consumed < len(outputs):
            token_id = outputs[state.num_consumed]
            if not state.matcher.accept_token(token_id):
                logger.warning(
                    "request %s: the grammar refused token %d; ending it", request.request_id, token_id
                )
                state.matcher = None
            state.num_consumed += 1
        if state.matcher is not None and not state.matcher.is_terminated():
            state.matcher.fill_next_token_bitmask(bitmask, row)
            if bitmask[row].any():
                return
            logger.warning("request %s: its grammar allows no token here; ending it", request.request_id)
            state.matcher = None
        bitmask[row] = self._stop_only_row()

    def _new_matcher(self, request: ScheduledRequest) -> Any:
        assert request.params.guide is not None
        try:
            return self.compiler.matcher(request.params.guide)
        except InvalidRequest as exc:
            logger.warning("request %s: %s; ending it", request.request_id, exc)
            return None

    def _bitmask_for(self, num_rows: int) -> torch.Tensor:
        if self._bitmask.shape[0] < num_rows:
            num_words = (self.compiler.vocab_size + 31) // 32
            self._bitmask = torch.zeros(
                (max(num_rows, 2 * self._bitmask.shape[0]), num_words), dtype=torch.int32
            )
        return self._bitmask

    def _stop_only_row(self) -> torch.Tensor:
        if self._stop_only is None:
            allowed = torch.zeros(self._bitmask.shape[1] * 32, dtype=torch.bool)
            allowed[self.compiler.stop_token_ids] = True
            weights = torch.tensor([1 << bit for bit in range(32)], dtype=torch.int64)
            words = (allowed.view(-1, 32).to(torch.int64) * weights).sum(dim=1)
            self._stop_only = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return self._stop_only

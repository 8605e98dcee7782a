"""The slow-request log: one WARNING line with a generation's timings when its end-to-end time passes
--slow-request-s. It is written where the request ends, in the request's own task, so the line carries
its request id (and trace id) like every other line of that request."""

from __future__ import annotations

import logging
import time

from bitserve.frontend.generation_stream import StreamTiming

logger = logging.getLogger(__name__)


def request_timings(started: float, timing: StreamTiming, now: float) -> dict[str, float | None]:
    """Seconds: queue (arrival to first schedule), ttft, decode (first to last token) and e2e, rounded
    to the millisecond; None for a phase the request never reached."""
    ttft_s = timing.first_token_at - started if timing.first_token_at is not None else None
    decode_s = (
        (timing.last_token_at or now) - timing.first_token_at if timing.first_token_at is not None else None
    )
    values = {"queue_s": timing.queue_s, "ttft_s": ttft_s, "decode_s": decode_s, "e2e_s": now - started}
    return {name: None if value is None else round(value, 3) for name, value in values.items()}


def log_if_slow(threshold_s: float, started: float, timing: StreamTiming, num_prompt_tokens: int) -> None:
    """Log the request's timings when it took longer than `threshold_s` from `started` (its arrival)."""
    now = time.monotonic()
    if now - started <= threshold_s:
        return
    timings = request_timings(started, timing, now)
    logger.warning(
        "slow request: %.3f s end to end (threshold %g s)",
        now - started,
        threshold_s,
        extra={
            **timings,
            "num_prompt_tokens": num_prompt_tokens,
            "num_output_tokens": timing.num_output_tokens,
        },
    )

"""Summaries of a bench run: latency percentiles, throughput, goodput and errors per concurrency level,
as JSON-ready dicts (seconds, base units) and as text tables (milliseconds, for people).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bitserve.bench.client import RequestResult
from bitserve.bench.runner import BenchConfig, BenchRun, LevelRun

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); `sorted_values` is non-empty,
    ascending."""
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean and p50 / p90 / p99 of `values` (None when there are none)."""
    ordered = sorted(values)
    summary: dict[str, float | int | None] = {
        "count": len(ordered),
        "mean": sum(ordered) / len(ordered) if ordered else None,
    }
    for q in PERCENTILES:
        summary[f"p{q}"] = percentile(ordered, q) if ordered else None
    return summary


def tpot_s(result: RequestResult) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (tokens - 1); None below two tokens."""
    if result.ttft_s is None or result.num_output_tokens < 2:
        return None
    return (result.e2e_s - result.ttft_s) / (result.num_output_tokens - 1)


def meets_slo(result: RequestResult, config: BenchConfig) -> bool:
    if config.goodput_ttft_s is not None and (result.ttft_s is None or result.ttft_s > config.goodput_ttft_s):
        return False
    return config.goodput_e2e_s is None or result.e2e_s <= config.goodput_e2e_s


def summarise_level(level: LevelRun, config: BenchConfig) -> dict[str, Any]:
    """One level's numbers. Latencies and token counts cover successful requests only."""
    ok = [r for r in level.results if r.is_ok]
    failed = [r for r in level.results if not r.is_ok]
    errors = Counter(r.error_kind for r in failed)
    error_samples: dict[str, str | None] = {}
    for result in failed:
        error_samples.setdefault(str(result.error_kind), result.error_detail)
    num_usage = sum(r.is_usage_counted for r in ok)
    source = None if not ok else "usage" if num_usage == len(ok) else "chunks" if num_usage == 0 else "mixed"
    num_output_tokens = sum(r.num_output_tokens for r in ok)
    wall_s = max(level.wall_s, 1e-9)  # perf_counter differences are positive; this only guards the division
    has_slo = config.goodput_ttft_s is not None or config.goodput_e2e_s is not None
    return {
        "concurrency": level.concurrency,
        "num_requests": len(level.results),
        "num_ok": len(ok),
        "num_errors": len(failed),
        "errors": dict(sorted((str(kind), count) for kind, count in errors.items())),
        "error_samples": error_samples,
        "is_cut_by_duration": level.is_cut_by_duration,
        "wall_s": level.wall_s,
        "num_output_tokens": num_output_tokens,
        "token_count_source": source,
        # successful requests that stopped before max_tokens (EOS, or a server ignoring ignore_eos)
        "num_short": sum(r.num_output_tokens < config.max_tokens for r in ok),
        "output_tokens_per_s": num_output_tokens / wall_s,
        "requests_per_s": len(ok) / wall_s,
        "goodput_requests_per_s": sum(meets_slo(r, config) for r in ok) / wall_s if has_slo else None,
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([gap for r in ok for gap in r.itl_s]),
        "tpot_s": distribution([t for r in ok if (t := tpot_s(r)) is not None]),
        "e2e_s": distribution([r.e2e_s for r in ok]),
    }


def summarise(run: BenchRun) -> dict[str, Any]:
    config = run.config
    return {
        "url": run.url,
        "endpoint": run.endpoint,
        "model": run.model,
        "max_tokens": config.max_tokens,
        "prompt": "fixed" if config.prompt is not None else f"synthetic, {config.num_prompt_words} words",
        "ignore_eos": config.ignore_eos,
        "slo": {"ttft_s": config.goodput_ttft_s, "e2e_s": config.goodput_e2e_s},
        "levels": [summarise_level(level, config) for level in run.levels],
    }


def _ms(value: float | int | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


TABLE_HEADER = (
    "conc",
    "reqs",
    "ok",
    "err",
    "tok/s",
    "req/s",
    "good/s",
    "ttft50",
    "ttft99",
    "itl50",
    "itl99",
    "tpot50",
    "e2e50",
    "e2e90",
    "e2e99",
)


def format_table(summary: dict[str, Any]) -> list[str]:
    """Text lines: a header, one row per level, then error details and caveats."""
    lines = [
        f"bench {summary['url']} {summary['endpoint']} model={summary['model']} "
        f"max_tokens={summary['max_tokens']} prompt={summary['prompt']}"
    ]
    lines += render_rows([TABLE_HEADER, *(_table_row(level) for level in summary["levels"])])
    lines.append("latencies in ms; tok/s and req/s over each level's wall time; good/s meets the SLOs")
    for level in summary["levels"]:
        lines += _level_notes(level)
    return lines


def _table_row(level: dict[str, Any]) -> tuple[str, ...]:
    """One level's cells, in TABLE_HEADER's order."""
    return (
        str(level["concurrency"]),
        str(level["num_requests"]),
        str(level["num_ok"]),
        str(level["num_errors"]),
        _num(level["output_tokens_per_s"], 1),
        _num(level["requests_per_s"]),
        _num(level["goodput_requests_per_s"]),
        _ms(level["ttft_s"]["p50"]),
        _ms(level["ttft_s"]["p99"]),
        _ms(level["itl_s"]["p50"]),
        _ms(level["itl_s"]["p99"]),
        _ms(level["tpot_s"]["p50"]),
        _ms(level["e2e_s"]["p50"]),
        _ms(level["e2e_s"]["p90"]),
        _ms(level["e2e_s"]["p99"]),
    )


def _level_notes(level: dict[str, Any]) -> list[str]:
    """The lines under the table for one level: its errors and caveats, then a sample of each error."""
    lines = []
    notes = []
    if level["errors"]:
        notes.append("errors " + ", ".join(f"{kind}={count}" for kind, count in level["errors"].items()))
    if level["token_count_source"] not in (None, "usage"):
        notes.append(f"tokens counted from {level['token_count_source']} (no usage chunk from the server)")
    if level["num_short"]:
        notes.append(f"{level['num_short']} requests ended before max_tokens")
    if level["is_cut_by_duration"]:
        notes.append("stopped by --duration-s")
    if notes:
        lines.append(f"  conc {level['concurrency']}: " + "; ".join(notes))
    for kind, detail in level["error_samples"].items():
        if detail:
            lines.append(f"    {kind}: {detail[:160]}")
    return lines


def render_rows(rows: Sequence[Sequence[str]]) -> list[str]:
    """Right-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]

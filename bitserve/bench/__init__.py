"""`bitserve bench`: a bounded load generator for any OpenAI-compatible server (loopback by default).

sse.py parses event streams, client.py streams and times one request, runner.py drives concurrency
levels, report.py turns results into percentiles, throughput and goodput. Imports nothing of the engine.
"""

from bitserve.bench.client import OpenAIClient, RequestResult
from bitserve.bench.report import format_table, summarise
from bitserve.bench.runner import BenchConfig, BenchRun, LevelRun, run_bench_async
from bitserve.bench.sse import SSEEvent, SSEParser

__all__ = [
    "BenchConfig",
    "BenchRun",
    "LevelRun",
    "OpenAIClient",
    "RequestResult",
    "SSEEvent",
    "SSEParser",
    "format_table",
    "run_bench_async",
    "summarise",
]

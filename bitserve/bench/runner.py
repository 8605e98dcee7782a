"""The load runner: for each concurrency level, a bounded number of streaming requests over a fixed
pool of workers, stopped by count or by a time cap. Produces raw RequestResults; report.py summarises.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from dataclasses import dataclass

from bitserve.bench.client import ENDPOINT_PATHS, OpenAIClient, RequestResult, build_body, check_url
from bitserve.errors import InvalidRequest

logger = logging.getLogger(__name__)

MAX_CONCURRENCY = 1024
MAX_NUM_REQUESTS = 10_000  # per level
MAX_DEFAULT_NUM_REQUESTS = 1000  # the default (4 x concurrency) stops here
MAX_PROMPT_WORDS = 100_000

# Common words for synthetic prompts; each request draws its own sequence, so prompts share no
# prefix beyond a token or two and a prefix cache gives no server an edge.
_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name"
).split()


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Everything one bench run needs; built from CLI flags by bench_command.config_from_args."""

    url: str
    endpoint: str = "chat"  # what users serve: the chat template applies, as in production traffic
    model: str | None = None  # None: the first id of GET /v1/models
    concurrency_levels: tuple[int, ...] = (1, 4, 16)
    num_requests: int | None = None  # per level; None: 4 x concurrency, at most MAX_DEFAULT_NUM_REQUESTS
    max_tokens: int = 100
    prompt: str | None = None
    num_prompt_words: int = 32  # synthetic prompt length when `prompt` is None
    prompt_seed: str = ""  # varies the synthetic prompts: a fresh seed meets no server's prompt cache
    temperature: float = 0.0
    ignore_eos: bool = False
    include_usage: bool = True  # ask for a usage chunk (stream_options.include_usage)
    timeout_s: float = 120.0  # per request, start to [DONE]
    duration_s: float = 600.0  # per level: no request starts after this
    num_warmup: int = 1  # unmeasured requests before the first level
    goodput_ttft_s: float | None = None
    goodput_e2e_s: float | None = None
    api_key: str | None = None
    allow_remote: bool = False


@dataclass(frozen=True, slots=True)
class LevelRun:
    concurrency: int
    results: list[RequestResult]
    wall_s: float
    is_cut_by_duration: bool


@dataclass(frozen=True, slots=True)
class BenchRun:
    url: str
    endpoint: str
    model: str
    config: BenchConfig
    levels: list[LevelRun]


def validate_config(config: BenchConfig) -> None:
    """Range-check every option before any traffic; raises InvalidRequest naming the flag."""
    check_url(config.url, allow_remote=config.allow_remote)
    checks = [
        (config.endpoint in ENDPOINT_PATHS, "endpoint", f"one of {sorted(ENDPOINT_PATHS)}"),
        (
            bool(config.concurrency_levels)
            and all(1 <= c <= MAX_CONCURRENCY for c in config.concurrency_levels),
            "concurrency",
            f"comma-separated integers in [1, {MAX_CONCURRENCY}]",
        ),
        (
            config.num_requests is None or 1 <= config.num_requests <= MAX_NUM_REQUESTS,
            "num-requests",
            f"in [1, {MAX_NUM_REQUESTS}]",
        ),
        (1 <= config.max_tokens <= 1_000_000, "max-tokens", "in [1, 1000000]"),
        (
            config.prompt is not None or 1 <= config.num_prompt_words <= MAX_PROMPT_WORDS,
            "prompt-tokens",
            f"in [1, {MAX_PROMPT_WORDS}]",
        ),
        (0.0 <= config.temperature <= 2.0, "temperature", "in [0, 2]"),
        (0.0 < config.timeout_s <= 3600.0, "timeout", "in (0, 3600] seconds"),
        (0.0 < config.duration_s <= 86_400.0, "duration-s", "in (0, 86400] seconds"),
        (0 <= config.num_warmup <= 100, "num-warmup", "in [0, 100]"),
        (config.goodput_ttft_s is None or config.goodput_ttft_s > 0, "goodput-ttft-s", "positive"),
        (config.goodput_e2e_s is None or config.goodput_e2e_s > 0, "goodput-e2e-s", "positive"),
    ]
    for is_valid, flag, allowed in checks:
        if not is_valid:
            raise InvalidRequest(f"--{flag} must be {allowed}", param=flag)


def default_num_requests(concurrency: int) -> int:
    return min(4 * concurrency, max(MAX_DEFAULT_NUM_REQUESTS, concurrency))


def synthetic_prompt(index: int, num_words: int, seed: str = "") -> str:
    """About `num_words` words, distinct per request index, identical across runs (and servers) with the
    same seed."""
    key = f"{seed}/{index}" if seed else str(index)  # no seed: the prompts of earlier runs
    rng = random.Random(f"bitserve-bench-{key}")  # a str seed: random.Random(-1) would equal Random(1)
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def prompt_for(config: BenchConfig, index: int) -> str:
    if config.prompt is not None:
        return config.prompt
    return synthetic_prompt(index, config.num_prompt_words, config.prompt_seed)


async def run_bench_async(config: BenchConfig) -> BenchRun:
    """Resolve the model, warm up, then run every concurrency level in order."""
    validate_config(config)
    max_connections = max(config.concurrency_levels)
    async with OpenAIClient(
        config.url,
        timeout_s=config.timeout_s,
        max_connections=max_connections,
        api_key=config.api_key,
        allow_remote=config.allow_remote,
    ) as client:
        model = config.model
        if model is None:
            model_ids = await client.list_models()
            if not model_ids:
                raise InvalidRequest(
                    f"{client.url}/v1/models lists no model", param="model", hint="pass --model"
                )
            model = model_ids[0]
        await _warm_up(client, config, model)
        levels: list[LevelRun] = []
        for concurrency in config.concurrency_levels:
            logger.info("bench: concurrency %d against %s (%s)", concurrency, client.url, model)
            # prompt indices continue across levels, so no level finds an earlier level's prompts cached
            first_index = sum(len(level.results) for level in levels)
            levels.append(await run_level(client, config, model, concurrency, first_index=first_index))
    return BenchRun(
        check_url(config.url, allow_remote=config.allow_remote), config.endpoint, model, config, levels
    )


async def _warm_up(client: OpenAIClient, config: BenchConfig, model: str) -> None:
    for index in range(config.num_warmup):
        # negative indices: warm-up prompts differ from every measured one
        result = await client.stream(config.endpoint, _body(config, model, -1 - index))
        if not result.is_ok:
            logger.warning("bench warm-up request failed: %s %s", result.error_kind, result.error_detail)


def _body(config: BenchConfig, model: str, index: int) -> dict[str, object]:
    return build_body(
        config.endpoint,
        model,
        prompt_for(config, index),
        max_tokens=config.max_tokens,
        temperature=config.temperature,
        ignore_eos=config.ignore_eos,
        include_usage=config.include_usage,
    )


async def run_level(
    client: OpenAIClient, config: BenchConfig, model: str, concurrency: int, *, first_index: int = 0
) -> LevelRun:
    """`concurrency` workers each send one request at a time until the level's count or time is spent.

    Ends by itself: at most num_requests requests start, none after duration_s, and each is bounded
    by the client's timeout, so the level lasts at most duration_s + timeout_s.
    """
    num_requests = config.num_requests or default_num_requests(concurrency)
    indices = itertools.count()
    results: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + config.duration_s
    is_cut = False

    async def worker() -> None:
        nonlocal is_cut
        for index in indices:
            if index >= num_requests:
                return
            if time.perf_counter() >= deadline:
                is_cut = True
                return
            results.append(await client.stream(config.endpoint, _body(config, model, first_index + index)))

    tasks = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, num_requests))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # only matters when one worker raised: the others must not run on
            task.cancel()
    wall_s = time.perf_counter() - start
    if is_cut:
        logger.warning(
            "bench: concurrency %d stopped at --duration-s after %d requests", concurrency, len(results)
        )
    return LevelRun(concurrency, results, wall_s, is_cut)

"""Constrained decoding through the engine (issue 14): what a grammar costs per token, and whether a
guided sequence slows the unguided ones beside it.

Drives one loaded model's Engine step by step (no HTTP). Every scenario decodes `--tokens` tokens for
each of its sequences (greedy, `ignore_eos` for the free ones; the guided ones use a regex that cannot
end before the budget, so every sequence stays in the batch throughout) and reports:

- `free_tok_s`: decode tokens/s of ONE unconstrained sequence (its tokens over the decode steps' wall
  time), the number the "never slow sequences that don't" claim is about;
- `mask_us_per_row`: wall time inside the runner's grammar masks (GuidedRows.mask_logits: matchers
  catching up, bitmask fill, one batched apply) per guided row per step.

Scenarios: the free sequence alone; with 1 free / 1 guided neighbour (the same batch size either way,
so the difference is the grammar, not the batch); and 4 free + 4 guided vs 8 free. Repeated `--repeat`
times in rotation (the machine is shared), medians printed as one JSON line per scenario.

    python benchmarks/bench_structured.py --tokens 48 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from bitserve.engine.messages import EngineRequest
from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams
from bitserve.structured.guide import Guide, GuideKind
from bitserve.structured.masks import GuidedRows

PROMPT = "Write a long list of words about the sea, separated by spaces:"
SCENARIOS = {  # name -> (free neighbours, guided neighbours), beside the measured free sequence
    "alone": (0, 0),
    "free+1free": (1, 0),
    "free+1guided": (0, 1),
    "free+7free": (7, 0),
    "free+3free+4guided": (3, 4),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=3)
    return parser.parse_args(argv)


class MaskTimer:
    """Wraps the runner's GuidedRows.mask_logits to add up its wall time and the rows it masked."""

    def __init__(self, guided: GuidedRows) -> None:
        self.seconds = 0.0
        self.rows = 0
        inner = guided.mask_logits

        def timed(logits: Any, requests: Any) -> None:
            start = time.perf_counter()
            inner(logits, requests)
            self.seconds += time.perf_counter() - start
            self.rows += sum(request.params.guide is not None for request in requests)

        guided.mask_logits = timed  # type: ignore[method-assign]


def run_scenario(
    llm: LLM, timer: MaskTimer, num_free: int, num_guided: int, num_tokens: int, run: int
) -> dict:
    engine, eos = llm.engine, llm.tokenizer.eos_token_ids
    prompt = tuple(llm.encode(PROMPT))
    free = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    # [a-z ]{N}: never complete (so never EOS) before the token budget runs out
    guide = Guide(GuideKind.REGEX, f"[a-z ]{{{4 * num_tokens}}}", "guided_regex")
    guided = SamplingParams(max_tokens=num_tokens, temperature=0.0, guide=guide)
    requests = [EngineRequest(f"measured-{run}", prompt, free, eos)]
    requests += [EngineRequest(f"free-{run}-{i}", prompt, free, eos) for i in range(num_free)]
    requests += [EngineRequest(f"guided-{run}-{i}", prompt, guided, eos) for i in range(num_guided)]
    for request in requests:
        engine.add_request(request)
    timer.seconds, timer.rows = 0.0, 0
    decode_s, measured_tokens, first_step = 0.0, 0, True
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        result = engine.step()
        elapsed = time.perf_counter() - start
        new = sum(len(o.new_token_ids) for o in result.outputs if o.request_id == f"measured-{run}")
        if not first_step:  # the first step is the prompts' prefill
            decode_s += elapsed
            measured_tokens += new
        first_step = False
    return {
        "free_tok_s": measured_tokens / decode_s,
        "mask_us_per_row": timer.seconds / timer.rows * 1e6 if timer.rows else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    llm = LLM(args.model)
    assert llm.engine.runner.guided is not None
    timer = MaskTimer(llm.engine.runner.guided)
    run_scenario(llm, timer, 0, 1, 8, -1)  # warm-up: xgrammar import, tokenizer info, first compile
    samples: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    for repeat in range(args.repeat):
        for index, (name, (num_free, num_guided)) in enumerate(SCENARIOS.items()):
            run = repeat * len(SCENARIOS) + index
            samples[name].append(run_scenario(llm, timer, num_free, num_guided, args.tokens, run))
    for name, runs in samples.items():
        row = {"scenario": name, "tokens": args.tokens, "runs": len(runs)}
        for key in ("free_tok_s", "mask_us_per_row"):
            row[key] = round(statistics.median(run[key] for run in runs), 1)
        sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

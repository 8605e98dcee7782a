"""Speculative decoding with n-gram (prompt lookup) drafts, on against off (issue 41, item 2).

    python benchmarks/bench_speculative.py                       # SmolLM2, 12 + 12 prompts, 128 tokens
    python benchmarks/bench_speculative.py --max-tokens 64 --num-speculative-tokens 4 --json out.json

Two engines over the same model file, one with `speculative="ngram"`, run the same chat prompts greedily,
one stream at a time, alternating which goes first per prompt. For each prompt: tokens, tok/s each way,
drafts verified and accepted, and whether the tokens are identical (they must be: speculation is exact).
Per class (input-grounded prompts: repeat / fix / edit given text or code; open chat): tok/s over the
class's whole time each way and their ratio (issue 41's targets: >= 1.8x input-grounded, >= 0.95x open chat).

Also the cost that decides it on the cpu backend: one plain decode step (1 token, the one-call compiled
step), a verify step of 1 + 4 tokens laid out as the runner lays it out (five one-token rows over one block
table: the compiled step), and the same 5 tokens as one 5-token sequence (the module forward).
Timings only; nothing is asserted but token identity, which is reported.
"""

from __future__ import annotations

import bitserve  # noqa: F401  (first: sets the OpenMP wait default before torch / numba load libgomp)

# isort: split

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitserve.core.request import Request  # noqa: E402
from bitserve.core.scheduler_output import ScheduledRequest  # noqa: E402
from bitserve.llm import LLM  # noqa: E402
from bitserve.runner.input_batch import build_batch_inputs  # noqa: E402
from bitserve.sampling_params import SamplingParams  # noqa: E402

CODE = """def total(items):
    result = 0
    for item in items:
        result = result + item.price * item.quantity
    return result"""
TEXT = (
    "The city library opens at nine in the morning and closes at six in the evening. Members may borrow "
    "up to ten books at a time, and each loan lasts three weeks."
)
# prompts whose answers copy from the prompt: prompt lookup's case
INPUT_GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    "Fix the spelling mistakes in this text and write it out again:\n\nThe wether was realy nice "
    "yesterday, so we went to the beech and swam in the see until the sun went down.",
    f"Rename the variable `result` to `amount` in this code and show the whole code:\n\n{CODE}",
    f"Add a one-line docstring to this function and show the whole function:\n\n{CODE}",
    "Correct the grammar of this sentence and repeat it: Me and him goes to the store every days "
    "because we likes the fresh breads they sells there.",
    'Copy this JSON and change the age to 31:\n\n{"name": "Alice Smith", "age": 30, "city": "Paris", '
    '"email": "alice@example.com", "languages": ["English", "French"]}',
    "Rewrite this SQL query with the table users replaced by customers:\n\nSELECT id, name, email FROM "
    "users WHERE created_at > '2024-01-01' AND status = 'active' ORDER BY name LIMIT 10;",
    "Here is an email. Write it again, signed by Bob instead of Alice:\n\nHi team, the meeting on "
    "Thursday is moved to Friday at ten. Please bring your reports and the budget numbers. Thanks, Alice",
    f"Write this text again with every sentence on its own line:\n\n{TEXT}",
    "Remove the comments from this code and show the rest unchanged:\n\nimport os  # the os module\n"
    "def list_files(path):  # list a folder\n    names = os.listdir(path)  # every entry\n"
    "    return sorted(names)  # in order",
    "Sort this list alphabetically and write it out, one item per line: banana, apple, cherry, grape, "
    "orange, lemon, mango, kiwi",
    f"Copy this code exactly:\n\n{CODE}",
]
OPEN_CHAT = [
    "What is the capital of France, and why is it famous?",
    "Write a short poem about the sea.",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis to a ten-year-old.",
    "What are the benefits of regular exercise?",
    "Tell me a short story about a dragon who is afraid of the dark.",
    "How do I make a good cup of tea?",
    "What is machine learning, in simple words?",
    "Suggest five names for a pet cat and say why.",
    "Why is the sky blue?",
    "What should I pack for a weekend hiking trip?",
    "Describe the life cycle of a butterfly.",
]


def run_one(llm: LLM, prompt: str, params: SamplingParams) -> dict[str, Any]:
    """One chat prompt alone: its tokens, seconds, and the drafts verified / accepted on the way."""
    engine = llm.engine
    step, stats = engine.step, []

    def counting_step():  # noqa: ANN202
        result = step()
        stats.append(result.stats)
        return result

    engine.step = counting_step  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        output = llm.chat([{"role": "user", "content": prompt}], params)[0].outputs[0]
        seconds = time.perf_counter() - start
    finally:
        engine.step = step  # type: ignore[method-assign]
    return {
        "token_ids": output.token_ids,
        "seconds": seconds,
        "steps": len(stats),
        "drafted": sum(s.num_draft_tokens for s in stats),
        "accepted": sum(s.num_accepted_tokens for s in stats),
    }


def run_class(name: str, prompts: list[str], off: LLM, on: LLM, params: SamplingParams) -> dict[str, Any]:
    rows = []
    for index, prompt in enumerate(prompts):
        order = [("off", off), ("on", on)] if index % 2 == 0 else [("on", on), ("off", off)]
        result = {label: run_one(llm, prompt, params) for label, llm in order}
        rows.append(result)
        a, b = result["off"], result["on"]
        n = len(a["token_ids"])
        print(
            f"  {name} {index:2d}: {n:3d} tok  off {n / a['seconds']:6.1f} tok/s  on "
            f"{len(b['token_ids']) / b['seconds']:6.1f} tok/s  x{a['seconds'] / b['seconds']:.2f}  "
            f"accepted {b['accepted']:3d}/{b['drafted']:3d}  steps {a['steps']}->{b['steps']}  "
            f"identical {a['token_ids'] == b['token_ids']}",
            flush=True,
        )
    tokens = sum(len(r["off"]["token_ids"]) for r in rows)
    off_s, on_s = (sum(r[label]["seconds"] for r in rows) for label in ("off", "on"))
    drafted, accepted = (sum(r["on"][key] for r in rows) for key in ("drafted", "accepted"))
    summary = {
        "class": name,
        "prompts": len(rows),
        "tokens": tokens,
        "off_tok_s": tokens / off_s,
        "on_tok_s": sum(len(r["on"]["token_ids"]) for r in rows) / on_s,
        "speedup": off_s / on_s,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
        "identical": sum(r["off"]["token_ids"] == r["on"]["token_ids"] for r in rows),
        "steps_off": sum(r["off"]["steps"] for r in rows),
        "steps_on": sum(r["on"]["steps"] for r in rows),
    }
    print(
        f"{name}: off {summary['off_tok_s']:.1f} tok/s, on {summary['on_tok_s']:.1f} tok/s, "
        f"x{summary['speedup']:.2f}; acceptance {summary['acceptance']:.1%} ({accepted}/{drafted}); "
        f"steps {summary['steps_off']} -> {summary['steps_on']}; "
        f"identical {summary['identical']}/{len(rows)}",
        flush=True,
    )
    return summary


def step_costs(llm: LLM, draft_counts: list[int], reps: int) -> dict[str, float]:
    """Median and min ms of a plain 1-token decode, a 1 + k verify as the runner lays it out (one-token
    rows) for each k of draft_counts, and 1 + max(k) tokens as one sequence (the module forward), at a
    ~40-token context; the cases alternate, so a busy machine slows each alike."""
    num_drafts = max(draft_counts)
    runner, kv = llm.engine.runner, llm.engine.scheduler.kv
    assert not llm.engine.has_unfinished_requests()
    prompt = llm.encode(TEXT)
    request = Request("bench-step-cost", tuple(prompt), SamplingParams(temperature=0))
    blocks = kv.allocate_slots(request, len(prompt) + num_drafts + 1)  # free blocks only; freed below
    assert blocks is not None
    params = SamplingParams(temperature=0)
    n = len(prompt)

    def scheduled(tokens: list[int], drafts: tuple[int, ...] = ()) -> ScheduledRequest:
        """The decode at position n (just after the prompt) of `tokens` (1, or 1 + k)."""
        return ScheduledRequest(
            "x", tokens, n, blocks, True, params, n, tuple(prompt), draft_token_ids=drafts
        )

    def forward(requests: list[ScheduledRequest]) -> None:
        batch = build_batch_inputs(requests, runner.layout.block_size)
        hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.attn)
        runner.model.compute_logits(hidden[batch.sample_indices])

    drafts = tuple(prompt[1 : 1 + num_drafts])
    cases = {"plain_1_token_ms": [scheduled([prompt[0]])]}
    for k in draft_counts:
        cases[f"verify_{1 + k}_rows_ms"] = [scheduled([prompt[0], *drafts[:k]], drafts[:k])]
    cases[f"one_sequence_{1 + num_drafts}_tokens_ms"] = [scheduled([prompt[0], *drafts])]
    costs = {}
    try:
        with torch.inference_mode():
            forward([ScheduledRequest("x", prompt, 0, blocks, True, params, 0, tuple(prompt))])
            for _ in range(3):  # warm every shape (numba compiles per batch size on first use)
                for requests in cases.values():
                    forward(requests)
            times: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(reps):
                for name, requests in cases.items():
                    start = time.perf_counter()
                    forward(requests)
                    times[name].append(time.perf_counter() - start)
            for name, values in times.items():
                costs[name] = statistics.median(values) * 1e3
                costs[name.replace("_ms", "_min_ms")] = min(values) * 1e3
    finally:
        kv.free(request)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--step-reps", type=int, default=50, help="repetitions of each step-cost case")
    parser.add_argument("--step-drafts", default="", help="draft counts to time verifies of (default: k)")
    parser.add_argument("--only", choices=["grounded", "chat", "steps"], default=None)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    off = LLM(args.model)
    on = LLM(args.model, speculative="ngram", num_speculative_tokens=args.num_speculative_tokens)
    draft_counts = [int(k) for k in args.step_drafts.split(",") if k] or [args.num_speculative_tokens]
    costs = step_costs(on, draft_counts, args.step_reps)
    print("step cost (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()), flush=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    classes = [("grounded", INPUT_GROUNDED), ("chat", OPEN_CHAT)]
    results = [
        run_class(name, prompts, off, on, params) for name, prompts in classes if args.only in (None, name)
    ]
    if args.json:
        Path(args.json).write_text(json.dumps({"step_costs": costs, "classes": results}, indent=2))


if __name__ == "__main__":
    main()

"""Generate the llama.cpp golden fixtures the test suite compares bitserve against.

    python scripts/make_golden.py            # needs llama-cpp-python (pip install '.[crossval]')

Writes tests/fixtures/golden/:
  smollm2.json        prompts (chat and plain, non-ASCII), llama.cpp prompt token ids, 64 greedy tokens
                      and the per-position argmax of the prompt logits
  smollm2_logits.npz  llama.cpp's full prompt logits (float16) for the first prompts
  synthetic.json      greedy tokens of the synthetic BitNet model stored as F32 and TQ2_0, plus the
                      sha256 of each file so a changed writer is caught instead of silently compared
  synthetic_last_logits.npz  llama.cpp's logits (float16) at the last prompt position of each case
The same comparisons run live, without fixtures, with `bitserve crossval`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bitserve.catalog import resolve_model  # noqa: E402
from bitserve.testing.synthetic import SyntheticConfig, make_weights, tokenizer_metadata, write_synthetic_model  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "golden"
SMOLLM2_NUM_TOKENS = 64
SYNTHETIC_NUM_TOKENS = 24
NUM_LOGIT_PROMPTS = 2
CHATML_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str, system: str = CHATML_SYSTEM) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


SMOLLM2_PROMPTS: list[dict[str, str]] = [
    {"kind": "plain", "text": "The capital of France is"},
    {"kind": "chat", "text": chatml("What is the capital of France?")},
    {"kind": "plain", "text": "def fibonacci(n):\n    "},
    {"kind": "chat", "text": chatml("Write a haiku about the sea.")},
    {"kind": "plain", "text": "Once upon a time, in a small village,"},
    {"kind": "chat", "text": chatml("Translate to French: I like apples.")},
    {"kind": "plain", "text": "Le café est très bon, mais le thé"},
    {"kind": "chat", "text": chatml("¿Cuál es la capital de España? Responde brevemente.")},
    {"kind": "plain", "text": "東京は日本の首都です。大阪は"},
    {"kind": "chat", "text": chatml("List three prime numbers 🙂")},
]
SYNTHETIC_PROMPTS = ["Hello world, this is", "1 2 3 4 5 6", "Ternary émigré 東京 🙂"]


def open_llama(path: Path):  # noqa: ANN201 - llama_cpp.Llama
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=1024, n_threads=2, n_batch=512, logits_all=True, verbose=False, seed=0)


def greedy(llm, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], np.ndarray]:  # noqa: ANN001
    """llama.cpp greedy continuation (EOS ignored, exactly num_tokens) and the prompt logits."""
    llm.reset()
    llm.eval(prompt_ids)
    prompt_logits = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    tokens: list[int] = []
    for _ in range(num_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        llm.eval([token])
    return tokens, prompt_logits


def make_smollm2() -> None:
    llm = open_llama(resolve_model("smollm2-135m-instruct", fetch=False))
    cases, logits = [], {}
    for index, prompt in enumerate(SMOLLM2_PROMPTS):
        ids = llm.tokenize(prompt["text"].encode("utf-8"), add_bos=False, special=True)
        tokens, prompt_logits = greedy(llm, ids, SMOLLM2_NUM_TOKENS)
        cases.append(prompt | {"prompt_token_ids": ids, "greedy_token_ids": tokens,
                               "prompt_argmax": prompt_logits.argmax(axis=1).tolist()})  # fmt: skip
        if index < NUM_LOGIT_PROMPTS:
            logits[f"prompt{index}"] = prompt_logits.astype(np.float16)
    (FIXTURES / "smollm2.json").write_text(json.dumps({"num_tokens": SMOLLM2_NUM_TOKENS, "cases": cases}, ensure_ascii=False, indent=1))
    np.savez_compressed(FIXTURES / "smollm2_logits.npz", **logits)


def make_synthetic() -> None:
    config = SyntheticConfig()
    tokenizer = tokenizer_metadata(resolve_model("smollm2-135m-instruct", fetch=False))
    weights = make_weights(config, len(tokenizer["tokenizer.ggml.tokens"][1]))
    result: dict[str, dict] = {}
    logits: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("F32", "TQ2_0"):
            path = write_synthetic_model(Path(tmp) / f"bitnet-{fmt}.gguf", fmt, config=config, weights=weights, tokenizer=tokenizer)
            llm = open_llama(path)
            cases = []
            for text in SYNTHETIC_PROMPTS:
                ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
                tokens, prompt_logits = greedy(llm, ids, SYNTHETIC_NUM_TOKENS)
                cases.append({"text": text, "prompt_token_ids": ids, "greedy_token_ids": tokens})
                logits[f"{fmt}_{len(cases) - 1}"] = prompt_logits[-1].astype(np.float16)
            result[fmt] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "cases": cases}
            del llm
    (FIXTURES / "synthetic.json").write_text(json.dumps({"num_tokens": SYNTHETIC_NUM_TOKENS, "formats": result}, ensure_ascii=False, indent=1))
    np.savez_compressed(FIXTURES / "synthetic_last_logits.npz", **logits)


def main() -> int:
    import llama_cpp

    FIXTURES.mkdir(parents=True, exist_ok=True)
    make_smollm2()
    make_synthetic()
    (FIXTURES / "README.md").write_text(
        f"Generated by `python scripts/make_golden.py` with llama-cpp-python {llama_cpp.__version__}; do not edit.\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

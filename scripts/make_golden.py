"""Generate the llama.cpp golden fixtures the test suite compares bitserve against.

    python scripts/make_golden.py            # needs llama-cpp-python (pip install '.[crossval]')

Writes tests/fixtures/golden/:
  smollm2.json        prompts (chat and plain, non-ASCII) and, per reference, llama.cpp's prompt token
                      ids, 64 greedy tokens with llama.cpp's top-2 margin at each step, and the argmax of
                      every prompt position. Two references:
                      "f32":    llama.cpp on SmolLM2's Q4_1 weights dequantized (by gguf-py) into an F32
                                GGUF, with an F32 KV cache: the same weights bitserve computes with, and
                                llama.cpp's graph without its activation quantization;
                      "native": llama.cpp on the Q4_1 file itself (Q8_1 activations, F16 KV cache),
                                whose ulp-sensitive rounding makes exact agreement impossible (see tests).
  smollm2_logits.npz  llama.cpp's full prompt logits (float16) for the first prompts, both references
  synthetic.json      greedy tokens of the synthetic BitNet model stored as F32 and TQ2_0 (llama.cpp with
                      an F32 KV cache, so attention is plain float32 as in bitserve), plus the
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

from bitserve.loader.catalog import resolve_model  # noqa: E402
from bitserve.testing.synthetic import (  # noqa: E402
    SyntheticConfig,
    make_weights,
    tokenizer_metadata,
    write_synthetic_model,
)

FIXTURES = ROOT / "tests" / "fixtures" / "golden"
SMOLLM2_NUM_TOKENS = 64
SYNTHETIC_NUM_TOKENS = 24
NUM_LOGIT_PROMPTS = 2
CHATML_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(user: str, system: str = CHATML_SYSTEM) -> str:
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


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


GGML_TYPE_F32 = 0


def open_llama(path: Path, *, f32_kv: bool = False):  # noqa: ANN201 - llama_cpp.Llama
    from llama_cpp import Llama

    kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_kv else {}
    return Llama(
        model_path=str(path),
        n_ctx=1024,
        n_threads=2,
        n_batch=512,
        logits_all=True,
        verbose=False,
        seed=0,
        **kv,
    )


def top2_margin(logits: np.ndarray) -> float:
    top = np.partition(logits, -2)[-2:]
    return float(abs(top[1] - top[0]))


def greedy(llm, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[float], np.ndarray]:  # noqa: ANN001
    """llama.cpp greedy continuation (EOS ignored, exactly num_tokens), its top-2 margin at each step,
    and the prompt logits."""
    llm.reset()
    llm.eval(prompt_ids)
    prompt_logits = np.array(llm.scores[: llm.n_tokens], dtype=np.float32)
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(num_tokens):
        step_logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        tokens.append(int(np.argmax(step_logits)))
        margins.append(round(top2_margin(step_logits), 5))
        llm.eval([tokens[-1]])
    return tokens, margins, prompt_logits


def write_dequantized_f32(source: Path, target: Path) -> None:
    """SmolLM2 with every tensor dequantized to F32 by gguf-py (independent of bitserve's decoder)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), value_type, field.types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), value_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape(tuple(int(d) for d in reversed(tensor.shape))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def smollm2_reference(llm, logits: dict[str, np.ndarray], key: str) -> list[dict]:  # noqa: ANN001
    cases = []
    for index, prompt in enumerate(SMOLLM2_PROMPTS):
        ids = llm.tokenize(prompt["text"].encode("utf-8"), add_bos=False, special=True)
        tokens, margins, prompt_logits = greedy(llm, ids, SMOLLM2_NUM_TOKENS)
        cases.append(
            {
                "prompt_token_ids": ids,
                "greedy_token_ids": tokens,
                "greedy_margins": margins,
                "prompt_argmax": prompt_logits.argmax(axis=1).tolist(),
            }
        )
        if index < NUM_LOGIT_PROMPTS:
            logits[f"{key}_prompt{index}"] = prompt_logits.astype(np.float16)
    return cases


def make_smollm2(out: Path) -> None:
    source = resolve_model("smollm2-135m-instruct", fetch=False)
    logits: dict[str, np.ndarray] = {}
    references = {"native": smollm2_reference(open_llama(source), logits, "native")}
    with tempfile.TemporaryDirectory() as tmp:
        f32_path = Path(tmp) / "smollm2-f32.gguf"
        write_dequantized_f32(source, f32_path)
        references["f32"] = smollm2_reference(open_llama(f32_path, f32_kv=True), logits, "f32")
    fixture = {"num_tokens": SMOLLM2_NUM_TOKENS, "prompts": SMOLLM2_PROMPTS, "references": references}
    (out / "smollm2.json").write_text(json.dumps(fixture, ensure_ascii=False, indent=1))
    np.savez_compressed(out / "smollm2_logits.npz", **logits)


def make_synthetic(out: Path) -> None:
    config = SyntheticConfig()
    tokenizer = tokenizer_metadata(resolve_model("smollm2-135m-instruct", fetch=False))
    weights = make_weights(config, len(tokenizer["tokenizer.ggml.tokens"][1]))
    result: dict[str, dict] = {}
    logits: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("F32", "TQ2_0"):
            path = write_synthetic_model(
                Path(tmp) / f"bitnet-{fmt}.gguf", fmt, config=config, weights=weights, tokenizer=tokenizer
            )
            llm = open_llama(path, f32_kv=True)
            cases = []
            for text in SYNTHETIC_PROMPTS:
                ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
                tokens, margins, prompt_logits = greedy(llm, ids, SYNTHETIC_NUM_TOKENS)
                cases.append(
                    {
                        "text": text,
                        "prompt_token_ids": ids,
                        "greedy_token_ids": tokens,
                        "greedy_margins": margins,
                    }
                )
                logits[f"{fmt}_{len(cases) - 1}"] = prompt_logits[-1].astype(np.float16)
            result[fmt] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "cases": cases}
            del llm
    (out / "synthetic.json").write_text(
        json.dumps({"num_tokens": SYNTHETIC_NUM_TOKENS, "formats": result}, ensure_ascii=False, indent=1)
    )
    np.savez_compressed(out / "synthetic_last_logits.npz", **logits)


def main(out: Path = FIXTURES) -> int:
    import llama_cpp

    out.mkdir(parents=True, exist_ok=True)
    make_smollm2(out)
    make_synthetic(out)
    (out / "README.md").write_text(
        "Generated by `python scripts/make_golden.py` "
        f"with llama-cpp-python {llama_cpp.__version__}; do not edit.\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generate the llama.cpp golden fixtures of the K-quant mixes: a small random llama checkpoint requantized
by llama.cpp's own llama_model_quantize to Q4_K_M, Q5_K_M, Q3_K_M, Q6_K and Q2_K, and llama.cpp's greedy
tokens.

    python scripts/make_kquant_golden.py    # needs llama-cpp-python 0.3.36 (pip install '.[crossval]')

gguf-py has no K-quant quantizer, so CI cannot make these files itself: the fixture holds the tensors
llama.cpp wrote. The checkpoint (bitserve/testing/hf_checkpoints.random_checkpoint, width 256: every
projection's input whole 256-value super-blocks, so no type falls back) is converted to F32 by
loader/hf_convert.py; llama.cpp requantizes it with the embedding kept F32 (token_embedding_type), so
only the projections change. Writes tests/fixtures/golden/:
  kquant_tensors.npz   per mix, every tensor llama.cpp changed: "<mix>/<name>" its bytes (uint8)
  kquant.json          the F32 source's sha256; per mix, each changed tensor's ggml type id, and per prompt
                       llama.cpp's ids, greedy continuation (F32 KV cache) and at every position its argmax,
                       top-2 margin and logit range (scripts/make_coverage_golden.llama_greedy)
tests/models/test_kquant_golden.py rebuilds each file from the F32 conversion and these tensors
(bitserve/testing/kquant_golden.py) and checks bitserve's tokens against llama.cpp's, teacher-forced.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bitserve.loader.catalog import resolve_model  # noqa: E402
from bitserve.loader.gguf_reader import read_gguf  # noqa: E402
from bitserve.testing.kquant_golden import MIXES, f32_source  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "golden"
GGML_TYPE_F32 = 0


def _coverage_script():  # noqa: ANN202 - scripts/make_coverage_golden.py, for its llama_greedy
    spec = importlib.util.spec_from_file_location(
        "make_coverage_golden", ROOT / "scripts" / "make_coverage_golden.py"
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def llama_requantize(source: Path, target: Path, mix: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}")
    params.token_embedding_type = GGML_TYPE_F32  # only the projections change: a small fixture
    params.output_tensor_type = GGML_TYPE_F32
    params.nthread = 2
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize {mix} failed: {status}")


def changed_tensors(source: Path, requantized: Path) -> dict[str, tuple[int, np.ndarray]]:
    """name -> (type id, bytes) of every tensor llama.cpp wrote differently from the source."""
    changed = {}
    with read_gguf(source) as before, read_gguf(requantized) as after:
        for name, info in after.tensors.items():
            data = np.array(after.tensor_data(name))
            old = before.tensors[name]
            if info.type_id != old.type_id or not np.array_equal(data, before.tensor_data(name)):
                changed[name] = (info.type_id, data)
    return changed


def main(out: Path = FIXTURES) -> int:
    out.mkdir(parents=True, exist_ok=True)
    llama_greedy = _coverage_script().llama_greedy
    arrays: dict[str, np.ndarray] = {}
    document: dict = {"mixes": {}}
    with tempfile.TemporaryDirectory() as folder:
        source = f32_source(resolve_model("smollm2-135m-instruct"), Path(folder))
        document["source_sha256"] = hashlib.sha256(source.read_bytes()).hexdigest()
        for mix in MIXES:
            target = Path(folder) / f"{mix}.gguf"
            llama_requantize(source, target, mix)
            changed = changed_tensors(source, target)
            for name, (_, data) in changed.items():
                arrays[f"{mix}/{name}"] = data
            document["mixes"][mix] = {
                "types": {name: type_id for name, (type_id, _) in changed.items()},
                "prompts": llama_greedy(target),
            }
    np.savez_compressed(out / "kquant_tensors.npz", **arrays)
    (out / "kquant.json").write_text(
        json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

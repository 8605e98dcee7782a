"""bitnet.cpp's greedy tokens on a file `bitserve convert` wrote: does bitnet.cpp load and run the I2_S
(`bitnet-b1.58`) GGUF bitserve converts a BitNet checkpoint directory to, as bitserve runs it?

    BITNET_CPP=/tmp/bitnetcpp/BitNet/build/bin python scripts/make_converted_bitnetcpp_golden.py

The checkpoint is random-init, in the 2B-4T release's layout (packed uint8 codes + weight_scale, ReLU²,
F16 tied embedding: bitserve/testing/hf_checkpoints.converted_bitnet_i2s), with SmolLM2's vocabulary as
tokenizer.json, so the tokenizer conversion is run by bitnet.cpp too. Per prompt of
scripts/make_bitnetcpp_golden.PROMPTS, bitnet.cpp's llama-cli (built by shared/peers/build-bitnet-cpp.sh)
gives the prompt ids it tokenized and its greedy continuation; written to
tests/fixtures/bitnetcpp/converted.json with the file's sha256. tests/models/test_converted_bitnetcpp.py
checks bitserve against it offline, and live with BITNET_CPP set.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bitserve.loader.catalog import resolve_model  # noqa: E402
from bitserve.testing.hf_checkpoints import converted_bitnet_i2s  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "bitnetcpp" / "converted.json"
NUM_TOKENS = 16


def bitnetcpp_script() -> ModuleType:
    """scripts/make_bitnetcpp_golden.py (its llama-cli runner and prompts)."""
    name = "make_bitnetcpp_golden"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules[name]


def bitnetcpp_tokens(bin_dir: Path, path: Path) -> list[dict]:
    """Per prompt: the text, llama-cli's prompt ids and its NUM_TOKENS greedy ids."""
    script = bitnetcpp_script()
    out = []
    for text in script.PROMPTS:
        prompt_ids, tokens = script.run_llama_cli(bin_dir, path, text, NUM_TOKENS)
        out.append({"text": text, "prompt_token_ids": prompt_ids, "greedy_token_ids": tokens})
    return out


def make_fixture(bin_dir: Path, folder: Path) -> dict:
    path = converted_bitnet_i2s(resolve_model("smollm2-135m-instruct"), folder)
    return {
        "num_tokens": NUM_TOKENS,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "prompts": bitnetcpp_tokens(bin_dir, path),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bitnet-cpp", default=os.environ.get("BITNET_CPP"), help="bitnet.cpp's bin directory"
    )
    parser.add_argument("--out", type=Path, default=FIXTURE)
    args = parser.parse_args()
    if not args.bitnet_cpp:
        raise SystemExit("give --bitnet-cpp DIR or BITNET_CPP (the directory holding llama-cli)")
    with tempfile.TemporaryDirectory() as folder:
        fixture = make_fixture(Path(args.bitnet_cpp), Path(folder))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1) + "\n", encoding="utf-8")
    sys.stdout.write(f"wrote {args.out}\n")


if __name__ == "__main__":
    main()

"""atheris (libFuzzer) target for the GGUF parser: any bytes must parse, or raise InvalidModelFile, within
libFuzzer's time and memory limits; anything else (another exception, a hang, an allocation past
-rss_limit_mb) is a crash.

    python tests/loader/fuzz_gguf.py --make-corpus CORPUS      # seed files: small valid GGUFs
    python tests/loader/fuzz_gguf.py CORPUS -runs=1000000 -timeout=5 -rss_limit_mb=2048

tests/loader/test_fuzz_gguf.py runs a 10,000-execution smoke of it in CI.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["bitserve"]):
    from bitserve.errors import InvalidModelFile
    from bitserve.loader.gguf_reader import GGUFFile


def parse(data: bytes) -> None:
    """The parser over `data` in an anonymous mapping (no file I/O per input), then every tensor read."""
    if not data:
        return
    mm = mmap.mmap(-1, len(data))
    mm.write(data)
    try:
        gguf = GGUFFile("<fuzz>", mm, len(data), None)
    except InvalidModelFile:
        # a view made while parsing may live on in the traceback: then the mapping is freed with it
        with contextlib.suppress(BufferError):
            mm.close()
        return
    try:
        gguf.architecture()
    except InvalidModelFile:
        pass
    for name in gguf.tensors:
        gguf.tensor_data(name).sum()  # reads every byte the parser said was there
    gguf.close()


def make_corpus(folder: Path) -> None:
    """Small valid files: a llama and a bitnet-shaped one, with and without tensors."""
    import numpy as np

    from bitserve.loader.gguf_types import GGMLType
    from bitserve.loader.gguf_writer import GGUFBuilder

    folder.mkdir(parents=True, exist_ok=True)
    for index, (arch, has_tensors) in enumerate((("llama", True), ("bitnet-b1.58", True), ("llama", False))):
        builder = GGUFBuilder()
        builder.add_architecture(arch)
        builder.add_string("general.name", "fuzz")
        builder.add_uint32(f"{arch}.block_count", 1)
        builder.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
        builder.add_array("tokenizer.ggml.scores", np.zeros(3, np.float32))
        if has_tensors:
            builder.add_tensor(
                "token_embd.weight", (8, 2), int(GGMLType.F32), np.arange(16, dtype=np.float32)
            )
            builder.add_tensor("blk.0.attn_q.weight", (32, 2), int(GGMLType.Q8_0), bytes(range(68)))
        (folder / f"seed-{index}.gguf").write_bytes(builder.to_bytes())


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[1] == "--make-corpus":
        make_corpus(Path(argv[2]))
        return
    # the parser logs format hints (a bad UTF-8 string, a dialect guess): not crashes, and slow per input
    logging.disable(logging.CRITICAL)
    atheris.Setup(argv, parse)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)

"""GPU test fixtures: a small bitnet-b1.58 I2_S file (the CUDA decoder's fused ternary path, GQA),
written with the 2B-4T writer from the tokenizer the session has (the package's or the carried one)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def b158_file(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    from benchmarks.make_2b4t_model import write_2b4t_model
    from bitserve.testing.synthetic import SyntheticConfig

    config = SyntheticConfig(
        num_layers=2,
        hidden_size=256,
        intermediate_size=768,
        num_heads=4,
        num_kv_heads=2,
        architecture="bitnet-b1.58",
    )
    path = tmp_path_factory.mktemp("gpu") / "b158-i2s.gguf"
    return write_2b4t_model(path, "I2_S", tokenizer_source=tokenizer_source, config=config)

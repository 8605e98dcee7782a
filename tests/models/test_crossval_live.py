"""Live llama.cpp comparison (`bitserve crossval` / `pytest -m crossval`): regenerate every golden
fixture with the installed llama-cpp-python and require it to equal the committed one. The regular
golden tests then compare bitserve against those same fixtures, so together they are the live check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from repo_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "golden"


def strip_margins(value: object) -> object:
    """Greedy margins are informative floats; tokens, ids and argmax must be identical."""
    if isinstance(value, dict):
        return {k: strip_margins(v) for k, v in value.items() if k != "greedy_margins"}
    if isinstance(value, list):
        return [strip_margins(v) for v in value]
    return value


@pytest.mark.crossval
def test_live_llamacpp_equals_committed_fixtures(tmp_path: Path, smollm2_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    load_script("make_golden").main(tmp_path)
    for name in ("smollm2.json", "synthetic.json"):
        live = json.loads((tmp_path / name).read_text(encoding="utf-8"))
        committed = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
        assert strip_margins(live) == strip_margins(committed), name
    for name in ("smollm2_logits.npz", "synthetic_last_logits.npz"):
        live, committed = np.load(tmp_path / name), np.load(FIXTURES / name)
        assert sorted(live.files) == sorted(committed.files)
        for key in live.files:
            np.testing.assert_allclose(
                live[key].astype(np.float32),
                committed[key].astype(np.float32),
                atol=2e-2,
                err_msg=f"{name}:{key}",
            )

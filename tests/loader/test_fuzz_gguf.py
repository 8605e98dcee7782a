"""CI smoke of the atheris GGUF-parser fuzz target (tests/loader/fuzz_gguf.py): 10,000 executions from
the seed corpus, no crash, hang or memory blow-up. atheris is a test extra (Linux x86_64 wheels); where
it is missing the smoke skips, except under CI, where the extra installs it."""

from __future__ import annotations

import importlib.util
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ_TARGET = Path(__file__).with_name("fuzz_gguf.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_RUNS = 10_000
RSS_BUDGET_MB = 2048


def rss_limit_mb() -> int:
    """libFuzzer judges peak RSS, which Linux carries across fork + exec: a child of a big pytest process
    starts at the parent's peak. The budget is on top of that."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 + RSS_BUDGET_MB


def test_fuzz_smoke(tmp_path: Path) -> None:
    if importlib.util.find_spec("atheris") is None:
        if os.environ.get("CI"):
            pytest.fail("atheris is missing under CI: the test extra should install it")
        pytest.skip("atheris is not installed (pip install '.[test]' on Linux x86_64)")
    corpus = tmp_path / "corpus"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, str(FUZZ_TARGET), "--make-corpus", str(corpus)], check=True, env=env)
    result = subprocess.run(
        [
            sys.executable,
            str(FUZZ_TARGET),
            str(corpus),
            f"-runs={NUM_RUNS}",
            "-timeout=10",
            f"-rss_limit_mb={rss_limit_mb()}",
            "-seed=1",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    tail = result.stderr[-3000:]
    assert result.returncode == 0, tail
    assert f"Done {NUM_RUNS} runs" in result.stderr, tail
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*")), tail

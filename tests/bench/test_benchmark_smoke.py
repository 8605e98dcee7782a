"""CI smoke run of every benchmark on a tiny synthetic bitnet model: each exits 0 and prints the table
or ratio lines it promises. No timing is asserted. The llama.cpp peer runs only where llama_cpp
imports, and the llama_cpp.server peer only where its server extras import too (a machine may have the
binding, the project's `crossval` extra, without them); the bitserve side always runs."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO_ROOT / "benchmarks"
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
# llama_cpp.server needs its own extras (llama-cpp-python[server]); the binding alone cannot serve.
LLAMA_CPP_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
HAS_LLAMA_CPP_SERVER = all(importlib.util.find_spec(name) is not None for name in LLAMA_CPP_SERVER_MODULES)
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
STARTUP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> dict[str, Path]:
    """One layer, hidden 256, SmolLM2's tokenizer: the same weights as I2_S and as TQ2_0 (arch bitnet)."""
    from bitserve.testing.synthetic import (
        SyntheticConfig,
        make_weights,
        tokenizer_metadata,
        write_synthetic_model,
    )

    config = SyntheticConfig(
        num_layers=1, hidden_size=256, intermediate_size=512, num_heads=2, num_kv_heads=2
    )
    tokenizer = tokenizer_metadata(smollm2_path)
    weights = make_weights(config, len(tokenizer["tokenizer.ggml.tokens"][1]))
    folder = tmp_path_factory.mktemp("bench-smoke")
    return {
        fmt: write_synthetic_model(
            folder / f"tiny-{fmt}.gguf", fmt, config=config, weights=weights, tokenizer=tokenizer
        )
        for fmt in ("I2_S", "TQ2_0")
    }


def run(*argv: str, timeout: float = 120.0) -> str:
    """Run a command from the repository root; assert exit 0; return stdout."""
    done = subprocess.run(argv, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{argv} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    )
    return done.stdout


def test_bench_kernels_prints_a_row_per_backend_shape_and_batch() -> None:
    out = run(
        sys.executable,
        str(BENCHMARKS / "bench_kernels.py"),
        "--shapes",
        "64x256",
        "--tokens",
        "1",
        "9",
        "--repeats",
        "1",
        "--seconds",
        "0",
        "--threads",
        "1",
    )
    assert "vs fp32" in out.splitlines()[1]
    rows = [line for line in out.splitlines()[2:] if "64x256" in line]
    assert len(rows) >= 2 and all(row.split()[6].endswith("x") for row in rows), out


def test_bench_model_prints_the_bitserve_rates_and_the_ratios(tiny_models: dict[str, Path]) -> None:
    argv = [
        sys.executable,
        str(BENCHMARKS / "bench_model.py"),
        "--model-2b",
        str(tiny_models["I2_S"]),
        "--prefill-tokens",
        "8",
        "--decode-prompt-tokens",
        "4",
        "--decode-tokens",
        "3",
        "--repeats",
        "1",
        "--profile-steps",
        "1",
        "--threads",
        "1",
    ]
    if HAS_LLAMA_CPP:
        argv += ["--tq2", "--model-2b-tq2", str(tiny_models["TQ2_0"])]
    else:
        argv += ["--skip-smollm2"]
    out = run(*argv, timeout=180.0)
    assert "decode:" in out and "prefill:" in out and "cProfile of 1 decode steps" in out, out
    if HAS_LLAMA_CPP:
        for title in (
            "SmolLM2-135M-Instruct, SmolLM2-135M-Instruct.Q4_1.gguf",
            "bitserve I2_S (bitnet-b1.58) vs llama.cpp TQ2_0",
            "bitserve TQ2_0 vs llama.cpp TQ2_0",
        ):
            assert title in out, out
        ratio_rows = re.findall(r"^ +decode tok/s +[\d.]+ +[\d.]+ +([\d.]+)$", out, flags=re.MULTILINE)
        assert out.count("ratio b/l") == 3 and len(ratio_rows) == 3, out  # bitserve / llama.cpp per pair


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen[bytes]) -> None:
    """Poll `url` (bitserve's /health/ready, the peer's /v1/models) until it answers 200."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{process.args} exited {process.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url} not ready after {STARTUP_TIMEOUT_S} s")


@pytest.fixture
def servers(tiny_models: dict[str, Path]) -> Iterator[tuple[str, str, str]]:
    """bitserve on the I2_S file and a peer on the TQ2_0 file: llama_cpp.server, else a second bitserve."""
    ports = free_port(), free_port()
    bitserve = [
        sys.executable,
        "-m",
        "bitserve",
        "serve",
        "--model",
        str(tiny_models["I2_S"]),
        "--port",
        str(ports[0]),
        "--num-threads",
        "1",
        "--no-warmup",
        "--log-format",
        "text",
    ]
    if HAS_LLAMA_CPP_SERVER:
        peer = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(tiny_models["TQ2_0"]),
            "--port",
            str(ports[1]),
            "--n_threads",
            "1",
            "--n_ctx",
            "512",
            "--interrupt_requests",
            "False",
        ]
        peer_name, peer_ready = "llama_cpp.server", "/v1/models"
    else:
        peer = [*bitserve[:5], str(tiny_models["TQ2_0"]), "--port", str(ports[1]), *bitserve[8:]]
        peer_name, peer_ready = "bitserve-tq2", "/health/ready"
    processes = [
        subprocess.Popen(argv, cwd=REPO_ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for argv in (bitserve, peer)
    ]
    try:
        urls = tuple(f"http://127.0.0.1:{port}" for port in ports)
        for url, ready, process in zip(urls, ("/health/ready", peer_ready), processes, strict=True):
            wait_ready(url + ready, process)
        yield urls[0], urls[1], peer_name
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_bench_serving_prints_the_side_by_side_ratio_rows(servers: tuple[str, str, str]) -> None:
    url, peer_url, peer_name = servers
    out = run(
        sys.executable,
        str(BENCHMARKS / "bench_serving.py"),
        url,
        peer_url,
        "--names",
        f"bitserve,{peer_name}",
        "--concurrency",
        "2",
        "--num-requests",
        "2",
        "--max-tokens",
        "3",
        "--ignore-eos",
        "--prompt-tokens",
        "4",
        "--num-warmup",
        "0",
        "--endpoint",
        "completions",  # the synthetic models have no chat template
    )
    lines = out.splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith(f"bitserve vs {peer_name}"))
    assert lines[header + 1].split()[:4] == ["conc", "tok/s", "bitserve", "tok/s"], out
    row = lines[header + 2].split()
    assert row[0] == "2" and float(row[3]) > 0, out  # the throughput ratio
    assert row[-2] == "0/0", out  # no errors on either side


def test_bench_curve_prints_the_table_and_the_picked_limits(tiny_models: dict[str, Path]) -> None:
    out = run(
        sys.executable,
        "-m",
        "bitserve",
        "bench",
        "--curve",
        str(tiny_models["I2_S"]),
        "--concurrency",
        "1,2",
        "--max-tokens",
        "3",
        "--curve-prefill-tokens",
        "8",
        "--threads",
        "1",
    )
    lines = out.splitlines()
    assert "(projections I2_S)" in lines[0], out
    assert lines[1].split() == ["concurrency", "tok/s", "ms/step", "ratio", "to", "c=1", "decode", "steps"], (
        out
    )
    assert lines[2].split()[0] == "1" and lines[2].split()[3] == "1.00", out
    assert lines[3].split()[0] == "2" and int(lines[3].split()[4]) == 2, out  # 3 tokens: 2 decode steps
    assert lines[-1].startswith("picked: max_num_seqs "), out


def test_bench_serve_rss_prints_the_server_memory_lines(tiny_models: dict[str, Path]) -> None:
    out = run(
        sys.executable,
        str(BENCHMARKS / "bench_serve_rss.py"),
        str(tiny_models["I2_S"]),
        "--concurrency",
        "2",
        "--max-tokens",
        "3",
        "--prompt-tokens",
        "4",
        "--threads",
        "1",
        "--server-arg=--max-dense-weight-bytes=0",
    )
    peak = next(
        line for line in out.splitlines() if line.startswith("server RSS peak while streaming 2 x 3 tokens")
    )
    assert float(peak.split(": ")[1].split(" MB")[0].replace(",", "")) > 0, out
    assert "requests ok 2 / 2" in out, out
    assert "server RSS after the last of 2 requests: " in out, out


def test_bench_load_prints_the_ready_time_and_a_file_backed_mapping(tiny_models: dict[str, Path]) -> None:
    argv = [str(BENCHMARKS / "bench_load.py"), str(tiny_models["I2_S"]), "--runs", "1", "--backend", "cpu"]
    out = run(sys.executable, *argv)
    line = next(line for line in out.splitlines() if line.strip().startswith("this tree"))
    assert re.search(r"ready +[\d.]+ s wall / +[\d.]+ s CPU", line), out
    assert re.search(r"GGUF mapping \d+ MB resident / 0 MB anon", line), out  # read in place: no copy


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy is not installed (the test extra has it)")
def test_profile_decode_step_prints_the_kernel_and_python_split(tiny_models: dict[str, Path]) -> None:
    out = run(
        sys.executable,
        str(BENCHMARKS / "profile_decode_step.py"),
        "--model",
        str(tiny_models["I2_S"]),
        "--threads",
        "1",
        "--seconds",
        "0.5",
        "--rate",
        "50",
    )
    assert re.search(r"unprofiled: \d+ decode steps, [\d.]+ ms/step", out), out
    shares = {
        match[1]: float(match[2])
        for match in re.finditer(r"^  (\S.*?)\s+([\d.]+)%  .*unprofiled step$", out, re.M)
    }
    assert set(shares) == {"kernels", "numba dispatch", "Python", "other native"}, out
    assert abs(sum(shares.values()) - 100.0) < 0.5, out


def test_bench_batch_decode_prints_the_rate_and_the_step_split(tiny_models: dict[str, Path]) -> None:
    out = run(
        sys.executable,
        str(BENCHMARKS / "bench_batch_decode.py"),
        *("--model", str(tiny_models["I2_S"]), "--sequences", "3", "--max-tokens", "4"),
        *("--repeats", "1", "--threads", "1", "--split"),
    )
    assert re.search(r"run 0: 3 sequences, 12 tokens in [\d.]+ s: [\d.]+ tok/s \(load", out), out
    assert "per decode step (CPU, 1 thread; 3 steps)" in out, out
    assert re.search(r"Engine\.step +[\d.]+ ms / decode step", out), out

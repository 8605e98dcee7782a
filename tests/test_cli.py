"""The `bitserve` CLI: generate --json, inspect, verify (exit codes and output shapes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bitserve.cli.main import main
from bitserve.errors import InvalidModelFile


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().out


def test_generate_json_on_synthetic_model(capsys, synthetic_models: dict[str, Path]) -> None:  # noqa: ANN001
    code, out = run_cli(
        capsys,
        "generate",
        "--model",
        str(synthetic_models["I2_S"]),
        "--prompt",
        "Hello",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--json",
        "--backend",
        "reference",
    )
    assert code == 0
    result = json.loads(out)
    assert len(result["token_ids"]) == 5
    assert result["prompt_token_ids"] and isinstance(result["text"], str)
    assert result["finish_reason"] == "length"


def test_generate_chat_needs_a_template(capsys, synthetic_models: dict[str, Path]) -> None:  # noqa: ANN001
    code = main(
        [
            "generate",
            "--model",
            str(synthetic_models["F32"]),
            "--prompt",
            "Hi",
            "--chat",
            "--backend",
            "reference",
        ]
    )
    assert code == 2
    assert "chat template" in capsys.readouterr().err


def test_inspect_json_smollm2(capsys, smollm2_path: Path) -> None:  # noqa: ANN001
    code, out = run_cli(capsys, "inspect", str(smollm2_path), "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["architecture"] == "llama"
    assert summary["tensor_types"]["Q4_1"]["count"] == 210
    assert summary["tensor_types"]["Q8_0"]["count"] == 1
    assert summary["tokenizer"]["vocab_size"] == 49152
    assert summary["hyperparameters"]["num_layers"] == 30
    # the scale in effect, not the spec's "unset" 0 (SmolLM2-135M: head_dim 64)
    assert summary["hyperparameters"]["attention_scale"] == 0.125
    assert summary["dialect"] == "upstream"
    kernels = summary["cpu_kernels"]  # this machine's choice, as the cpu backend makes it
    assert kernels["isa"] == kernels["supported_isas"][0] and kernels["supported_isas"][-1] == "generic"
    assert kernels["block_activations"] == ("f32" if kernels["isa"] == "generic" else "q8")
    kv = summary["kv_cache"]  # the pool `bitserve serve` would size at default settings (issue 10)
    assert kv["bytes_per_token"] == 30 * 2 * 3 * 64 * 4 and kv["dtype"] == "float32"
    assert kv["num_tokens"] >= kv["max_model_len"] == 4096 and kv["max_num_seqs"] == 128


def test_inspect_text_names_the_dialect(capsys, synthetic_models: dict[str, Path]) -> None:  # noqa: ANN001
    code, out = run_cli(capsys, "inspect", str(synthetic_models["TL2"]))
    assert code == 0
    assert "bitnet.cpp dialect" in out and "TL2" in out
    assert "kv cache      default " in out and "tokens" in out


def test_inspect_builds_the_spec_once_and_reports_its_problem(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, synthetic_models: dict[str, Path]
) -> None:
    from bitserve.loader import inspect as loader_inspect

    builds: list[str] = []
    build = loader_inspect.spec_from_metadata

    def counted(*args: Any, **kwargs: Any) -> Any:
        builds.append(kwargs["path"])
        return build(*args, **kwargs)

    monkeypatch.setattr(loader_inspect, "spec_from_metadata", counted)
    code, out = run_cli(capsys, "inspect", str(synthetic_models["TL2"]), "--json")
    assert code == 0 and len(builds) == 1 and json.loads(out)["kv_cache"]["num_tokens"] > 0

    def unsupported(*args: Any, **kwargs: Any) -> Any:
        raise InvalidModelFile("unsupported architecture 'mamba'")

    monkeypatch.setattr(loader_inspect, "spec_from_metadata", unsupported)
    code, out = run_cli(capsys, "inspect", str(synthetic_models["TL2"]), "--json")
    summary = json.loads(out)
    assert code == 0 and "mamba" in summary["hyperparameters"]["error"]
    assert summary["kv_cache"] == summary["hyperparameters"]


def test_verify_passes_on_a_good_file(capsys, synthetic_models: dict[str, Path]) -> None:  # noqa: ANN001
    code, out = run_cli(capsys, "verify", str(synthetic_models["TQ2_0"]), "--json", "--num-tokens", "4")
    report = json.loads(out)
    assert code == 0, report
    assert report["ok"] and {c["check"] for c in report["checks"]} >= {
        "structure",
        "kernels",
        "generate",
        "logits",
    }


def test_verify_fails_on_a_truncated_file(capsys, tmp_path: Path, synthetic_models: dict[str, Path]) -> None:  # noqa: ANN001
    data = synthetic_models["I2_S"].read_bytes()
    broken = tmp_path / "truncated.gguf"
    broken.write_bytes(data[: len(data) // 2])
    code, out = run_cli(capsys, "verify", str(broken), "--json")
    assert code == 1
    report = json.loads(out)
    assert not report["ok"]
    assert (
        report["checks"][0]["check"] == "load"
        and "past the end of the data section" in report["checks"][0]["detail"]
    )


def test_unknown_model_name_is_a_clear_error(capsys) -> None:  # noqa: ANN001
    assert main(["inspect", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "smollm2-135m-instruct" in err


def test_console_script_is_installed() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bitserve", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and "generate" in result.stdout


def test_crossval_passes_pytest_options_through(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[str], dict[str, str] | None]] = []
    monkeypatch.setattr(subprocess, "call", lambda command, env=None: calls.append((command, env)) or 0)
    assert main(["crossval", "-q", "-k", "smollm2"]) == 0
    command, env = calls[0]
    assert command[-3:] == ["-q", "-k", "smollm2"] and "crossval" in command and env is None


def test_crossval_bitnet_cpp_runs_its_own_tests_with_the_binary_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[list[str], dict[str, str] | None]] = []
    monkeypatch.setattr(subprocess, "call", lambda command, env=None: calls.append((command, env)) or 0)
    assert main(["crossval", "--bitnet-cpp", str(tmp_path)]) == 0
    command, env = calls[0]
    assert env is not None and env["BITNET_CPP"] == str(tmp_path)
    assert any(part.endswith("test_bitnetcpp_crossval.py") for part in command)


def test_unknown_options_are_rejected_outside_crossval() -> None:
    with pytest.raises(SystemExit) as info:
        main(["inspect", "x.gguf", "--bogus"])
    assert info.value.code == 2


def test_inspect_names_the_kernel_of_each_tensor_type(capsys, synthetic_models: dict[str, Path]) -> None:  # noqa: ANN001
    """`bitserve inspect` says which cpu kernel runs a projection of each type in the file on this machine:
    a Q2_0 file (llama.cpp's 2-bit type) names the block tile or, where numba's int8 variants are
    unavailable, the f32 fallback; every type the file holds gets a name."""
    pytest.importorskip("numba")
    code, out = run_cli(capsys, "inspect", str(synthetic_models["Q2_0"]), "--json")
    kernels = json.loads(out)["cpu_kernels"]
    assert code == 0 and set(kernels["projection_kernels"]) == {"F32", "Q2_0"}
    expected = "block tile" if kernels["isa"] != "generic" else "dequantized to f32"
    assert expected in kernels["projection_kernels"]["Q2_0"]
    code, text = run_cli(capsys, "inspect", str(synthetic_models["Q2_0"]))
    assert code == 0 and kernels["projection_kernels"]["Q2_0"] in text


def test_generate_speculative_gives_the_plain_tokens(capsys, synthetic_models: dict[str, Path]) -> None:  # noqa: ANN001
    base = ["generate", "--model", str(synthetic_models["I2_S"]), "--prompt", "a b a b a b a b", "--json"]
    base += ["--max-tokens", "12", "--ignore-eos", "--temperature", "0", "--backend", "reference"]
    outputs = []
    for extra in ([], ["--speculative", "ngram", "--num-speculative-tokens", "3"]):
        code, out = run_cli(capsys, *base, *extra)
        assert code == 0
        outputs.append(json.loads(out)["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12
    code = main([*base, "--speculative", "ngram", "--num-speculative-tokens", "0"])
    assert code == 2 and "num_speculative_tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--speculative", "eagle"])


def test_serve_takes_the_speculative_settings() -> None:
    from bitserve.server.settings import build_configs, setting_fields

    assert {"speculative", "num_speculative_tokens"} <= set(setting_fields())
    engine, _ = build_configs({"speculative": "ngram", "num_speculative_tokens": 6})
    assert (engine.scheduler.speculative, engine.scheduler.num_speculative_tokens) == ("ngram", 6)

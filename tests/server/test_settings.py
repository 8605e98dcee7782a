"""Settings precedence (CLI > BITSERVE_* env > TOML profile > TOML top level > default), profiles,
and the `bitserve serve` flags generated from the config dataclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

from bitserve.cli.main import build_parser
from bitserve.cli.serve import cli_values
from bitserve.config import ServerConfig
from bitserve.errors import InvalidRequest
from bitserve.server.settings import load_settings

TOML = """
port = 9000
max_num_seqs = 64
log_format = "text"

[prod]
host = "0.0.0.0"
port = 9100
drain_timeout_s = 45.5
enable_prefix_caching = false
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "bitserve.toml"
    path.write_text(TOML)
    return path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.upper().startswith("BITSERVE_"):
            monkeypatch.delenv(name)


def test_defaults_come_from_the_dataclasses() -> None:
    settings = load_settings({})
    assert settings.server == ServerConfig()
    assert settings.sources == {}


def test_precedence_cli_over_env_over_toml(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITSERVE_PORT", "9200")
    monkeypatch.setenv("BITSERVE_MAX_NUM_WAITING", "17")
    settings = load_settings({"port": 9300, "host": None}, config_path=str(config_file), profile="prod")
    server, engine = settings.server, settings.engine
    assert server.port == 9300  # CLI
    assert server.max_num_waiting == 17  # env
    assert (server.host, server.drain_timeout_s) == ("0.0.0.0", 45.5)  # the [prod] table
    assert server.log_format == "text" and engine.scheduler.max_num_seqs == 64  # TOML top level
    assert engine.cache.enable_prefix_caching is False
    assert engine.cache.block_size == 16  # default
    assert settings.sources["port"] == "cli" and settings.sources["max_num_waiting"] == "env"
    assert settings.sources["host"] == "toml"


def test_profile_and_config_from_env(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITSERVE_CONFIG", str(config_file))
    monkeypatch.setenv("BITSERVE_PROFILE", "prod")
    assert load_settings({}).server.port == 9100
    monkeypatch.delenv("BITSERVE_PROFILE")
    assert load_settings({}).server.port == 9000  # top level only


def test_max_model_len_has_one_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BITSERVE_MAX_MODEL_LEN", "8192")
    engine = load_settings({}).engine
    assert engine.scheduler.max_model_len == 8192 and not hasattr(engine.model, "max_model_len")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ({"env": {"BITSERVE_PORT": "eighty"}}, "BITSERVE_PORT: Input should be a valid integer"),
        ({"env": {"BITSERVE_PORT": "70000"}}, "port must be in"),
        ({"toml": 'port = "9000"\n'}, "bad.toml port: Input should be a valid integer"),
        ({"toml": "colour = 3\n"}, "bad.toml colour: Extra inputs are not permitted"),
        ({"toml": "port = 1\n", "profile": "staging"}, "no [staging] table"),
        ({"toml": "port = \n"}, "not valid TOML"),
        ({"profile": "prod"}, "needs a config file"),
        ({"env": {"BITSERVE_PROFILE": "qa"}}, "unknown profile"),
    ],
)
def test_bad_settings_are_clear_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: dict, message: str
) -> None:
    for name, value in setup.get("env", {}).items():
        monkeypatch.setenv(name, value)
    config_path = None
    if "toml" in setup:
        config_path = tmp_path / "bad.toml"
        config_path.write_text(setup["toml"])
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[")):
        load_settings({}, config_path=str(config_path) if config_path else None, profile=setup.get("profile"))


def test_serve_flags_are_generated_from_the_fields(config_file: Path) -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9400",
            "--max-num-seqs",
            "8",
            "--no-enable-prefix-caching",
            "--threads",
            "2",
            "--drain-timeout-s",
            "1.5",
            "--config",
            str(config_file),
            "--profile",
            "prod",
        ]
    )
    values = cli_values(args)
    assert values["port"] == 9400 and values["num_threads"] == 2 and values["enable_prefix_caching"] is False
    assert values["host"] is None  # not given: lower layers decide
    settings = load_settings(values, config_path=args.config, profile=args.profile)
    assert (settings.server.port, settings.server.host, settings.server.drain_timeout_s) == (
        9400,
        "0.0.0.0",
        1.5,
    )
    assert settings.engine.scheduler.max_num_seqs == 8 and settings.engine.model.num_threads == 2


def test_model_roots_from_repeated_flags_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import os

    from bitserve.server.app import build_state

    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    args = build_parser().parse_args(["serve", "--model-root", str(first), "--model-root", str(second)])
    assert load_settings(cli_values(args)).server.model_roots == f"{first}{os.pathsep}{second}"
    monkeypatch.setenv("BITSERVE_MODEL_ROOTS", f"{second}{os.pathsep}{first}")
    settings = load_settings({})
    assert build_state(settings.server, settings.engine).models.files.roots == [second, first]
    with pytest.raises(InvalidRequest, match="is not a folder"):
        build_state(ServerConfig(model_roots=str(tmp_path / "missing")), settings.engine)

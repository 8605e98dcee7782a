"""Model roots: names and sidecars resolve; every path trick that leaves a root is refused."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from bitserve.errors import Forbidden, InvalidModelFile, ModelNotFound
from bitserve.lifecycle.model_files import ModelFiles


@pytest.fixture()
def layout(tmp_path: Path) -> dict[str, Path]:
    root = tmp_path / "models"
    (root / "team").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "tiny.gguf").write_bytes(b"GGUF-tiny")
    (root / "team" / "other.gguf").write_bytes(b"GGUF-other")
    (outside / "secret.gguf").write_bytes(b"GGUF-secret")
    digest = hashlib.sha256(b"GGUF-tiny").hexdigest()
    (root / "tiny.gguf.json").write_text(
        json.dumps({"alias": "tiny-v1", "sha256": digest, "default_params": {"temperature": 0.2}})
    )
    os.symlink(outside / "secret.gguf", root / "escape.gguf")
    os.symlink(outside, root / "linked-dir")
    return {"root": root, "outside": outside}


def test_names_and_sidecars_resolve(layout: dict[str, Path]) -> None:
    registry = ModelFiles([layout["root"]])
    model = registry.resolve("tiny-v1")
    assert model.path == (layout["root"] / "tiny.gguf").resolve()
    assert model.default_params == {"temperature": 0.2} and len(model.version) == 12
    registry.verify_sha256(model)
    assert registry.resolve("other").path.name == "other.gguf"
    assert "escape" not in registry.names and "secret" not in registry.names
    assert "smollm2-135m-instruct" in registry.names


def test_paths_inside_a_root_resolve(layout: dict[str, Path]) -> None:
    registry = ModelFiles([layout["root"]])
    assert registry.resolve("team/other.gguf").name == "other"
    assert registry.resolve(str(layout["root"] / "tiny.gguf")).name == "tiny-v1"
    assert registry.resolve("team/../tiny.gguf").name == "tiny-v1"  # stays inside: allowed


@pytest.mark.parametrize(
    "reference",
    [
        "../outside/secret.gguf",
        "team/../../outside/secret.gguf",
        "escape.gguf",  # symlink to a file outside
        "linked-dir/secret.gguf",  # symlinked folder outside
        "%2e%2e/outside/secret.gguf",
        "%252e%252e%252foutside%252fsecret.gguf",  # double-encoded
        "..%2Foutside%2Fsecret.gguf",
        "/etc/passwd",
    ],
)
def test_path_tricks_are_refused(layout: dict[str, Path], reference: str) -> None:
    registry = ModelFiles([layout["root"]])
    with pytest.raises(Forbidden):
        registry.resolve(reference)


def test_absolute_path_outside_is_refused(layout: dict[str, Path]) -> None:
    with pytest.raises(Forbidden):
        ModelFiles([layout["root"]]).resolve(str(layout["outside"] / "secret.gguf"))


def test_unknown_names_and_bad_sidecars(layout: dict[str, Path]) -> None:
    registry = ModelFiles([layout["root"]])
    with pytest.raises(ModelNotFound, match="tiny-v1"):
        registry.resolve("missing.gguf")
    (layout["root"] / "tiny.gguf").write_bytes(b"changed")
    with pytest.raises(InvalidModelFile, match="sha256"):
        registry.verify_sha256(registry.resolve("tiny-v1"))
    assert "other" in registry.names
    (layout["root"] / "team" / "other.gguf.json").write_text("[1, 2]")
    registry.refresh()  # one bad sidecar skips its model (logged); the rest stay loadable
    assert "other" not in registry.names and "tiny-v1" in registry.names


@pytest.mark.parametrize(
    ("sidecar", "reason"),
    [
        ({"sha256": "abc"}, "64 hex digits"),
        ({"default_params": [1]}, "default_params"),
        ({"golden": [{"prompt": "hi", "expected_token_ids": []}]}, "expected_token_ids"),
        ({"golden": [{"prompt": 5, "expected_token_ids": [1]}]}, "golden prompt"),
        ({"golden": [{"prompt": "hi", "expected_token_ids": [1]}] * 17}, "at most 16"),
    ],
)
def test_bad_sidecar_fields_are_refused(
    layout: dict[str, Path], sidecar: dict, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    (layout["root"] / "team" / "other.gguf.json").write_text(json.dumps(sidecar))
    registry = ModelFiles([layout["root"]])
    assert "other" not in registry.names
    assert reason in caplog.text


def test_golden_and_defaults_from_the_sidecar(layout: dict[str, Path]) -> None:
    golden = [{"prompt": "hi", "expected_token_ids": [1, 2]}, {"prompt": [3, 4], "expected_token_ids": [5]}]
    (layout["root"] / "team" / "other.gguf.json").write_text(
        json.dumps({"golden": golden, "default_params": {"top_k": 3}})
    )
    model = ModelFiles([layout["root"]]).resolve("other")
    assert [(g.prompt, g.expected_token_ids) for g in model.golden] == [("hi", (1, 2)), ((3, 4), (5,))]
    assert model.default_params == {"top_k": 3}

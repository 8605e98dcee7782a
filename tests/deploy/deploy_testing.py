"""Helpers for the deploy tests: the repository's deploy/ paths, external tools (a missing tool skips a
test, except under CI, where .ci/run must have installed it), and a small Dockerfile reader."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
OVERLAYS = ("dev", "staging", "prod", "gpu")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def require_tool(name: str, why: str, env_var: str | None = None) -> str:
    """The path of executable `name` (or of $env_var when set); skip without it, fail under CI (.ci/run
    installs it)."""
    path = os.environ.get(env_var) if env_var else None
    path = path or shutil.which(name)
    if path is None:
        message = f"{name} is not installed ({why})"
        if os.environ.get("CI"):
            pytest.fail(f"{message} under CI: .ci/run should have installed it")
        pytest.skip(message)
    return path


def run_tool(*command: str, timeout_s: float = 120.0, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)


def render_overlay(overlay: str) -> str:
    """`kubectl kustomize` of one overlay (kubectl embeds kustomize v5)."""
    kubectl = require_tool("kubectl", "renders the Kustomize overlays")
    result = run_tool(kubectl, "kustomize", str(DEPLOY / "kubernetes" / "overlays" / overlay))
    assert result.returncode == 0, result.stderr
    return result.stdout


@dataclass
class Stage:
    """One FROM ... AS name stage of a Dockerfile: its instructions as (keyword, argument text)."""

    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args_of(self, keyword: str) -> list[str]:
        return [text for key, text in self.instructions if key == keyword]

    def env(self) -> dict[str, str]:
        """The stage's ENV values (KEY=VALUE form; $PATH-style references are left as written)."""
        values: dict[str, str] = {}
        for text in self.args_of("ENV"):
            for token in shlex.split(text):
                key, _, value = token.partition("=")
                values[key] = value
        return values

    def exec_form(self, keyword: str) -> list[str]:
        """The JSON (exec) form of the stage's last `keyword` instruction (CMD, ENTRYPOINT)."""
        text = self.args_of(keyword)[-1]
        if keyword == "HEALTHCHECK":
            text = text[text.index("CMD") + len("CMD") :]
        return json.loads(text)


def read_dockerfile(path: Path) -> list[Stage]:
    """The stages of `path`: continuation lines joined, comments dropped, FROM's global ARGs at their
    defaults."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[Stage] = []
    global_args: dict[str, str] = {}  # ARG NAME=default lines before the first FROM (FROM may use them)
    for line in logical:
        keyword, _, text = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and not stages:
            name, _, default = text.strip().partition("=")
            global_args[name] = default
        elif keyword == "FROM":
            for name, default in global_args.items():
                text = text.replace("${" + name + "}", default)
            words = text.split()
            stages.append(Stage(name=words[-1] if "AS" in (w.upper() for w in words) else "", base=words[0]))
        elif stages:
            stages[-1].instructions.append((keyword, " ".join(text.split())))
    return stages

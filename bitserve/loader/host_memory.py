"""How much host memory a load may still take: the kernel's MemAvailable, and the cgroup's limit less its
current usage where a container limit is set (the smaller). Plain file reads."""

from __future__ import annotations

from pathlib import Path

from bitserve.metrics.memory_limit import read_memory_limit_bytes

MEMINFO = Path("/proc/meminfo")
CGROUP_MEMORY_CURRENT = Path("/sys/fs/cgroup/memory.current")


def _mem_available(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    return None


def _cgroup_headroom(current: Path) -> int | None:
    limit = read_memory_limit_bytes()
    if limit is None:
        return None
    try:
        return max(0, limit - int(current.read_text().strip()))
    except (OSError, ValueError):
        return None


def available_host_memory_bytes(meminfo: Path = MEMINFO, current: Path = CGROUP_MEMORY_CURRENT) -> int | None:
    """Bytes a load may still allocate on the host, or None when neither source is readable."""
    known = [value for value in (_mem_available(meminfo), _cgroup_headroom(current)) if value is not None]
    return min(known) if known else None

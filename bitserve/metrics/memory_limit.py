"""The container's memory limit as the cgroup reports it (v2, then v1): read on each scrape by the
Prometheus sink's MemoryLimitCollector (metrics/prometheus.py). Plain file reads, no prometheus_client.
"""

from __future__ import annotations

from pathlib import Path

# Where the container's memory limit is readable: cgroup v2, then v1 (which reports "no limit" as a huge
# number: anything past 2**60 is taken as none).
CGROUP_MEMORY_LIMIT_FILES = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)
NO_CGROUP_LIMIT = 2**60


def read_memory_limit_bytes(files: tuple[Path, ...] = CGROUP_MEMORY_LIMIT_FILES) -> int | None:
    """The cgroup memory limit of this process (the pod's limit), or None when unlimited or unreadable."""
    for path in files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max" or not text.isdigit():
            return None
        value = int(text)
        return value if value < NO_CGROUP_LIMIT else None
    return None

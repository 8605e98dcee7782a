"""Energy counters where the hardware reports them: RAPL package domains on CPU
(/sys/class/powercap/intel-rapl:N/energy_uj, also AMD's), NVML's total energy on NVIDIA GPUs. Exported
as bitserve_energy_joules_total{device} (joules since the server started), read on each scrape; beside
bitserve_generation_tokens_total it gives joules per token. Where nothing is readable (a VM, RAPL root-only
since the PLATYPUS fix, no NVML) the family has no samples and `status()` says why (/health shows it).
Imported only by metrics/prometheus.py; imports no torch (pynvml, optional, only when present)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

POWERCAP_ROOT = Path("/sys/class/powercap")
RAPL_PREFIX = "intel-rapl:"  # package domains are intel-rapl:N; their subzones intel-rapl:N:M are inside them
CPU_DEVICE = "cpu"  # the replica device label the CPU's packages are counted under
MICRO = 1e-6
MILLI = 1e-3


@dataclass(slots=True)
class WrappingCounter:
    """A hardware energy counter that wraps at `max_range`: accumulated into joules since the first read."""

    last: int
    max_range: int
    joules: float = 0.0

    def advance(self, current: int, unit_j: float) -> None:
        delta = current - self.last if current >= self.last else current + self.max_range - self.last
        self.joules += delta * unit_j
        self.last = current


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


class RaplEnergy:
    """The RAPL package domains under `root` (summed: one `cpu` device)."""

    def __init__(self, root: Path = POWERCAP_ROOT) -> None:
        self.counters: dict[Path, WrappingCounter] = {}
        self.status = self._open(root)

    def _open(self, root: Path) -> str:
        domains = sorted(path for path in root.glob(f"{RAPL_PREFIX}*") if path.name.count(":") == 1)
        if not domains:
            return f"no RAPL domains under {root} (not exposed on this machine or VM)"
        for domain in domains:
            try:
                current = _read_int(domain / "energy_uj")
                max_range = _read_int(domain / "max_energy_range_uj")
            except PermissionError:
                return f"{domain / 'energy_uj'} is not readable by this user (root-only on recent kernels)"
            except (OSError, ValueError) as exc:
                return f"{domain / 'energy_uj'} could not be read: {exc}"
            self.counters[domain] = WrappingCounter(current, max_range)
        return f"ok: {len(domains)} RAPL package domain(s)"

    def read(self) -> dict[str, float]:
        """{"cpu": joules since start}, or {} when unreadable."""
        if not self.counters:
            return {}
        for domain, counter in self.counters.items():
            try:
                counter.advance(_read_int(domain / "energy_uj"), MICRO)
            except (OSError, ValueError) as exc:
                logger.warning("RAPL read failed (%s): %s", domain, exc)
        return {CPU_DEVICE: sum(counter.joules for counter in self.counters.values())}


class NvmlEnergy:
    """NVML's per-GPU total energy (millijoules since the driver loaded), as device `cuda:<NVML index>`.
    NOTE: NVML numbers GPUs by PCI bus; set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA's indices agree."""

    def __init__(self) -> None:
        self.nvml: Any = None
        self.counters: dict[int, WrappingCounter] = {}
        self.status = self._open()

    def _open(self) -> str:
        try:
            import pynvml  # optional: pip install 'bitserve[nvml]'
        except ImportError:
            return "pynvml is not installed (pip install 'bitserve[nvml]')"
        try:
            pynvml.nvmlInit()
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                start = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                self.counters[index] = WrappingCounter(start, 2**64)
        except pynvml.NVMLError as exc:
            self.counters.clear()
            return f"NVML energy is not available: {exc}"
        self.nvml = pynvml
        return f"ok: {len(self.counters)} GPU(s)" if self.counters else "no NVIDIA GPU"

    def read(self) -> dict[str, float]:
        joules = {}
        for index, counter in self.counters.items():
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                counter.advance(self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle), MILLI)
            except self.nvml.NVMLError as exc:
                logger.warning("NVML energy read failed (GPU %d): %s", index, exc)
            joules[f"cuda:{index}"] = counter.joules
        return joules


class EnergyCollector(Collector):
    """bitserve_energy_joules_total{device}: one sample per device whose energy is readable."""

    def __init__(self, powercap_root: Path = POWERCAP_ROOT, *, use_nvml: bool = True) -> None:
        self._lock = threading.Lock()  # a scrape and /health may read at once
        self.sources: dict[str, RaplEnergy | NvmlEnergy] = {"cpu": RaplEnergy(powercap_root)}
        if use_nvml:
            self.sources["gpu"] = NvmlEnergy()
        for name, source in self.sources.items():
            logger.info("energy metrics, %s: %s", name, source.status)

    def status(self) -> dict[str, str]:
        """Per source, "ok: ..." or why its energy is not exported."""
        return {name: source.status for name, source in self.sources.items()}

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "bitserve_energy_joules",
            "Energy used by each device since the server started (RAPL on CPU, NVML on GPU), where readable.",
            labels=["device"],
        )
        with self._lock:
            for source in self.sources.values():
                for device, joules in source.read().items():
                    family.add_metric([device], joules)
        yield family

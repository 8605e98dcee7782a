"""Where a model runs: the `auto | cpu | cuda | cuda:N` vocabulary, device discovery behind an injectable
probe, and the resolution of a request (`auto` included) to concrete devices before an EngineConfig is
built. `ModelInstance.load` only ever sees a resolved `ModelConfig.device`: "cpu" or "cuda:N".

Torch is imported inside TorchDeviceProbe's methods only: parsing stays cheap for the CLI and settings,
and a CPU-only request never touches torch.cuda.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bitserve.config import EngineConfig, kv_cache_budget_estimate
from bitserve.errors import InvalidModelFile, InvalidRequest
from bitserve.loader.catalog import resolve_model
from bitserve.loader.checkpoint_file import open_model_file
from bitserve.loader.cuda_footprint import cuda_weight_bytes

logger = logging.getLogger(__name__)

AUTO = "auto"
CPU = "cpu"
CUDA = "cuda"
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
MAX_NUM_REPLICAS = 8  # replicas of one model version; more is a configuration mistake, not a fleet
MAX_DEVICE_CHARS = 32
# `auto` takes a GPU only when the estimate (file bytes + KV cache budget) fits this share of its free
# memory: the estimate leaves out the CUDA context, activations, CUDA-graph pools and the allocator's
# fragmentation, which together take a few hundred MB to a few GB on a large model.
AUTO_FREE_MEMORY_FRACTION = 0.9
# Backends that run only on the host: `auto` resolves to the CPU for them.
HOST_ONLY_BACKENDS = ("cpu",)
_DEVICE_PATTERN = re.compile(r"(auto|cpu|cuda)(?::(\d{1,3}))?")


class DeviceProbe(Protocol):
    """What device discovery needs to know. TorchDeviceProbe asks torch.cuda; tests pass a fake."""

    def cuda_device_count(self) -> int:
        """GPUs this process can use (0 without CUDA). Cheap: creates no CUDA context."""
        ...

    def cuda_free_bytes(self, index: int) -> int:
        """Free memory of GPU `index` now, in bytes."""
        ...


class TorchDeviceProbe:
    """torch.cuda's view: is_available / device_count, and mem_get_info for free memory."""

    def cuda_device_count(self) -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def cuda_free_bytes(self, index: int) -> int:
        import torch

        # NOTE: creates a CUDA context on GPU `index` (a few hundred MB) if none exists yet; asked only
        # when a request names a GPU or `auto`, never on the CPU-only path.
        free, _ = torch.cuda.mem_get_info(index)
        return int(free)


@dataclass(frozen=True, slots=True)
class Placement:
    """One resolved device and why it was chosen (logged, and shown by the admin operation)."""

    device: str  # "cpu" or "cuda:N"
    reason: str


def parse_device(text: str, *, param: str = "device") -> str:
    """The canonical spelling of one device ("CUDA:0 " -> "cuda:0"); InvalidRequest names the bad value
    and the choices. Says nothing about whether the device exists (see `resolve_devices`)."""
    value = text.strip().lower()
    match = _DEVICE_PATTERN.fullmatch(value) if len(value) <= MAX_DEVICE_CHARS else None
    if match is None or (match.group(2) is not None and match.group(1) != CUDA):
        raise InvalidRequest(
            f"{param} {text[:MAX_DEVICE_CHARS]!r} is not a device", param=param, hint=f"use {DEVICE_CHOICES}"
        )
    if match.group(2) is not None:
        return f"{CUDA}:{int(match.group(2))}"  # "cuda:007" -> "cuda:7"
    return value


def parse_devices(value: str | Sequence[str], *, param: str = "device") -> tuple[str, ...]:
    """A device request: one device, a comma-separated list ("cuda:0,cpu") or a list, one replica per
    entry. `auto` stands alone; no device twice; at most MAX_NUM_REPLICAS."""
    entries = value.split(",") if isinstance(value, str) else list(value)
    devices = tuple(parse_device(entry, param=param) for entry in entries)
    if not devices:
        raise InvalidRequest(f"{param} is empty", param=param, hint=f"use {DEVICE_CHOICES}")
    if len(devices) > MAX_NUM_REPLICAS:
        raise InvalidRequest(
            f"{param} lists {len(devices)} devices; at most {MAX_NUM_REPLICAS} replicas", param=param
        )
    if AUTO in devices and len(devices) > 1:
        raise InvalidRequest(
            f"{param}: auto picks one device and cannot be combined with others",
            param=param,
            hint="list concrete devices (cpu, cuda:N) for replicas",
        )
    repeated = sorted({device for device in devices if devices.count(device) > 1})
    if repeated:
        raise InvalidRequest(
            f"{param} lists {', '.join(repeated)} more than once", param=param, hint="one replica per device"
        )
    return devices


def available_devices(num_gpus: int) -> list[str]:
    return [CPU] + [f"{CUDA}:{index}" for index in range(num_gpus)]


def check_present(devices: Sequence[str], probe: DeviceProbe, *, param: str = "device") -> None:
    """Raise InvalidRequest when a named GPU does not exist here (parsed devices; auto and cpu always
    pass). Asks the probe only when a GPU is named."""
    wanted = [device for device in devices if device.startswith(CUDA)]
    if not wanted:
        return
    num_gpus = probe.cuda_device_count()
    for device in wanted:
        if _gpu_index(device) >= num_gpus:
            reason = "CUDA is not available here" if num_gpus == 0 else f"this machine has {num_gpus} GPU(s)"
            raise InvalidRequest(
                f"{param} {device!r} is not available: {reason}",
                param=param,
                hint=f"available: {', '.join([AUTO, *available_devices(num_gpus)])}",
            )


def _gpu_index(device: str) -> int:
    """0 for "cuda", N for "cuda:N"."""
    return int(device.partition(":")[2] or 0)


def _free_bytes(probe: DeviceProbe, index: int) -> int:
    """Free memory of GPU `index`; a GPU whose query fails counts as full (logged)."""
    try:
        return probe.cuda_free_bytes(index)
    except RuntimeError as exc:  # torch reports CUDA errors (busy, lost device) as RuntimeError
        logger.warning("cannot read the free memory of cuda:%d: %s", index, exc)
        return 0


def _freest_gpu(probe: DeviceProbe) -> tuple[int, int]:
    """(index, free bytes) of the GPU with the most free memory (the lowest index on a tie)."""
    free = [_free_bytes(probe, index) for index in range(probe.cuda_device_count())]
    index = max(range(len(free)), key=lambda i: (free[i], -i))
    return index, free[index]


def _resolve_auto(probe: DeviceProbe, needed_bytes: int, backend: str) -> Placement:
    if backend in HOST_ONLY_BACKENDS:
        return Placement(CPU, f"the {backend!r} backend runs on the CPU")
    if probe.cuda_device_count() == 0:
        return Placement(CPU, "CUDA is not available")
    index, free = _freest_gpu(probe)
    if needed_bytes > int(free * AUTO_FREE_MEMORY_FRACTION):
        return Placement(
            CPU,
            f"the model needs about {needed_bytes / 1e9:.2f} GB (weights on the GPU + KV cache) but the GPU "
            f"with the most free memory, cuda:{index}, has {free / 1e9:.2f} GB free "
            f"({AUTO_FREE_MEMORY_FRACTION:.0%} of it usable)",
        )
    return Placement(
        f"{CUDA}:{index}",
        f"CUDA is available and the model (about {needed_bytes / 1e9:.2f} GB) fits the "
        f"{free / 1e9:.2f} GB free on cuda:{index}",
    )


def resolve_device(device: str, probe: DeviceProbe, *, needed_bytes: int, backend: str = AUTO) -> Placement:
    """One parsed device -> a concrete one. `auto`: the GPU with the most free memory when CUDA is there
    and `needed_bytes` fits it, else the CPU (the reason is logged either way); `cuda`: the GPU with the
    most free memory; `cuda:N` and `cpu` as named. Raises InvalidRequest for a GPU that is not here."""
    check_present([device], probe)
    if device == AUTO:
        placement = _resolve_auto(probe, needed_bytes, backend)
        # a GPU that is there but too full is worth a warning; no GPU at all is the ordinary CPU case
        passed_over_gpu = (
            placement.device == CPU and backend not in HOST_ONLY_BACKENDS and probe.cuda_device_count() > 0
        )
        logger.log(
            logging.WARNING if passed_over_gpu else logging.INFO,
            "device auto -> %s: %s",
            placement.device,
            placement.reason,
        )
        return placement
    if device == CUDA:
        index, free = _freest_gpu(probe)
        return Placement(f"{CUDA}:{index}", f"the GPU with the most free memory ({free / 1e9:.2f} GB)")
    if device != CPU and needed_bytes > (free := _free_bytes(probe, _gpu_index(device))):
        # NOTE: warned, not refused: the estimate is coarse (a GPU layout may be smaller than the file),
        # and a load that really does not fit fails with the device's own out-of-memory error.
        logger.warning(
            "%s has %.2f GB free; the model is estimated at %.2f GB", device, free / 1e9, needed_bytes / 1e9
        )
    return Placement(device, "requested")


def resolve_devices(
    devices: Sequence[str], probe: DeviceProbe, *, needed_bytes: int, backend: str = AUTO
) -> tuple[Placement, ...]:
    """Each parsed device resolved (see `resolve_device`); two entries landing on one device (`cuda`
    beside `cuda:0`) are an InvalidRequest."""
    placements = tuple(
        resolve_device(device, probe, needed_bytes=needed_bytes, backend=backend) for device in devices
    )
    resolved = [placement.device for placement in placements]
    if len(set(resolved)) != len(resolved):
        raise InvalidRequest(
            f"devices {', '.join(devices)} resolve to {', '.join(resolved)}: two replicas on one device",
            param="devices",
            hint="one replica per device",
        )
    return placements


def replica_config(config: EngineConfig, device: str) -> EngineConfig:
    """`config` for the replica on `device` (resolved): the one road from a placement to
    ModelInstance.load, which honours `config.model.device`."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))


def estimated_device_bytes(path: Path, config: EngineConfig) -> int:
    """What a replica is expected to take on a GPU before it is loaded: its weights under the CUDA
    backend's layouts, from the file's tensor table (loader/cuda_footprint.py: Q4 / Q8 projections take
    ~6x their file bytes there, ternary ones about theirs), plus the KV cache budget. Not counted: CUDA
    graph pools and library workspaces. A file that does not parse counts at its size (its load then
    fails with the parser's error)."""
    try:
        with open_model_file(path) as model_file:
            weights = cuda_weight_bytes(model_file.tensors.values())
    except InvalidModelFile:
        weights = path.stat().st_size
    return weights + kv_cache_budget_estimate(config)


def resolve_engine_config(config: EngineConfig, probe: DeviceProbe | None = None) -> EngineConfig:
    """For one engine (the offline LLM behind `generate`, `verify`, `bench --curve`): `config` with its
    device resolved. A list of devices is refused: replicas are the server's."""
    devices = parse_devices(config.model.device)
    if len(devices) > 1:
        raise InvalidRequest(
            f"device {config.model.device!r} names {len(devices)} replicas; this command runs one engine",
            param="device",
            hint="give one device; replicas are served by `bitserve serve`",
        )
    if devices == (CPU,):
        return replica_config(config, CPU)
    placement = resolve_device(
        devices[0],
        probe or TorchDeviceProbe(),
        needed_bytes=estimated_device_bytes(resolve_model(config.model.model), config),
        backend=config.model.backend,
    )
    return replica_config(config, placement.device)

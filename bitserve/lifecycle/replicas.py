"""ReplicaBuilder: the device side of loading a model version. Parses the devices a load or swap asks
for, resolves them to placements (`auto` included: discovery through a DeviceProbe), builds each
replica's EngineConfig (the configured one with the file and that device: the only place one is
built), loads its ModelInstance in a worker thread, starts its engine, and warms or validates it.
Runs on the event loop; the ModelManager owns the slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from bitserve.config import EngineConfig, ServerConfig
from bitserve.engine.devices import (
    CPU,
    DeviceProbe,
    Placement,
    TorchDeviceProbe,
    check_present,
    estimated_device_bytes,
    parse_devices,
    replica_config,
    resolve_devices,
)
from bitserve.engine.instance import ModelInstance
from bitserve.engine.process import ServedModel, start_engine_process, uses_engine_process
from bitserve.frontend.async_engine import AsyncEngine, replica_limits
from bitserve.frontend.device_router import Replica
from bitserve.lifecycle.model_files import GoldenPrompt, ModelFile
from bitserve.lifecycle.slot import ModelSlot
from bitserve.lifecycle.validation import validate_engine
from bitserve.loader.catalog import catalog_block_activations
from bitserve.metrics.stats import StatsSink
from bitserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_PROMPT = "Hello"
InstanceLoader = Callable[[EngineConfig], ServedModel]
# a start-up step still running logs a line this often, so the log never goes quiet for long (a cold
# numba cache makes the warm-up compile the CPU kernels: ~40 s on 2 cores)
PROGRESS_LOG_INTERVAL_S = 5.0
FIRST_GENERATION_HINT = "a first start on this machine compiles the CPU kernels; later starts use the cache"


@contextlib.asynccontextmanager
async def logged_step(what: str, hint: str = "") -> AsyncIterator[None]:
    """Log `what` when it starts, every PROGRESS_LOG_INTERVAL_S while it runs, and its time when done."""
    started = time.monotonic()
    logger.info("%s ...%s", what, f" ({hint})" if hint else "")

    async def tick() -> None:
        while True:
            await asyncio.sleep(PROGRESS_LOG_INTERVAL_S)
            logger.info("%s: still running, %.0f s", what, time.monotonic() - started)

    ticker = asyncio.create_task(tick())
    try:
        yield
    finally:
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
    logger.info("%s: done in %.1f s", what, time.monotonic() - started)


async def warm_up(engine: AsyncEngine, request_id: str) -> None:
    """One short greedy generation so the first client does not pay for lazy initialisation."""
    prompt_ids = engine.instance.tokenizer.encode(WARMUP_PROMPT) or [0]
    await engine.submit(
        prompt_ids, SamplingParams(max_tokens=2, temperature=0.0), request_id=request_id
    ).collect()


class ReplicaBuilder:
    """`probe`: device discovery (torch.cuda unless given; tests pass a fake GPU inventory).
    `load_instance`: EngineConfig -> ModelInstance (unless set: ModelInstance.load, or an engine in a
    process of its own per ServerConfig.engine_process; looked up at each load, so a test may patch it)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        server_config: ServerConfig,
        stats: StatsSink,
        probe: DeviceProbe | None = None,
        load_instance: InstanceLoader | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.server_config = server_config
        self.stats = stats
        self.probe: DeviceProbe = probe or TorchDeviceProbe()
        self.load_instance = load_instance

    def device_request(
        self, devices: str | Sequence[str] | None, default: tuple[str, ...] | None
    ) -> tuple[str, ...]:
        """The parsed devices a load or swap asks for (`default` when None: the alias's own, else the
        configured device). GPUs named must exist here; `auto` is resolved later, at load, against the
        free memory then. Raises InvalidRequest naming the value and the choices."""
        if devices is None and default is not None:
            return default
        if devices is None:
            devices = self.engine_config.model.device
        param = "device" if isinstance(devices, str) else "devices"
        requested = parse_devices(devices, param=param)
        check_present(requested, self.probe, param=param)
        return requested

    def place(self, source: ModelFile, devices: tuple[str, ...]) -> tuple[Placement, ...]:
        """The concrete device of each requested replica (a worker thread: probing CUDA takes a while)."""
        # the estimate reads the file's tensor table; a CPU replica never uses it
        on_cpu_only = all(device == CPU for device in devices)
        needed = 0 if on_cpu_only else estimated_device_bytes(source.path, self.engine_config)
        placements = resolve_devices(
            devices,
            self.probe,
            needed_bytes=needed,
            backend=self.engine_config.model.backend,
        )
        for placement in placements:
            logger.info("placing %s on %s: %s", source.path.name, placement.device, placement.reason)
        return placements

    async def load(self, slot: ModelSlot, source: ModelFile, placements: Sequence[Placement]) -> None:
        """One ModelInstance and started engine per placement, appended to `slot.replicas` in order."""
        model_config = self.engine_config.model
        # the file's path from here on: a catalog name's own numerics are settled while it is still a name
        activations = catalog_block_activations(source.name, model_config.block_activations)
        model_config = dataclasses.replace(
            model_config, model=str(source.path), block_activations=activations
        )
        base = dataclasses.replace(self.engine_config, model=model_config)
        for index, placement in enumerate(placements):
            slot.phase, slot.progress = "loading", 0.2 + 0.6 * index / len(placements)
            load = self.load_instance or self.loader_for(placement.device)
            async with logged_step(f"loading {source.path.name} on {placement.device}"):
                instance = await asyncio.to_thread(load, replica_config(base, placement.device))
            self.start(slot, placement.device, instance)

    def loader_for(self, device: str) -> InstanceLoader:
        """How a replica on `device` is loaded: in this process, or in an engine process of its own."""
        config = self.server_config
        if uses_engine_process(config.engine_process, device):
            return functools.partial(
                start_engine_process, log_level=config.log_level, log_format=config.log_format
            )
        return ModelInstance.load

    def start(self, slot: ModelSlot, device: str, instance: ServedModel) -> Replica:
        """Wrap `instance` in an engine labelled `device` and start it (its thread, or its client to the
        engine process)."""
        engine = AsyncEngine(
            instance,
            limits=replica_limits(self.server_config, instance),
            stats=self.stats,
            name=slot.alias,
            device=device,
        )
        replica = Replica(device, instance, engine)
        slot.replicas.append(replica)  # before start: freeing the slot stops whatever got appended
        engine.start()
        return replica

    async def check(self, slot: ModelSlot, golden: Sequence[GoldenPrompt] | None) -> None:
        """Validate every replica (`golden` given: smoke generation and golden prompts) or, when
        warm-up is on, warm each: a replica whose device is broken fails the load, not a client."""
        for replica in slot.replicas:
            request_id = f"{slot.slot_id}-{replica.device}"
            where = f"{slot.alias} on {replica.device}"
            if golden is not None:  # the first generations: they compile the kernels on a cold cache
                slot.phase = "validating"
                async with logged_step(f"validating {where}", FIRST_GENERATION_HINT):
                    await validate_engine(replica.engine, golden, f"validate-{request_id}")
            elif self.server_config.warmup:
                slot.phase = "warming up"
                async with logged_step(f"warming up {where}", FIRST_GENERATION_HINT):
                    await warm_up(replica.engine, f"warmup-{request_id}")
            replica.engine.forget_step_times()  # the router measures it on real traffic

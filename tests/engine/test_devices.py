"""Device vocabulary, discovery and `auto`: parsing errors name the value and the choices; `auto` takes a
GPU only when CUDA is there and the model fits its free memory, else the CPU with a log line saying why.
Discovery is faked (FakeGPUs): no CUDA needed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from bitserve.cli.main import main
from bitserve.config import EngineConfig, ModelConfig
from bitserve.engine.devices import (
    AUTO_FREE_MEMORY_FRACTION,
    check_present,
    parse_device,
    parse_devices,
    resolve_device,
    resolve_devices,
    resolve_engine_config,
)
from bitserve.errors import InvalidRequest
from bitserve.server.settings import build_configs

GB = 10**9


@dataclass
class FakeGPUs:
    """A DeviceProbe with `free` bytes free on each GPU (none: no CUDA). Counts the free-memory queries."""

    free: tuple[int, ...] = ()
    num_free_queries: int = 0
    broken: set[int] = field(default_factory=set)  # GPUs whose query fails as torch's would

    def cuda_device_count(self) -> int:
        return len(self.free)

    def cuda_free_bytes(self, index: int) -> int:
        self.num_free_queries += 1
        if index in self.broken:
            raise RuntimeError("CUDA error: device unavailable")
        return self.free[index]


class NoProbe:
    """A probe that must not be asked (the CPU-only path never touches discovery)."""

    def cuda_device_count(self) -> int:
        raise AssertionError("probed")

    def cuda_free_bytes(self, index: int) -> int:
        raise AssertionError("probed")


# ----------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "expected"),
    [("cpu", "cpu"), (" CUDA ", "cuda"), ("cuda:0", "cuda:0"), ("cuda:007", "cuda:7"), ("Auto", "auto")],
)
def test_devices_parse_to_one_spelling(text: str, expected: str) -> None:
    assert parse_device(text) == expected


@pytest.mark.parametrize(
    "text", ["gpu", "", "cuda:", "cuda:-1", "cpu:0", "auto:1", "cuda:1234", "mps", "x" * 99]
)
def test_a_bad_device_names_the_value_and_the_choices(text: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_device(text, param="device")
    assert caught.value.param == "device" and "is not a device" in caught.value.message
    assert repr(text[:32]) in caught.value.message
    assert caught.value.hint == "use auto, cpu, cuda or cuda:N"


def test_replica_lists() -> None:
    assert parse_devices("cuda:0, cpu") == ("cuda:0", "cpu")
    assert parse_devices(["cuda:1", "cuda:0"], param="devices") == ("cuda:1", "cuda:0")
    for value, message in (
        ("auto,cpu", "auto picks one device"),
        ("cpu,CPU", "lists cpu more than once"),
        ([], "is empty"),
        (",".join(f"cuda:{i}" for i in range(9)), "at most 8 replicas"),
    ):
        with pytest.raises(InvalidRequest, match=message):
            parse_devices(value)


def test_a_gpu_that_is_not_here_is_refused_with_the_devices_there_are() -> None:
    check_present(["cpu", "auto"], NoProbe())  # nothing to look up
    check_present(["cuda:1"], FakeGPUs((GB, GB)))
    with pytest.raises(InvalidRequest) as caught:
        check_present(["cuda:2"], FakeGPUs((GB, GB)), param="devices")
    assert "'cuda:2' is not available: this machine has 2 GPU(s)" in caught.value.message
    assert caught.value.hint == "available: auto, cpu, cuda:0, cuda:1" and caught.value.param == "devices"
    with pytest.raises(InvalidRequest, match="'cuda' is not available: CUDA is not available here"):
        check_present(["cuda"], FakeGPUs())


# ----------------------------------------------------------------- auto and cuda


def test_auto_takes_the_freest_gpu_when_the_model_fits(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="bitserve.engine.devices"):
        placement = resolve_device("auto", FakeGPUs((4 * GB, 8 * GB)), needed_bytes=3 * GB)
    assert placement.device == "cuda:1" and "fits" in placement.reason
    assert "device auto -> cuda:1" in caplog.text
    assert resolve_device("auto", FakeGPUs((8 * GB,)), needed_bytes=3 * GB).device == "cuda:0"


def test_auto_falls_back_to_the_cpu_with_a_log_line_when_the_model_does_not_fit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpus = FakeGPUs((2 * GB, 3 * GB))
    needed = int(3 * GB * AUTO_FREE_MEMORY_FRACTION) + 1  # fits the free bytes, not the usable share
    with caplog.at_level(logging.INFO, logger="bitserve.engine.devices"):
        placement = resolve_device("auto", gpus, needed_bytes=needed)
    assert placement.device == "cpu"
    record = next(r for r in caplog.records if "device auto -> cpu" in r.getMessage())
    assert record.levelno == logging.WARNING and "cuda:1, has 3.00 GB free" in record.getMessage()


def test_auto_without_cuda_is_the_cpu(caplog: pytest.LogCaptureFixture) -> None:
    gpus = FakeGPUs()
    with caplog.at_level(logging.INFO, logger="bitserve.engine.devices"):
        placement = resolve_device("auto", gpus, needed_bytes=1)
    assert placement.device == "cpu" and placement.reason == "CUDA is not available"
    assert gpus.num_free_queries == 0 and "device auto -> cpu: CUDA is not available" in caplog.text
    # a host-only backend never goes to a GPU, however much room there is
    assert resolve_device("auto", FakeGPUs((80 * GB,)), needed_bytes=1, backend="cpu").device == "cpu"


def test_cuda_means_the_freest_gpu_and_a_broken_one_counts_as_full() -> None:
    gpus = FakeGPUs((9 * GB, 5 * GB), broken={0})
    assert resolve_device("cuda", gpus, needed_bytes=GB).device == "cuda:1"
    assert resolve_device("cuda:0", FakeGPUs((GB,)), needed_bytes=2 * GB).device == "cuda:0"  # warned only
    assert resolve_device("cpu", NoProbe(), needed_bytes=GB).device == "cpu"
    with pytest.raises(InvalidRequest, match="two replicas on one device"):
        resolve_devices(["cuda", "cuda:1"], FakeGPUs((1, 2 * GB)), needed_bytes=1)


def test_one_engine_commands_resolve_their_device_and_refuse_replicas(tmp_path) -> None:  # noqa: ANN001
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 1000)
    config = EngineConfig(model=ModelConfig(model=str(model), device="auto"), kv_cache_memory_bytes=1000)
    assert resolve_engine_config(config, FakeGPUs((10_000,))).model.device == "cuda:0"
    assert resolve_engine_config(config, FakeGPUs((2_000,))).model.device == "cpu"  # 2,000 bytes needed
    cpu = EngineConfig(model=ModelConfig(model=str(model), device="CPU"))
    assert resolve_engine_config(cpu, NoProbe()).model.device == "cpu"
    with pytest.raises(InvalidRequest, match="names 2 replicas; this command runs one engine"):
        resolve_engine_config(EngineConfig(model=ModelConfig(device="cuda:0,cpu")), FakeGPUs((1,)))


def test_a_bad_device_setting_fails_at_startup_and_on_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(InvalidRequest, match="device 'gpu' is not a device"):
        build_configs({"device": "gpu"})
    assert build_configs({"device": "cuda:0,cpu"})[0].model.device == "cuda:0,cpu"  # resolved at load
    assert main(["generate", "--prompt", "hi", "--device", "tpu"]) == 2
    assert "device 'tpu' is not a device" in capsys.readouterr().err

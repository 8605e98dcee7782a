"""Energy counters from a fake /sys/class/powercap tree (a temp directory standing in for the kernel's
files, for this unit only): RAPL package domains summed as device "cpu", subzones skipped, counter
wrap-around, and an unreadable tree leaving the family without samples and saying why."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from bitserve.metrics.energy import EnergyCollector

MAX_RANGE_UJ = 262_143_328_850  # a real package domain's max_energy_range_uj


def write_domain(root: Path, name: str, energy_uj: int) -> Path:
    domain = root / name
    domain.mkdir(parents=True, exist_ok=True)
    (domain / "energy_uj").write_text(f"{energy_uj}\n")
    (domain / "max_energy_range_uj").write_text(f"{MAX_RANGE_UJ}\n")
    return domain


def joules(collector: EnergyCollector) -> dict[str, float]:
    (family,) = collector.collect()
    assert family.name == "bitserve_energy_joules" and family.type == "counter"
    return {
        sample.labels["device"]: sample.value for sample in family.samples if sample.name.endswith("_total")
    }


def test_rapl_packages_are_summed_and_wrap_around(tmp_path: Path) -> None:
    package0 = write_domain(tmp_path, "intel-rapl:0", 5_000_000)
    package1 = write_domain(tmp_path, "intel-rapl:1", 1_000_000)
    write_domain(tmp_path, "intel-rapl:0:0", 7_000_000)  # a core subzone: inside package 0, not added
    collector = EnergyCollector(tmp_path, use_nvml=False)
    assert collector.status() == {"cpu": "ok: 2 RAPL package domain(s)"}
    assert joules(collector) == {"cpu": 0.0}  # joules since the server started
    (package0 / "energy_uj").write_text("7500000\n")  # +2.5 J
    (package1 / "energy_uj").write_text("1500000\n")  # +0.5 J
    assert joules(collector) == {"cpu": 3.0}
    (package0 / "energy_uj").write_text("500000\n")  # wrapped: +(MAX_RANGE - 7.5 J) + 0.5 J
    assert joules(collector)["cpu"] == 3.0 + (MAX_RANGE_UJ - 7_500_000 + 500_000) * 1e-6
    registry = CollectorRegistry()
    registry.register(collector)
    assert 'bitserve_energy_joules_total{device="cpu"}' in generate_latest(registry).decode()


def test_unreadable_energy_has_no_samples_and_a_reason(tmp_path: Path) -> None:
    absent = EnergyCollector(tmp_path / "none", use_nvml=False)
    assert absent.status()["cpu"].startswith("no RAPL domains under")
    assert joules(absent) == {}
    broken = tmp_path / "broken"
    (broken / "intel-rapl:0" / "energy_uj").mkdir(parents=True)  # a directory where the counter should be
    collector = EnergyCollector(broken, use_nvml=False)
    assert "could not be read" in collector.status()["cpu"] and joules(collector) == {}
    registry = CollectorRegistry()
    registry.register(collector)
    exposition = generate_latest(registry).decode()
    assert "# TYPE bitserve_energy_joules_total counter" in exposition  # described, without samples
    assert "bitserve_energy_joules_total{" not in exposition

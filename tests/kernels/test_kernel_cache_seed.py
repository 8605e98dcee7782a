"""The container image's prebuilt kernel cache reaches numba's writable cache (kernels/cpu/cache_seed.py):
missing files are copied, present ones are left alone, and nothing happens without a seed."""

from __future__ import annotations

from pathlib import Path

from bitserve.kernels.cpu.cache_seed import seed_numba_cache


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_missing_files_are_copied_and_present_ones_kept(tmp_path: Path) -> None:
    seed, target = tmp_path / "seed", tmp_path / "cache"
    (seed / "kernels_cpu_ab12").mkdir(parents=True)
    (seed / "kernels_cpu_ab12" / "int8dot.gemv-10.py311.nbi").write_bytes(b"index")
    (seed / "kernels_cpu_ab12" / "int8dot.gemv-10.py311.1.nbc").write_bytes(b"code")
    (target / "kernels_cpu_ab12").mkdir(parents=True)
    (target / "kernels_cpu_ab12" / "int8dot.gemv-10.py311.nbi").write_bytes(b"newer index")
    assert seed_numba_cache(str(seed), str(target)) == 1
    assert _tree(target) == {
        "kernels_cpu_ab12/int8dot.gemv-10.py311.1.nbc": b"code",
        "kernels_cpu_ab12/int8dot.gemv-10.py311.nbi": b"newer index",  # this machine's own, kept
    }
    assert seed_numba_cache(str(seed), str(target)) == 0  # a second start copies nothing


def test_no_seed_or_the_same_folder_does_nothing(tmp_path: Path) -> None:
    (tmp_path / "a.nbi").write_bytes(b"x")
    assert seed_numba_cache("", str(tmp_path / "cache")) == 0
    assert seed_numba_cache(str(tmp_path), "") == 0
    assert seed_numba_cache(str(tmp_path / "missing"), str(tmp_path / "cache")) == 0
    assert seed_numba_cache(str(tmp_path), str(tmp_path)) == 0
    assert not (tmp_path / "cache").exists()

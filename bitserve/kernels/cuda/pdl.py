"""Programmatic dependent launch (PDL) for the decode step's Triton kernels (Hopper and newer).

A batch-1 decode step of a 2B model is ~330 kernels of 1-8 µs; each one's launch latency and ramp-up
(~1.5 µs measured on an H100, inside a CUDA graph) sat between it and the kernel before it. With PDL a
kernel is launched while its predecessor still runs (the predecessor signals `gdc_launch_dependents`
once past its own wait); the new kernel issues the loads that do not depend on the predecessor (a
GEMV's weight rows) and then blocks in `gdc_wait` until the predecessor has finished and its writes are
visible.

Order inside a kernel: wait, then trigger. Triggering first let the whole graph's kernels launch
ahead, each one's programs resident and parked in their wait, taking the SM slots the running GEMV
needed (measured on an H100: a 2B batch-1 step went from 1.69 to 2.03 ms). Wait-then-trigger keeps
exactly one kernel launched ahead. Triggering first in the short kernels alone (norm_quantize, so a
GEMV launches while the GEMV two back still runs) was 8% slower still; in RoPE + KV write, within the
noise; in decode attention, its reduction and Wo's norm_quantize (Wo launched as attention starts),
within the noise (H200, RESULTS.md 2026-11-29 13:30).

Contract of a kernel launched with `launch_options(...)`: it calls `pdl_enter(USE_PDL)` before any store
and before it reads anything the kernel launched just before it may write, so ordering is as strict as
without PDL (`gdc_wait` waits for the predecessor's completion, and the predecessor itself completed only
after its own wait: the chain is transitive). Before the wait a kernel may read what no running kernel
writes: weights (a norm's, a GEMV's), and anything written two or more kernels earlier (a kernel starts
only once its predecessor has passed its own wait, that is once the kernel before that has completed).
So the step's inputs are readable there: ids, positions and block tables, which host copies (or the step
before) write before the chain's first kernel, and slots and seq_lens, which that first kernel
(decode_inputs.py) writes, several kernels before the RoPE + KV write and the attention that read them
(keep one kernel at least between them); decode attention also reads the KV cache of earlier steps'
keys there (the kernel before it writes only this step's slots). Such reads then travel under the
previous kernel: a norm weight read after the wait came from DRAM on the critical path (2B batch-1 graph
replay 1.186 -> 1.116 ms on an H100 once it moved before the wait).

KernelTuning.cuda_pdl=False (`--no-cuda-pdl`, BITSERVE_CUDA_PDL=0) turns it off: the kernels then compile
without the grid-dependency instructions. Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# NOTE: PDL is compiled into every kernel as a constexpr, so it is one choice per device for the process:
# CudaBackend sets it from its KernelTuning at construction (configure_pdl), once, before any kernel of
# that device compiles; a later backend asking for the other value is refused. Devices never configured
# take the default (on).
_PDL_BY_DEVICE: dict[torch.device, bool] = {}


def configure_pdl(device: torch.device, enabled: bool) -> None:
    """PDL on or off for `device`'s kernels (KernelTuning.cuda_pdl), at load. ValueError if the process
    already chose the other value for it."""
    chosen = _PDL_BY_DEVICE.setdefault(_key(device), enabled)
    if chosen != enabled:
        raise ValueError(f"PDL is already {'on' if chosen else 'off'} for {device} in this process")


def pdl_enabled(device: torch.device) -> bool:
    """PDL on `device`: a CUDA device of compute capability 9.0 or newer, unless configured off."""
    if device.type != "cuda" or not _PDL_BY_DEVICE.get(_key(device), True):
        return False
    return _is_hopper_or_newer(device)


def _key(device: torch.device) -> int:
    """cuda and cuda:N name the same card when N is the current device: key by index."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _is_hopper_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments of a Triton launch: USE_PDL (the kernel's constexpr) and launch_pdl, together."""
    enabled = pdl_enabled(device)
    return {"USE_PDL": enabled, "launch_pdl": enabled}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Block until the previous kernel has completed and its writes are visible, then let the next
    kernel launch (it waits here in turn). One call, so the order cannot be got wrong."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()

"""KernelTuning: every kernel knob of one loaded model, in one frozen object chosen at load.

The values come from ModelConfig (set by the CLI, BITSERVE_* environment variables or a TOML profile in
server/settings.py, the one module that reads the environment, or by LLM(...) keywords); the engine
hands this object to the backend it selects (kernels/select.py) and to the runner. Kernels read their
knobs from it, never from the environment. Defaults are the measured best (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"


@dataclass(frozen=True, slots=True)
class KernelTuning:
    # cpu backend: the ternary kernel variant (auto, vnni, avx2, generic: kernels/cpu/isa.py) and how
    # Q4_* / Q8_0 weights meet activations (auto, q8, f32: q8 where the ISA has integer dots)
    cpu_isa: str = AUTO
    block_activations: str = AUTO
    # cuda backend: programmatic dependent launch (kernels/cuda/pdl.py), the greedy head's int8 copy of a
    # float LM head (kernels/cuda/greedy_head.py), the plain greedy step launched ahead and its reserved
    # KV slot (runner/cuda_lookahead.py)
    cuda_pdl: bool = True
    cuda_greedy_head: bool = True
    cuda_lookahead: bool = True
    cuda_lookahead_slot: bool = True

    def requested_block_activations(self) -> str | None:
        """block_activations as CpuBackend takes it: None for auto (the ISA decides)."""
        return None if self.block_activations == AUTO else self.block_activations


DEFAULT_TUNING = KernelTuning()  # the measured defaults, for callers that set no knob

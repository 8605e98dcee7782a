"""`bitserve verify`: full structural validation, every tensor decoded, a kernel check against the
reference backend, and a short greedy generation with finite logits. Exit 0 only if all pass."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bitserve.config import EngineConfig, ModelConfig
from bitserve.errors import BitserveError
from bitserve.kernels.backend import LinearMode, PreparedLinear
from bitserve.kernels.select import select_backend
from bitserve.llm import LLM
from bitserve.loader.model_loader import GGUFWeightSource
from bitserve.sampling_params import SamplingParams

VERIFY_PROMPT = "The quick brown fox"
# float-mode and dense kernels may sum in another order than the reference: a tight relative bound
FLOAT_RELATIVE_TOLERANCE = 1e-4


@dataclass
class VerifyReport:
    path: str
    checks: list[tuple[str, bool, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(passed for _, passed, _ in self.checks)

    def add(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append((name, passed, detail))

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "checks": [{"check": n, "ok": p, "detail": d} for n, p, d in self.checks],
        }

    def format(self) -> str:
        lines = [f"verify {self.path}"]
        lines += [f"  [{'ok' if p else 'FAIL'}] {n}: {d}" for n, p, d in self.checks]
        lines.append("compliant and generates" if self.ok else "NOT compliant")
        return "\n".join(lines)


def _kernel_check(llm: LLM) -> tuple[bool, str]:
    """Layer 0's and the last layer's q projections: chosen backend vs reference, on random input."""
    instance = llm.instance
    reference = select_backend("reference")
    source = GGUFWeightSource(
        instance.loaded.gguf, reference, instance.loaded.linear_mode, instance.loaded.decode_options
    )
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for layer_id in sorted({0, instance.loaded.spec.num_layers - 1}):
        layer = instance.loaded.model.layers[layer_id]
        fast: PreparedLinear = layer.qkv.weights[0]  # q alone, or q/k/v stacked by the backend
        ref = source.linear(
            f"blk.{layer_id}.attn_q.weight",
            may_be_ternary=instance.loaded.model.recipe.ternary_projections,
        )
        x = torch.randn(3, fast.in_features, generator=generator)
        expected = reference.linear(x, ref)
        actual = layer.qkv.projection.kernel(x)[0]  # q's output [3, M_q], split from a stacked group's
        exact = fast.is_ternary and instance.loaded.linear_mode.kernel_mode is LinearMode.BITNET
        if exact and not torch.equal(expected, actual):
            return (
                False,
                f"layer {layer_id} q projection differs from the reference (integer path must be exact)",
            )
        error = float((expected - actual).abs().max() / expected.abs().max().clamp_min(1e-12))
        worst = max(worst, error)
        if error > FLOAT_RELATIVE_TOLERANCE:
            return False, f"layer {layer_id} q projection: relative error {error:.2e} vs reference"
    return True, f"{instance.loaded.backend.name} backend matches reference (max relative error {worst:.1e})"


def verify_model(path: Path, model_config: ModelConfig, *, num_tokens: int = 8) -> VerifyReport:
    report = VerifyReport(str(path))
    start = time.perf_counter()
    try:
        llm = LLM(config=EngineConfig(model=dataclasses.replace(model_config, model=str(path))))
    except BitserveError as exc:
        report.add("load", False, str(exc))
        return report
    try:
        loaded = llm.instance.loaded
        report.add(
            "structure",
            True,
            f"GGUF v{loaded.gguf.version}, {len(loaded.gguf.tensors)} tensors, "
            f"{loaded.gguf.dialect.value} dialect",
        )
        report.add(
            "decode",
            True,
            f"every tensor decoded; model {loaded.spec.architecture} built in "
            f"{time.perf_counter() - start:.1f} s",
        )
        report.add(
            "tensor names",
            not loaded.unused_tensors,
            f"{len(loaded.unused_tensors)} unused tensors {loaded.unused_tensors[:4]}",
        )
        report.add("kernels", *_kernel_check(llm))
        _generation_check(llm, report, num_tokens)
    except BitserveError as exc:
        report.add("model", False, str(exc))
    finally:
        llm.close()
    return report


def _generation_check(llm: LLM, report: VerifyReport, num_tokens: int) -> None:
    prompt_ids = llm.encode(VERIFY_PROMPT)
    model = llm.instance.loaded.model
    with torch.inference_mode():
        ids = torch.tensor(prompt_ids)
        logits = model.compute_logits(model(ids, torch.arange(len(prompt_ids))))
    finite = bool(torch.isfinite(logits).all())
    report.add(
        "logits", finite, f"prompt logits {tuple(logits.shape)} {'finite' if finite else 'NOT finite'}"
    )
    result = llm.generate(
        [prompt_ids], SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    )[0]
    output = result.outputs[0]
    greedy_ok = len(output.token_ids) == num_tokens and output.token_ids[0] == int(logits[-1].argmax())
    report.add("generate", greedy_ok, f"{len(output.token_ids)} greedy tokens: {output.text!r}")

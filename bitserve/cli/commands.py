"""The CLI's subcommands (argparse.Namespace in, exit code out). Output goes through console.py."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bitserve.cli.console import emit, emit_json
from bitserve.cli.sampling_flags import sampling_params_from_args
from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig
from bitserve.errors import InvalidRequest
from bitserve.loader.catalog import resolve_model

if TYPE_CHECKING:
    from bitserve.loader.gguf_reader import GGUFFile
    from bitserve.models.spec import ModelSpec


def model_config_from_args(args: argparse.Namespace, model: str) -> ModelConfig:
    return ModelConfig(
        model=model,
        backend=args.backend,
        device=args.device,
        linear_mode=args.linear_mode,
        lm_head=args.lm_head,
        i2s_variant=args.i2s_variant,
        tl_config=args.tl_config,
        tokenizer_pre=args.tokenizer_pre,
        hidden_act=args.hidden_act,
        num_threads=args.threads,
    )


def run_generate(args: argparse.Namespace) -> int:
    from bitserve.llm import LLM

    params = sampling_params_from_args(args)
    try:
        scheduler = SchedulerConfig(
            speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens
        )
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="num_speculative_tokens") from None
    llm = LLM(config=EngineConfig(model=model_config_from_args(args, args.model), scheduler=scheduler))
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
            prompt_ids = llm.encode_chat(messages)
        else:
            prompt_ids = llm.encode(args.prompt)
        start = time.perf_counter()
        result = llm.generate([prompt_ids], params)[0]
        seconds = time.perf_counter() - start
    finally:
        llm.close()
    output = result.outputs[0]
    if args.json:
        emit_json(
            {
                "model": args.model,
                "text": output.text,
                "prompt_token_ids": result.prompt_token_ids,
                "token_ids": output.token_ids,
                "finish_reason": output.finish_reason,
                "num_prompt_tokens": result.num_prompt_tokens,
                "num_output_tokens": len(output.token_ids),
                "seconds": round(seconds, 4),
            }
        )
    else:
        emit(output.text)
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    from bitserve.loader.quantize_file import quantize_gguf

    result = quantize_gguf(resolve_model(args.source, fetch=False), args.target, args.weight_type)
    summary = {
        "path": str(result.path),
        "type": args.weight_type,
        "rewritten": len(result.rewritten),
        "kept": result.kept,
        "bytes": result.path.stat().st_size,
    }
    if args.json:
        emit_json(summary)
        return 0
    kept = sorted(set(result.kept.values()))
    emit(
        f"wrote {result.path} ({summary['bytes'] / 1e6:.1f} MB): {len(result.rewritten)} projections as "
        f"{args.weight_type}; {len(result.kept)} tensors kept their type ({'; '.join(kept)})"
    )
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from bitserve.kernels.select import cpu_kernel_choices
    from bitserve.loader.checkpoint_file import open_model_file
    from bitserve.loader.inspect import format_summary, spec_or_problem, summarize

    path = resolve_model(args.model, fetch=False)
    with open_model_file(path) as gguf:
        spec = spec_or_problem(gguf)
        summary = summarize(gguf, spec)
        summary["cpu_kernels"] = cpu_kernel_choices(summary["tensor_types"])  # this machine's, not the file's
        summary["kv_cache"] = _default_kv_cache(gguf, spec)
    summary["device_auto"] = _device_auto(path)
    if args.json:
        emit_json(summary)
    else:
        emit(format_summary(summary))
    return 0


def _default_kv_cache(gguf: GGUFFile, spec: ModelSpec | str) -> dict[str, Any]:
    """The KV pool `bitserve serve` would give this file on this machine's CPU at default settings
    (`spec` a problem text: that, which the summary already shows)."""
    import torch

    from bitserve.engine.instance import plan_kv_cache, serving_limits

    if isinstance(spec, str):
        return {"error": spec}
    config, device = EngineConfig(), torch.device("cpu")
    limits = serving_limits(config, spec, gguf, device)
    layout = plan_kv_cache(config, spec, limits, device)
    return {"max_num_seqs": limits.max_num_seqs, "max_model_len": limits.max_model_len, **layout.describe()}


def _device_auto(path: Path) -> dict[str, str]:
    """Where `--device auto` would put this file on this machine now, why, and how its KV cache is
    sized there (the same resolution `bitserve serve` runs: engine/devices.py)."""
    from bitserve.engine.devices import CPU, TorchDeviceProbe, estimated_device_bytes, resolve_device

    config = EngineConfig()
    placement = resolve_device("auto", TorchDeviceProbe(), needed_bytes=estimated_device_bytes(path, config))
    kv_cache = (
        "kv cache as above (cpu default)"
        if placement.device == CPU
        else f"kv cache sized at load from the GPU's free memory: --gpu-memory-utilization "
        f"{config.gpu_memory_utilization} of it, after weights and activations (runner/cuda_memory.py)"
    )
    return {"device": placement.device, "reason": placement.reason, "kv_cache": kv_cache}


def run_verify(args: argparse.Namespace) -> int:
    from bitserve.cli.verify import verify_model

    report = verify_model(
        resolve_model(args.model, fetch=False),
        model_config_from_args(args, args.model),
        num_tokens=args.num_tokens,
    )
    if args.json:
        emit_json(report.as_dict())
    else:
        emit(report.format())
    return 0 if report.ok else 1


def run_crossval(args: argparse.Namespace) -> int:
    """Rerun the live comparisons (tests marked `crossval`): llama.cpp's, or bitnet.cpp's with
    --bitnet-cpp."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    env = None
    targets = [tests]
    if args.bitnet_cpp:
        env = {**os.environ, "BITNET_CPP": str(args.bitnet_cpp)}
        # its own synthetic files, and the I2_S file `bitserve convert` writes from a BitNet checkpoint
        targets = [
            tests / "models" / name for name in ("test_bitnetcpp_crossval.py", "test_converted_bitnetcpp.py")
        ]
        emit(f"bitnet.cpp crossval ({bitnet_cpp_mode(Path(args.bitnet_cpp))}): {args.bitnet_cpp}")
    command = [
        sys.executable,
        "-m",
        "pytest",
        *map(str, targets),
        "-m",
        "crossval",
        "-p",
        "no:cacheprovider",
        "-rs",
        *args.pytest_args,
    ]
    return subprocess.call(command, env=env)


def bitnet_cpp_mode(bin_dir: Path) -> str:
    """What the bitnet.cpp crossval can run with the binaries in bin_dir (the test skips on the last)."""
    if (bin_dir / "bnc-probe").is_file():
        return "bnc-probe mode: greedy tokens and every position's logits"
    if (bin_dir / "llama-cli").is_file():
        return "llama-cli mode: greedy tokens only (no bnc-probe, no logits)"
    return "no bnc-probe or llama-cli there: the tests will skip"

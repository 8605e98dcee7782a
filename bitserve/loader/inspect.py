"""A readable summary of a GGUF file for `bitserve inspect`: architecture, hyperparameters,
tokenizer, tensor types with counts and bytes, format dialect, file size."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from bitserve.errors import BitserveError
from bitserve.loader.gguf_reader import GGUFFile
from bitserve.loader.model_spec import spec_from_metadata
from bitserve.models.spec import ModelSpec

TOKENIZER_KEYS = ("model", "pre", "bos_token_id", "eos_token_id", "eot_token_id", "add_bos_token")


def spec_or_problem(gguf: GGUFFile) -> ModelSpec | str:
    """The file's ModelSpec, or why it has none (an unsupported arch, ...): inspect reports the
    problem instead of failing. Built once for the summary and the default KV cache."""
    try:
        return spec_from_metadata(gguf.metadata, tensor_names=set(gguf.tensors), path=str(gguf.path))
    except (BitserveError, ValueError, TypeError) as exc:
        return str(exc)


def summarize(gguf: GGUFFile, spec: ModelSpec | str) -> dict[str, Any]:
    """A JSON-ready dict; the spec part is only the reason (spec_or_problem) when there is no spec."""
    metadata = gguf.metadata
    type_counts: Counter[str] = Counter()
    type_bytes: Counter[str] = Counter()
    for info in gguf.tensors.values():
        type_counts[info.ggml_type.name] += 1
        type_bytes[info.ggml_type.name] += info.nbytes
    tokens = metadata.get("tokenizer.ggml.tokens")
    summary: dict[str, Any] = {
        "path": str(gguf.path),
        "format": "hf-checkpoint" if Path(gguf.path).is_dir() else "gguf",
        "file_size": gguf.file_size,
        "gguf_version": gguf.version,
        "dialect": gguf.dialect.value,
        "alignment": gguf.alignment,
        "architecture": metadata.get("general.architecture"),
        "name": metadata.get("general.name"),
        "file_type": metadata.get("general.file_type"),
        "num_tensors": len(gguf.tensors),
        "num_parameters": sum(info.num_elements for info in gguf.tensors.values()),
        "tensor_types": {
            name: {"count": type_counts[name], "bytes": type_bytes[name]} for name in sorted(type_counts)
        },
        "tokenizer": {key: metadata.get(f"tokenizer.ggml.{key}") for key in TOKENIZER_KEYS}
        | {
            "vocab_size": len(tokens) if tokens is not None else None,
            "has_chat_template": "tokenizer.chat_template" in metadata,
        },
    }
    summary["hyperparameters"] = {"error": spec} if isinstance(spec, str) else _hyperparameters(spec)
    return summary


def _hyperparameters(spec: ModelSpec) -> dict[str, Any]:
    """The spec's fields as shown; the softmax scale as the value in effect (the field's 0 means
    1 / sqrt(head_dim), which a reader should not have to know)."""
    values = {
        field: getattr(spec, field).value if hasattr(getattr(spec, field), "value") else getattr(spec, field)
        for field in spec.__dataclass_fields__
    }
    values["attention_scale"] = spec.softmax_scale
    return values


def format_summary(summary: dict[str, Any]) -> str:
    container = (
        "Hugging Face checkpoint directory, served as its converted GGUF"
        if summary.get("format") == "hf-checkpoint"
        else f"GGUF v{summary['gguf_version']}, {summary['dialect']} dialect, "
        f"alignment {summary['alignment']}"
    )
    lines = [
        f"file          {Path(summary['path']).name}  ({summary['file_size'] / 1e6:.1f} MB, {container})",
        f"architecture  {summary['architecture']}  name={summary['name']}  file_type={summary['file_type']}",
        f"parameters    {summary['num_parameters']:,} in {summary['num_tensors']} tensors",
        "hyperparameters",
    ]
    lines += [f"  {key:22s}{value}" for key, value in summary["hyperparameters"].items()]
    lines.append("tokenizer")
    lines += [f"  {key:22s}{value}" for key, value in summary["tokenizer"].items()]
    lines.append("tensor types (cpu kernel of a projection in that type, on this machine)")
    kernels = summary.get("cpu_kernels") or {}
    names = kernels.get("projection_kernels", {})
    for name, entry in summary["tensor_types"].items():
        kernel = f"  {names[name]}" if name in names else ""
        lines.append(f"  {name:8s}{entry['count']:6d} tensors {entry['bytes'] / 1e6:12.2f} MB{kernel}")
    if kernels:
        lines.append(
            f"cpu kernels   isa={kernels['isa']} (supported: {', '.join(kernels['supported_isas'])}), "
            f"block activations={kernels['block_activations']}"
        )
    kv = summary.get("kv_cache")
    if kv and "error" not in kv:
        lines.append(
            f"kv cache      default {kv['num_tokens']:,} tokens ({kv['memory_bytes'] / 2**20:.1f} MiB "
            f"{kv['dtype']}, {kv['bytes_per_token']:,} bytes a token) for max_num_seqs {kv['max_num_seqs']}, "
            f"max_model_len {kv['max_model_len']} on cpu (--kv-cache-memory-bytes sets it)"
        )
    placement = summary.get("device_auto")
    if placement:
        lines.append(f"device auto   {placement['device']}: {placement['reason']}")
        lines.append(f"              {placement['kv_cache']}")
    return "\n".join(lines)

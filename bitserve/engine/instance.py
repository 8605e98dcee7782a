"""ModelInstance: one loaded model with everything needed to serve it — weights on a backend,
tokenizer, chat template, and an Engine over a paged KV cache. Built by the offline LLM and by the
server's model manager from the same EngineConfig."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bitserve.batch_limits import resolve_batch_limits
from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, kv_cache_default_tokens
from bitserve.engine.devices import AUTO, parse_device
from bitserve.engine.engine import Engine
from bitserve.errors import InvalidModelFile, InvalidRequest
from bitserve.kernels.backend import LinearMode
from bitserve.kernels.select import select_backend
from bitserve.kernels.tuning import KernelTuning, parse_decode_tile, parse_gemv_tiles
from bitserve.loader.catalog import catalog_block_activations, resolve_model
from bitserve.loader.gguf_reader import GGUFFile
from bitserve.loader.model_loader import LoadOptions, LoadResult, load_model, release_freed_heap
from bitserve.models.spec import ModelSpec
from bitserve.runner.cuda_memory import (
    DeviceBaseline,
    DeviceMemoryPlan,
    log_memory_after_load,
    plan_device_kv,
)
from bitserve.runner.embeddings import pooling_from_metadata
from bitserve.runner.kv_cache import (
    KV_DTYPES,
    CacheLayout,
    kv_bytes_per_token,
    num_blocks_for_tokens,
    plan_cache,
    resolve_kv_dtype,
)
from bitserve.runner.model_runner import ModelRunner
from bitserve.structured.grammars import GrammarCompiler
from bitserve.structured.masks import GuidedRows
from bitserve.structured.tool_formats import ToolFormat, tool_format_for
from bitserve.tokenizer.chat_template import ChatTemplate, encode_chat
from bitserve.tokenizer.gguf_vocab import GGUFTokenizer, tokenizer_from_gguf

logger = logging.getLogger(__name__)


def parse_linear_mode(name: str) -> LinearMode:
    try:
        return LinearMode(name)
    except ValueError:
        choices = ", ".join(mode.value for mode in LinearMode)
        raise InvalidRequest(
            f"unknown linear mode {name!r}", param="linear_mode", hint=f"one of {choices}"
        ) from None


def load_device(name: str) -> torch.device:
    """The concrete device a model is loaded on ("cpu", "cuda", "cuda:N"); `auto` and replica lists are
    resolved before a load (engine/devices.py), so they are refused here."""
    device = parse_device(name)
    if device == AUTO:
        raise InvalidRequest(
            "device auto must be resolved before a load", param="device", hint="see engine/devices.py"
        )
    return torch.device(device)


def kernel_tuning(model_config: ModelConfig) -> KernelTuning:
    """The model's kernel knobs (kernels/tuning.py), from its ModelConfig: the one place they meet."""
    return KernelTuning(
        cpu_isa=model_config.cpu_isa,
        block_activations=catalog_block_activations(model_config.model, model_config.block_activations),
        cuda_pdl=model_config.cuda_pdl,
        cuda_greedy_head=model_config.cuda_greedy_head,
        cuda_lookahead=model_config.cuda_lookahead,
        cuda_lookahead_slot=model_config.cuda_lookahead_slot,
        cuda_gemv_tiles=parse_gemv_tiles(model_config.cuda_gemv_tiles),
        cuda_decode_tile=parse_decode_tile(model_config.cuda_decode_tile),
    )


def check_speculative(scheduler_config: SchedulerConfig, device: torch.device) -> None:
    """InvalidRequest for speculative decoding on a CUDA device: the CUDA runner's graphs and its lookahead
    step assume one token per decode (checked before the weights load, and again by make_runner)."""
    if scheduler_config.speculative != "off" and device.type == "cuda":
        raise InvalidRequest(
            "speculative decoding runs on the cpu backend only, for now",
            param="speculative",
            hint="serve this model with --speculative off, or on --device cpu",
        )


def make_runner(
    loaded: LoadResult,
    layout: CacheLayout,
    device: torch.device,
    scheduler_config: SchedulerConfig,
    max_model_len: int,
    *,
    model_config: ModelConfig,
    tuning: KernelTuning,
) -> ModelRunner:
    """The CPU runner, or the CUDA runner (device KV pages, decode CUDA graphs) for a CUDA device."""
    if device.type != "cuda":
        return ModelRunner(loaded.model, layout)
    check_speculative(scheduler_config, device)
    from bitserve.runner.cuda_runner import CudaModelRunner  # NOTE: deferred: Triton, CUDA only

    return CudaModelRunner(
        loaded.model,
        layout,
        device,
        max_num_seqs=scheduler_config.max_num_seqs,
        max_model_len=max_model_len,
        use_cuda_graphs=model_config.cuda_graphs,
        tuning=tuning,
    )


def projection_format(gguf: GGUFFile) -> str:
    """The GGML type name holding most bytes of the layers' 2-D weights (the projections), e.g. "I2_S"."""
    nbytes: dict[str, int] = {}
    for name, info in gguf.tensors.items():
        if name.startswith("blk.") and len(info.shape) == 2:
            nbytes[info.ggml_type.name] = nbytes.get(info.ggml_type.name, 0) + info.nbytes
    return max(nbytes, key=nbytes.__getitem__) if nbytes else "none"


def serving_limits(
    config: EngineConfig, spec: ModelSpec, gguf: GGUFFile, device: torch.device
) -> SchedulerConfig:
    """The scheduler config a replica runs with: max_model_len capped at the model's, and the batch
    limits the operator left unset filled from the projections' format (batch_limits.resolve_batch_limits)."""
    max_model_len = min(spec.max_model_len, config.scheduler.max_model_len)
    return resolve_batch_limits(
        dataclasses.replace(config.scheduler, max_model_len=max_model_len),
        projection_format(gguf),
        device.type,
    )


def kv_cache_is_set(config: EngineConfig) -> bool:
    """Whether the KV pool's size was given (blocks or bytes) rather than left to the default."""
    return config.cache.num_blocks is not None or config.kv_cache_memory_bytes is not None


def plan_kv_cache(
    config: EngineConfig,
    spec: ModelSpec,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    device_kv_bytes: int | None = None,
) -> CacheLayout:
    """The replica's KV pool: `cache.num_blocks` or `kv_cache_memory_bytes` when set; else on CUDA
    `device_kv_bytes` (sized from the device's memory: plan_cuda_kv_bytes), on CPU the default sized from
    the model's KV bytes per token and the resolved serving limits (config.py's kv_cache_default_tokens)."""
    dtype_name = resolve_kv_dtype(config.model.kv_cache_dtype, device)
    block_size = config.cache.block_size
    num_blocks = config.cache.num_blocks
    memory_bytes = config.kv_cache_memory_bytes
    if not kv_cache_is_set(config) and device_kv_bytes is not None:
        memory_bytes = device_kv_bytes
    elif not kv_cache_is_set(config):  # the CPU default
        assert scheduler_config.max_num_seqs is not None, "resolve_batch_limits ran first"
        num_tokens = kv_cache_default_tokens(
            scheduler_config.max_num_seqs,
            scheduler_config.max_model_len,
            kv_bytes_per_token(spec, dtype_name),
        )
        num_blocks = num_blocks_for_tokens(num_tokens, block_size)
    return plan_cache(
        spec,
        block_size=block_size,
        memory_bytes=memory_bytes or 0,
        dtype_name=dtype_name,
        num_blocks=num_blocks,
    )


def plan_cuda_kv_bytes(
    config: EngineConfig,
    loaded: LoadResult,
    scheduler_config: SchedulerConfig,
    device: torch.device,
    baseline: DeviceBaseline,
    tuning: KernelTuning,
) -> DeviceMemoryPlan:
    """The default KV bytes of a CUDA replica, from its device's memory (runner/cuda_memory.py), logged."""
    from bitserve.runner.cuda_graphs import held_output_bytes  # NOTE: deferred: Triton, CUDA only
    from bitserve.runner.cuda_runner import prepared_decoder

    decoder = prepared_decoder(loaded.model, use_cuda_graphs=config.model.cuda_graphs, tuning=tuning)
    assert scheduler_config.max_num_seqs is not None and scheduler_config.max_num_batched_tokens is not None
    kv_dtype_name = resolve_kv_dtype(config.model.kv_cache_dtype, device)
    block_size = config.cache.block_size
    graph_output_bytes = 0
    if config.model.cuda_graphs:
        graph_output_bytes = held_output_bytes(
            decoder,
            max_batch=scheduler_config.max_num_seqs,
            max_blocks_per_seq=-(-scheduler_config.max_model_len // block_size),
            block_size=block_size,
            vocab_size=loaded.spec.vocab_size,
        )
    plan = plan_device_kv(
        decoder,
        baseline=baseline,
        max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        max_num_seqs=scheduler_config.max_num_seqs,
        max_model_len=scheduler_config.max_model_len,
        block_size=block_size,
        kv_dtype=KV_DTYPES[kv_dtype_name],
        kv_bytes_per_token=kv_bytes_per_token(loaded.spec, kv_dtype_name),
        vocab_size=loaded.spec.vocab_size,
        graph_output_bytes=graph_output_bytes,
        utilization=config.gpu_memory_utilization,
        device=device,
    )
    logger.info("%s: %s", device, plan.describe())
    return plan


def text_side(
    config: EngineConfig, path: Path, metadata: Mapping[str, Any], spec: ModelSpec
) -> tuple[GGUFTokenizer, ChatTemplate | InvalidRequest]:
    """The tokenizer and chat template of a model file: what the frontend needs of it besides the weights
    (built again, from the file's metadata alone, beside an engine in its own process: process.py)."""
    tokenizer = tokenizer_from_gguf(metadata, pre_policy=config.model.tokenizer_pre)
    if tokenizer.vocab_size > spec.vocab_size:  # an id past the embedding would break a step
        raise InvalidModelFile(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding only "
            f"{spec.vocab_size}",
            path=str(path),
            hint="the GGUF's tokenizer and weights do not belong together",
        )
    try:
        chat_template: ChatTemplate | InvalidRequest = ChatTemplate(
            metadata.get("tokenizer.chat_template"),
            bos_token=tokenizer.id_to_piece(tokenizer.bos_token_id)
            if tokenizer.bos_token_id is not None
            else "",
            eos_token=tokenizer.id_to_piece(tokenizer.eos_token_id)
            if tokenizer.eos_token_id is not None
            else "",
            architecture=spec.architecture,
        )
    except InvalidRequest as exc:  # no usable template: completions work, chat answers this error
        chat_template = exc
    return tokenizer, chat_template


class ServedModelParts:
    """What the frontend reads of a loaded model, the same whether its engine is a thread here
    (ModelInstance) or a process of its own (process.RemoteModelInstance). Needs `loaded` (gguf, spec),
    `chat_template`, `tokenizer`."""

    loaded: Any
    chat_template: ChatTemplate | InvalidRequest
    tokenizer: GGUFTokenizer

    @functools.cached_property
    def quant_format(self) -> str:
        """The projections' GGUF type ("I2_S", "Q4_1", ...): a metrics label, one small fixed vocabulary."""
        return projection_format(self.loaded.gguf)

    @property
    def pooling(self) -> str:
        """How /v1/embeddings pools hidden states: the GGUF's pooling type, else mean."""
        metadata = self.loaded.gguf.metadata
        return pooling_from_metadata(metadata, str(metadata.get("general.architecture", "")))

    @property
    def hidden_size(self) -> int:
        return self.loaded.spec.hidden_size

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """How tool calls are written for this model: its chat template's own format, else the JSON
        convention (structured/tool_formats.py)."""
        source = None if isinstance(self.chat_template, InvalidRequest) else self.chat_template.source
        return tool_format_for(source)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Render `messages` (and `tools`, the template's own variable) with the model's chat template
        and tokenize. Raises InvalidRequest."""
        if isinstance(self.chat_template, InvalidRequest):
            raise self.chat_template
        return encode_chat(self.tokenizer, self.chat_template.render(messages, tools=tools))


@dataclass
class ModelInstance(ServedModelParts):
    name: str
    path: Path
    loaded: LoadResult
    tokenizer: GGUFTokenizer
    chat_template: ChatTemplate | InvalidRequest
    engine: Engine
    config: EngineConfig  # as given: the operator's values, never rewritten with derived ones
    max_model_len: int  # the context served: the model's own, capped by config.scheduler.max_model_len
    scheduler_config: SchedulerConfig  # the engine's resolved batch limits (derived at load)
    grammars: GrammarCompiler  # structured output: validates guides at the edge, feeds the runner

    @classmethod
    def load(cls, config: EngineConfig) -> ModelInstance:
        model_config = config.model
        if model_config.num_threads is not None:
            torch.set_num_threads(model_config.num_threads)
        path = resolve_model(model_config.model)
        device = load_device(model_config.device)
        check_speculative(config.scheduler, device)
        tuning = kernel_tuning(model_config)  # parsed once: the backend and the runner share it
        options = LoadOptions(
            backend=select_backend(
                model_config.backend,
                max_dense_weight_bytes=model_config.max_dense_weight_bytes,
                device=str(device),
                tuning=tuning,
            ),
            linear_mode=parse_linear_mode(model_config.linear_mode),
            lm_head=model_config.lm_head,
            i2s_variant=model_config.i2s_variant,
            tl_config=model_config.tl_config,
            hidden_act=model_config.hidden_act,
            tokenizer_pre=model_config.tokenizer_pre,
        )
        baseline = DeviceBaseline.now(device) if device.type == "cuda" else None
        loaded = load_model(path, options)
        try:
            instance = cls._assemble(config, path, loaded, device, tuning, baseline)
        except BaseException:
            loaded.close()
            raise
        release_freed_heap()  # the tokenizer's build temporaries (vocab dicts, parsed merges)
        return instance

    @classmethod
    def _assemble(
        cls,
        config: EngineConfig,
        path: Path,
        loaded: LoadResult,
        device: torch.device,
        tuning: KernelTuning,
        baseline: DeviceBaseline | None = None,
    ) -> ModelInstance:
        """`baseline`: the device's allocator counters before the weights loaded (CUDA only)."""
        tokenizer, chat_template = text_side(config, path, loaded.gguf.metadata, loaded.spec)
        scheduler_config = serving_limits(config, loaded.spec, loaded.gguf, device)
        max_model_len = scheduler_config.max_model_len
        memory_plan = None
        if baseline is not None and not kv_cache_is_set(config):
            memory_plan = plan_cuda_kv_bytes(config, loaded, scheduler_config, device, baseline, tuning)
        device_kv_bytes = memory_plan.kv_bytes if memory_plan is not None else None
        layout = plan_kv_cache(config, loaded.spec, scheduler_config, device, device_kv_bytes)
        runner = make_runner(
            loaded, layout, device, scheduler_config, max_model_len, model_config=config.model, tuning=tuning
        )
        if memory_plan is not None:
            log_memory_after_load(memory_plan, layout.total_bytes)
        grammars = GrammarCompiler(tokenizer, loaded.spec.vocab_size)
        runner.guided = GuidedRows(grammars)
        engine = Engine.build(runner, scheduler_config, config.cache)
        logger.info(
            "model %s ready: max_model_len %d, KV cache %s: %d tokens (%d blocks of %d, %.1f MiB %s, "
            "%d bytes a token), max_num_seqs %d, max_num_batched_tokens %d",
            path.name,
            max_model_len,
            "set" if kv_cache_is_set(config) else ("from device memory" if memory_plan else "default"),
            layout.num_usable_tokens,
            layout.num_blocks,
            layout.block_size,
            layout.total_bytes / 2**20,
            str(layout.dtype).removeprefix("torch."),
            layout.bytes_per_token,
            scheduler_config.max_num_seqs,
            scheduler_config.max_num_batched_tokens,
        )
        return cls(
            config.model.model,
            path,
            loaded,
            tokenizer,
            chat_template,
            engine,
            config,
            max_model_len,
            scheduler_config,
            grammars,
        )

    @property
    def kv_cache_bytes(self) -> int:
        return self.engine.runner.layout.total_bytes

    @property
    def kv_cache_description(self) -> dict[str, int | str]:
        """The KV pool as /health and /v1/models show it."""
        return self.engine.runner.layout.describe()

    def close(self) -> None:
        self.loaded.close()

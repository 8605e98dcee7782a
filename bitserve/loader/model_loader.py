"""Build a model from a GGUF file: parse, derive the spec, decode each tensor once into the
backend's runtime layout, and report which tensors were never used (a sign of a wrong name map)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.kernels.backend import KernelBackend, LinearMode, PreparedLinear
from bitserve.kernels.packed import (
    LOW_BIT_LAYOUTS,
    TERNARY_FILE_LAYOUTS,
    Layout,
    PackedWeight,
    ternary_codes_of,
)
from bitserve.kernels.reference.dequant import (
    dequantize,
    one_scale_ternary_codes,
    row_bytes_of,
    unpack_ternary,
)
from bitserve.loader.checkpoint_file import ModelFile, open_model_file
from bitserve.loader.decode import DecodeOptions, make_packed_weight
from bitserve.loader.host_memory import available_host_memory_bytes
from bitserve.loader.model_spec import spec_from_metadata
from bitserve.loader.requantize import quantize_q8_0
from bitserve.loader.tl_config import TLConfigTable, load_kernel_config_ini, preset, sidecar_path
from bitserve.models.architectures import ARCHITECTURES
from bitserve.models.decoder import DecoderModel
from bitserve.models.spec import ModelSpec

logger = logging.getLogger(__name__)

# an F16/BF16 LM head bigger than this stays half precision (upcast per chunk at run time)
MAX_FLOAT32_HEAD_BYTES = 512 * 1024 * 1024
FLOAT_LAYOUTS = frozenset({Layout.F32, Layout.F16, Layout.BF16})


@dataclass(frozen=True, slots=True)
class LoadOptions:
    backend: KernelBackend
    linear_mode: LinearMode = LinearMode.BITNET
    lm_head: str = "auto"  # or "q8_0": a float head quantized at load (loader/requantize.py)
    i2s_variant: str = "A"
    tl_config: str | None = None  # path to a kernel_config.ini, or "preset:<name>"
    hidden_act: str | None = None  # the FFN activation, over the file's or the evidence's (--hidden-act)
    tokenizer_pre: str | None = None  # a checkpoint directory's pre-tokenizer name, over tokenizer.json's


@dataclass
class GGUFWeightSource:
    """WeightSource over one open model file (a GGUFFile, or a checkpoint directory in its shape:
    loader/checkpoint_file.py); remembers which tensors the model consumed."""

    gguf: ModelFile
    backend: KernelBackend
    linear_mode: LinearMode
    decode_options: DecodeOptions
    lm_head: str = "auto"
    used: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)  # tensors whose pages head() gave back, read by file_rows
    dense_fallbacks: set[Layout] = field(default_factory=set)  # quantized layouts run as f32 (said once each)

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def mark_used(self, name: str) -> None:
        self.used.add(name)

    def packed(self, name: str) -> PackedWeight:
        info = self.gguf.tensors.get(name)
        if info is None:
            raise InvalidModelFile(
                f"missing tensor {name!r}",
                path=self.gguf.path,
                hint="the file does not match its architecture's tensor layout",
            )
        self.used.add(name)
        return make_packed_weight(info, self.gguf.tensor_bytes(name), options=self.decode_options)

    def vector(self, name: str) -> torch.Tensor:
        return dequantize(self.packed(name)).reshape(-1)

    def _prepare_block(self, weight: PackedWeight) -> PreparedLinear | None:
        """The backend's packed form of a block-quantized weight, or None (float, or not supported)."""
        if weight.layout in FLOAT_LAYOUTS:
            return None
        return self.backend.prepare_block(weight)

    def head(self, name: str) -> PreparedLinear | torch.Tensor:
        """The LM head: block-quantized in the backend's packed form when it has one (no float copy:
        SmolLM2's tied Q8_0 head reads 28 MB per token instead of 113 MB), else dense()."""
        weight = self.packed(name)
        if self.lm_head == "q8_0" and weight.layout in FLOAT_LAYOUTS:
            prepared = self.backend.prepare_block(quantize_q8_0(weight))
            if prepared is None:
                raise UnsupportedModel(
                    f"--lm-head q8_0 needs a backend with Q8_0 kernels; {self.backend.name!r} has none",
                    hint="use the cpu backend, or --lm-head auto",
                )
            # the float table's pages leave this process's RSS (657 MB on 2B-4T); a tied table's
            # embedding lookups then read rows from the file (file_rows)
            self.gguf.release_pages(name)
            self.released.add(name)
            return prepared
        prepared = self._prepare_block(weight)
        # pages stay resident: a tied head's table also serves embedding lookups
        return prepared if prepared is not None else self.dense(name)

    def file_rows(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """For a table whose mapped pages head() released (a tied float table under `--lm-head q8_0`):
        row ids [T] -> uint8 [T, row bytes] read from the file, so lookups keep the pages out of RSS.
        None while the table is read through the mapping."""
        if name not in self.released:
            return None
        row_bytes = row_bytes_of(self.packed(name))

        def read(row_ids: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(self.gguf.read_rows(name, row_ids.reshape(-1).tolist(), row_bytes))

        return read

    def dense(self, name: str) -> torch.Tensor:
        weight = self.packed(name)
        is_half = weight.layout in (Layout.F16, Layout.BF16)
        num_rows, num_cols = weight.shape
        if is_half and num_rows * num_cols * 4 > MAX_FLOAT32_HEAD_BYTES:
            dtype = torch.float16 if weight.layout is Layout.F16 else torch.bfloat16
            return weight.data.view(dtype).reshape(num_rows, num_cols)  # zero-copy over the mmap
        return dequantize(weight)

    def _refuse_unless_f32_fits(self, layout: Layout) -> None:
        """A layout without a packed kernel runs as f32 copies, 4 bytes a weight: on a backend that keeps
        them in host memory, refuse the load with the numbers when they cannot fit, instead of meeting the
        OOM killer halfway through."""
        if getattr(self.backend, "device", torch.device("cpu")).type != "cpu":
            return  # each copy goes to the device as it is made (its memory is the placement's concern)
        values = sum(
            info.num_elements
            for info in self.gguf.tensors.values()
            if info.ggml_type.name == layout.name and len(info.shape) == 2
        )
        available = available_host_memory_bytes()
        if available is not None and 4 * values > available:
            raise UnsupportedModel(
                f"{layout.name} projections have no packed kernel on the {self.backend.name} backend: as "
                f"f32 they take {4 * values / 1e9:.1f} GB, and {available / 1e9:.1f} GB of host memory "
                "is available",
                path=self.gguf.path,
                hint="requantize the model to Q8_0, Q4_0 or a ternary type, or load it on a larger machine",
            )

    def linear(self, name: str, *, may_be_ternary: bool) -> PreparedLinear:
        weight = self.packed(name)
        if weight.layout in TERNARY_FILE_LAYOUTS:
            in_place = self.backend.prepare_ternary_file(weight, mode=self.linear_mode)
            if in_place is not None:
                if weight.layout is not Layout.I2_S:  # transcoded into the backend's own rows
                    self.gguf.release_pages(name)
                return in_place  # I2_S reads the file's bytes: their pages stay mapped
            prepared = self.backend.prepare_ternary(unpack_ternary(weight), mode=self.linear_mode)
            # the backend holds its own runtime copy: the file's bytes need not stay resident
            self.gguf.release_pages(name)
            return prepared
        if may_be_ternary and weight.layout in LOW_BIT_LAYOUTS:
            codes = one_scale_ternary_codes(weight)
            if codes is not None:  # a BitNet model in llama.cpp's types: its I2_S kernels and numerics
                self.gguf.release_pages(name)
                return self.backend.prepare_ternary(codes, mode=self.linear_mode)
        prepared = self._prepare_block(weight)
        if prepared is not None:
            self.gguf.release_pages(name)  # the backend repacked the bytes into its own copy
            return prepared
        if weight.layout not in FLOAT_LAYOUTS and weight.layout not in self.dense_fallbacks:
            self._refuse_unless_f32_fits(weight.layout)  # before the first of them is dequantized
            self.dense_fallbacks.add(weight.layout)
            logger.warning(
                "%s projections have no packed kernel on the %s backend: dequantized to f32 at load "
                "(4 bytes a weight in memory, and f32 GEMVs)",
                weight.layout.name,
                self.backend.name,
            )
        dense = dequantize(weight)
        if may_be_ternary and weight.layout in FLOAT_LAYOUTS:
            codes = ternary_codes_of(dense)
            if codes is not None:
                return self.backend.prepare_ternary(codes, mode=self.linear_mode)
        return self.backend.prepare_dense(dense)


def tl_configs_for(path: Path, option: str | None, gguf: ModelFile) -> TLConfigTable | None:
    """The TL tile table: explicit option, else the `<model>.kernel_config.ini` sidecar, else none."""
    if option is not None and option.startswith("preset:"):
        kinds = {info.ggml_type.name.lower() for info in gguf.tensors.values()} & {"tl1", "tl2"}
        return preset(option.removeprefix("preset:"), "tl1" if "tl1" in kinds else "tl2")
    if option is not None:
        return load_kernel_config_ini(option)
    sidecar = sidecar_path(path)
    return load_kernel_config_ini(sidecar) if sidecar.exists() else None


def release_freed_heap() -> None:
    """Return freed temporaries to the OS (glibc keeps them: ~0.6 GB after a 2B model's load, ~90 MB after
    a 2B prefill step; engine/loop.py calls this after CPU prefill steps)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, looked up once (a trim may follow every prefill step); None elsewhere: nothing to trim."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@dataclass
class LoadResult:
    path: Path
    gguf: ModelFile
    spec: ModelSpec
    model: DecoderModel
    backend: KernelBackend
    linear_mode: LinearMode
    load_seconds: float
    unused_tensors: list[str]
    decode_options: DecodeOptions

    def close(self) -> None:
        self.gguf.close()


def load_model(path: str | Path, options: LoadOptions) -> LoadResult:
    """Parse and validate `path` (a GGUF file or a checkpoint directory), build its model on
    `options.backend`. Raises InvalidModelFile."""
    start = time.perf_counter()
    path = Path(path)
    gguf = open_model_file(path, i2s_variant=options.i2s_variant, tokenizer_pre=options.tokenizer_pre)
    try:
        spec = spec_from_metadata(gguf.metadata, tensor_names=set(gguf.tensors), path=str(path))
        if options.hidden_act is not None:
            spec = dataclasses.replace(
                spec, activation=options.hidden_act.lower(), activation_reason="--hidden-act"
            )
        decode_options = DecodeOptions(
            i2s_variant=options.i2s_variant, tl_configs=tl_configs_for(path, options.tl_config, gguf)
        )
        source = GGUFWeightSource(gguf, options.backend, options.linear_mode, decode_options, options.lm_head)
        with torch.inference_mode():
            model = DecoderModel(spec, ARCHITECTURES[spec.architecture], source)
        model.eval()
    except BaseException:
        gguf.close()
        raise
    release_freed_heap()
    unused = sorted(set(gguf.tensors) - source.used)
    if unused:
        logger.warning(
            "%s: %d tensors not used by the %s model: %s",
            path.name,
            len(unused),
            spec.architecture,
            unused[:8],
        )
    seconds = time.perf_counter() - start
    logger.info(
        "loaded %s (%s, %d layers, FFN activation %s: %s) in %.2f s on backend %s",
        path.name,
        spec.architecture,
        spec.num_layers,
        spec.activation,
        spec.activation_reason,
        seconds,
        options.backend.name,
    )
    return LoadResult(
        path, gguf, spec, model, options.backend, options.linear_mode, seconds, unused, decode_options
    )

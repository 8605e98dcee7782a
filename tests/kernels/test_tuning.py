"""KernelTuning (kernels/tuning.py): the one object the kernel knobs reach the backends in, built at load
from ModelConfig's fields (engine/instance.kernel_tuning)."""

from __future__ import annotations

import pytest

from bitserve.config import ModelConfig
from bitserve.engine.instance import kernel_tuning
from bitserve.kernels.tuning import DEFAULT_TUNING, parse_decode_tile, parse_gemv_tiles


def test_the_config_defaults_are_the_tuning_defaults() -> None:
    # a file by path: the catalog's own numerics (the embedded model by name runs f32) are not defaults
    assert kernel_tuning(ModelConfig(model="/models/any.gguf")) == DEFAULT_TUNING
    assert kernel_tuning(ModelConfig()).block_activations == "f32"  # the default model, by its name


def test_every_knob_reaches_the_tuning() -> None:
    config = ModelConfig(
        cpu_isa="generic",
        block_activations="f32",
        cuda_pdl=False,
        cuda_greedy_head=False,
        cuda_lookahead=False,
        cuda_lookahead_slot=False,
        cuda_gemv_tiles="3840x2560x1=8,64,2; 2560x6912x2=4,256,2",
        cuda_decode_tile="64,4,2",
    )
    tuning = kernel_tuning(config)
    assert (tuning.cpu_isa, tuning.block_activations) == ("generic", "f32")
    switches = (tuning.cuda_pdl, tuning.cuda_greedy_head, tuning.cuda_lookahead, tuning.cuda_lookahead_slot)
    assert switches == (False, False, False, False)
    assert tuning.gemv_overrides() == {(3840, 2560, 1): (8, 64, 2), (2560, 6912, 2): (4, 256, 2)}
    assert tuning.cuda_decode_tile == (64, 4, 2)
    assert tuning.requested_block_activations() == "f32"
    assert DEFAULT_TUNING.requested_block_activations() is None  # auto: the ISA decides


@pytest.mark.parametrize(
    "text", ["3840x2560=8,64,2", "3840x2560x1=8,64", "1x1x1=3,64,2", "axbxc=1,1,1", "1x1x1"]
)
def test_malformed_gemv_tiles_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="tile"):
        parse_gemv_tiles(text)


@pytest.mark.parametrize("text", ["64,4", "48,4,2", "64,3,2", "0,4,2"])
def test_malformed_decode_tiles_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="tile"):
        parse_decode_tile(text)


def test_empty_tiles_mean_the_measured_choice() -> None:
    assert parse_gemv_tiles("") == () and parse_decode_tile("  ") is None


def test_unknown_cpu_knob_values_are_refused() -> None:
    with pytest.raises(ValueError, match="cpu_isa"):
        ModelConfig(cpu_isa="sse9")
    with pytest.raises(ValueError, match="block_activations"):
        ModelConfig(block_activations="int4")

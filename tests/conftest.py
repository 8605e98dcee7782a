"""Shared fixtures: the embedded SmolLM2 file, synthetic BitNet models in every format (written with
the `gguf` writer and bitserve's own builder into a session temp dir; nothing is downloaded)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import settings

from bitserve.loader.catalog import CATALOG, DEFAULT_MODEL

# CI runs property tests with a fixed seed so a landing never depends on luck; locally they explore.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

SMOLLM2_ENTRY = CATALOG[DEFAULT_MODEL]


@pytest.fixture(scope="session", autouse=True)
def server_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Servers the tests start keep their data (the batch database) in a temp dir, not under $HOME."""
    path = tmp_path_factory.mktemp("server-data")
    os.environ["BITSERVE_DATA_DIR"] = str(path)
    return path


def _patch_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns a loop bound into an int with int(array of shape [1]), which
    NumPy >= 2.4 refuses; give its tensors an __index__ that takes the one element. Only when
    interpreting (TRITON_INTERPRET=1: the CUDA kernels' tests on a machine without a GPU)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "bitserve_patched", False):
        return

    def patched(tensor, scope) -> None:  # noqa: ANN001
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.bitserve_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    _patch_triton_interpreter()


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec(SMOLLM2_ENTRY.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_ENTRY.filename
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = smollm2_file()
    if path is None:
        pytest.skip(f"SmolLM2 is not installed ({SMOLLM2_ENTRY.install_command})")
    return path


@pytest.fixture(scope="session")
def synthetic_config():  # noqa: ANN201
    from bitserve.testing.synthetic import SyntheticConfig

    return SyntheticConfig()


# SmolLM2's tokenizer keys without its weights (benchmarks/make_gpu_models.py vocab): where the package is
# not installed (the GPU machine), synthetic models take their tokenizer from this carried file
CARRIED_VOCAB = Path(__file__).resolve().parent.parent / ".carry" / "smollm2-vocab.gguf"


@pytest.fixture(scope="session")
def tokenizer_source() -> Path:
    """A GGUF holding SmolLM2's tokenizer: the package's file, else the carried vocab-only file."""
    path = smollm2_file()
    if path is not None:
        return path
    if CARRIED_VOCAB.is_file():
        return CARRIED_VOCAB
    pytest.skip(f"SmolLM2 is not installed ({SMOLLM2_ENTRY.install_command})")


@pytest.fixture(scope="session")
def synthetic_weights(tokenizer_source: Path, synthetic_config):  # noqa: ANN001, ANN201
    from bitserve.testing.synthetic import make_weights, tokenizer_metadata

    tokenizer = tokenizer_metadata(tokenizer_source)
    return tokenizer, make_weights(synthetic_config, len(tokenizer["tokenizer.ggml.tokens"][1]))


@pytest.fixture(scope="session")
def synthetic_models(
    tmp_path_factory: pytest.TempPathFactory, synthetic_config, synthetic_weights
) -> dict[str, Path]:  # noqa: ANN001
    """The same random ternary BitNet model stored as F32, TQ1_0, TQ2_0, I2_S, TL1 and TL2."""
    from bitserve.testing.synthetic import FORMATS, write_synthetic_model

    folder = tmp_path_factory.mktemp("synthetic")
    tokenizer, weights = synthetic_weights
    return {
        fmt: write_synthetic_model(
            folder / f"bitnet-{fmt}.gguf", fmt, config=synthetic_config, weights=weights, tokenizer=tokenizer
        )
        for fmt in FORMATS
    }


@pytest.fixture(scope="session")
def b158_file(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    """A small bitnet-b1.58 I2_S file (relu2, sub-norms, GQA, no output scales), written with the 2B-4T
    writer from the tokenizer the session has (the package's or the carried one)."""
    from benchmarks.make_2b4t_model import write_2b4t_model
    from bitserve.testing.synthetic import SyntheticConfig

    config = SyntheticConfig(num_kv_heads=2, architecture="bitnet-b1.58")  # 2 layers, 256 wide, 4 heads: GQA
    path = tmp_path_factory.mktemp("b158") / "b158-i2s.gguf"
    return write_2b4t_model(path, "I2_S", tokenizer_source=tokenizer_source, config=config)


@pytest.fixture(scope="session")
def hf_gguf(tokenizer_source: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """get(arch "llama" | "qwen2" | "qwen3", weight_type "F32" | "Q8_0" | "Q1_0" | "Q2_0") -> (a random-init
    transformers model with SmolLM2's vocabulary, its checkpoint converted to GGUF by loader/hf_convert.py);
    each made once a session (bitserve/testing/hf_checkpoints.hf_gguf_case: the same files the golden
    fixtures were made from)."""
    pytest.importorskip("transformers")
    from bitserve.testing.hf_checkpoints import hf_gguf_case

    folder = tmp_path_factory.mktemp("hf-gguf")
    made: dict[tuple[str, str], tuple] = {}

    def get(arch: str, weight_type: str = "F32") -> tuple:
        if (arch, weight_type) not in made:
            made[(arch, weight_type)] = hf_gguf_case(arch, weight_type, tokenizer_source, folder)
        return made[(arch, weight_type)]

    return get


@pytest.fixture(scope="session")
def hf_checkpoint_dir(tokenizer_source: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """get(arch, bitnet_layout) -> (transformers' reference model, the random-init checkpoint written as a
    Hugging Face directory: bitserve/testing/hf_checkpoints.save_checkpoint_dir), each made once a session."""
    pytest.importorskip("transformers")
    from bitserve.loader.gguf_reader import read_gguf
    from bitserve.testing.hf_checkpoints import bitnet_reference, random_checkpoint, save_checkpoint_dir

    with read_gguf(tokenizer_source) as gguf:
        vocab_size = len(gguf.metadata["tokenizer.ggml.tokens"])
    made: dict[tuple[str, str | None], tuple] = {}

    def get(arch: str, layout: str | None) -> tuple:
        if (arch, layout) not in made:
            # ternary 256 wide: every projection whole TQ2_0 blocks (and I2_S ones)
            model = random_checkpoint(arch, vocab_size, width=256 if layout else None)
            folder = tmp_path_factory.mktemp(f"{arch}-{layout or 'float'}")
            save_checkpoint_dir(model, folder, tokenizer_source, bitnet_layout=layout)
            reference = bitnet_reference(model, layout) if layout else model
            made[(arch, layout)] = (reference, folder)
        return made[(arch, layout)]

    return get

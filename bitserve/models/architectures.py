"""`general.architecture` -> its recipe (models/recipe.py). A dict, not an if-chain: the only list of
supported architectures (loader/model_spec.py reads each one's traits from it)."""

from __future__ import annotations

from bitserve.models.bitnet import BITNET, BITNET_B158
from bitserve.models.gemma import GEMMA3
from bitserve.models.llama import LLAMA
from bitserve.models.minicpm import MINICPM
from bitserve.models.qwen import QWEN2, QWEN3
from bitserve.models.recipe import ArchitectureRecipe

ARCHITECTURES: dict[str, ArchitectureRecipe] = {
    "llama": LLAMA,
    "bitnet": BITNET,
    "bitnet-b1.58": BITNET_B158,
    "bitnet-25": BITNET_B158,
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "gemma3": GEMMA3,
    "minicpm": MINICPM,
}

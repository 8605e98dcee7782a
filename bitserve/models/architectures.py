"""`general.architecture` -> model class. A dict, not an if-chain; model_spec.py knows each arch's traits."""

from __future__ import annotations

from bitserve.models.bitnet import BitNetForCausalLM
from bitserve.models.decoder import DecoderModel
from bitserve.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[DecoderModel]] = {
    "llama": LlamaForCausalLM,
    "bitnet": BitNetForCausalLM,
    "bitnet-b1.58": BitNetForCausalLM,
    "bitnet-25": BitNetForCausalLM,
}

"""Sentence embeddings from the loaded model: a plain forward of each input (no sampling, not the served KV
cache: the module forward's full-sequence path from position 0, which the engine tests hold equal to the
paged path, or on CUDA the compiled forward over a temporary cache), pooled and L2-normalised. Called on
the engine thread, between steps, so it never races a step for the model; the paged KV cache is not
touched, so running requests are unaffected.

Pooling: the GGUF's `{arch}.pooling_type` (llama.cpp's enum) when it names mean, CLS (first token)
or last-token pooling; otherwise (none, rank, absent) mean pooling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from bitserve.models.decoder import DecoderModel

MEAN, CLS, LAST = "mean", "cls", "last"
POOLING_TYPES = {1: MEAN, 2: CLS, 3: LAST}  # llama.cpp's LLAMA_POOLING_TYPE_* values


def pooling_from_metadata(metadata: dict[str, object], architecture: str) -> str:
    value = metadata.get(f"{architecture}.pooling_type")
    return POOLING_TYPES.get(value, MEAN) if isinstance(value, int) else MEAN


def pool(hidden_states: torch.Tensor, pooling: str) -> torch.Tensor:
    """[num_tokens, hidden] -> [hidden] float32."""
    if pooling == CLS:
        return hidden_states[0].float()
    if pooling == LAST:
        return hidden_states[-1].float()
    return hidden_states.float().mean(dim=0)


def normalize(vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """Truncate to `dimensions` (Matryoshka-style) and L2-normalise (a zero vector stays zero)."""
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0)


SequenceForward = Callable[[torch.Tensor], torch.Tensor]  # input_ids int64 [T] -> hidden [T, hidden]


def module_forward(model: DecoderModel) -> SequenceForward:
    """The module forward of one sequence from position 0, no KV cache."""
    return lambda input_ids: model(input_ids, torch.arange(input_ids.shape[0], dtype=torch.long))


@torch.inference_mode()
def embed(
    forward: SequenceForward, inputs: Sequence[Sequence[int]], pooling: str, dimensions: int | None
) -> list[list[float]]:
    """One normalised vector per input (token ids, each within the served context)."""
    vectors = []
    for token_ids in inputs:
        hidden_states = forward(torch.tensor(list(token_ids), dtype=torch.long)).cpu()
        vectors.append(normalize(pool(hidden_states, pooling), dimensions).tolist())
    return vectors

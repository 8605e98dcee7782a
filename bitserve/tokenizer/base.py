"""The Tokenizer protocol: what the server, frontend and offline LLM need from a tokenizer.

Plain Python; imports nothing heavy. Implementations live beside it (gguf_vocab.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from typing import Protocol, runtime_checkable


class TokenType(IntEnum):
    """GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids for one model.

    Invariants every implementation keeps:
    - `decode(ids, skip_special=s)` is the UTF-8 decoding (invalid bytes -> U+FFFD) of the
      concatenation of `token_bytes(i, skip_special=s)` over `ids`; nothing is stripped or
      re-spaced, so streamed deltas can always add up to the full decode.
    - `eos_token_ids` holds every end-of-generation id (eos, eot, eom, ...), never None.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def add_bos(self) -> bool: ...

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`.

        add_special: add BOS (and EOS) as the vocabulary asks (`add_bos` / `add_eos`).
        parse_special: match control tokens written in the text (e.g. `<|im_start|>`) as single
        tokens; user-defined tokens are always matched, as in llama.cpp.
        """
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text for `token_ids`; with skip_special, control and unknown tokens print nothing."""
        ...

    def token_bytes(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """Raw bytes `token_id` contributes to decoded text (b"" for a skipped special token)."""
        ...

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry for `token_id` exactly as stored (e.g. `Ġthe`, `▁the`, `<0x0A>`)."""
        ...

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens: the ones `skip_special` hides."""
        ...

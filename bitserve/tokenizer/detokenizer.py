"""IncrementalDetokenizer: generated token ids -> text deltas, never splitting a UTF-8 character.

Used by the frontend's OutputProcessor and the offline LLM; knows only the Tokenizer protocol.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from bitserve.tokenizer.base import Tokenizer


class IncrementalDetokenizer:
    """Decodes one request's generated tokens as they arrive.

    A token's bytes may end inside a multi-byte character (byte-level BPE splits emoji and CJK);
    those bytes are held back until the character completes, and flushed as U+FFFD by `finish()`
    if it never does. Invariant: the deltas returned by `add_token` / `add_tokens` plus `finish()`
    concatenate to exactly `tokenizer.decode(all_ids, skip_special=skip_special)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text_parts: list[str] = []
        self._num_tokens = 0
        self._is_finished = False

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_pending_bytes(self) -> int:
        """Bytes held back because they end in an incomplete character."""
        pending, _ = self._decoder.getstate()
        return len(pending)

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded until they complete)."""
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def add_token(self, token_id: int) -> str:
        """Feed one token id; returns the newly completed text ("" while a character is pending)."""
        if self._is_finished:
            raise RuntimeError("IncrementalDetokenizer.add_token after finish()")
        data = self._tokenizer.token_bytes(token_id, skip_special=self._skip_special)
        self._num_tokens += 1
        delta = self._decoder.decode(data, final=False)
        if delta:
            self._text_parts.append(delta)
        return delta

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Feed several token ids (e.g. one engine step's output); returns their combined delta."""
        return "".join([self.add_token(token_id) for token_id in token_ids])

    def finish(self) -> str:
        """End of the sequence: flush held-back bytes (as U+FFFD, being incomplete). Idempotent."""
        if self._is_finished:
            return ""
        self._is_finished = True
        delta = self._decoder.decode(b"", final=True)
        if delta:
            self._text_parts.append(delta)
        return delta

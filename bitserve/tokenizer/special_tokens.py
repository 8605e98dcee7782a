"""Splits text around special tokens written in it, exactly as llama.cpp's tokenizer_st_partition.

llama.cpp takes special tokens longest first and cuts every non-overlapping occurrence out of the
text still unclaimed, left to right. Plain Python; no tokenizer library involved.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# A fragment of partitioned text: raw text to tokenize, or the id of a matched special token.
Fragment = str | int


class SpecialTokenMatcher:
    """Finds special tokens in text. Control tokens match only when asked (`parse_special`);
    user-defined tokens always match, as in llama.cpp (and HF tokenizers)."""

    def __init__(self, entries: Iterable[tuple[str, int, bool]]) -> None:
        """entries: (token text, token id, is_control) for each special token; texts are non-empty."""
        # text -> token id << 1 | is_control: one int per entry, not a tuple (a vocabulary may hold ~10^5
        # special tokens: 14 MB of tuples and ranks on the 2B-4T benchmark file)
        self._lookup: dict[str, int] = {}
        lengths_by_first: dict[str, set[int]] = {}
        for text, token_id, is_control in entries:
            self._lookup[text] = token_id << 1 | is_control
            lengths_by_first.setdefault(text[0], set()).add(len(text))
        # Per first character, the token lengths to try at a position starting with it.
        self._lengths_by_first = {ch: tuple(sorted(lengths)) for ch, lengths in lengths_by_first.items()}
        # Finds the positions worth checking: those holding the first character of some token.
        first_chars = "".join(re.escape(ch) for ch in sorted(lengths_by_first))
        self._first_char_pattern = re.compile(f"[{first_chars}]") if first_chars else None

    @property
    def num_tokens(self) -> int:
        return len(self._lookup)

    def split(self, text: str, *, parse_special: bool) -> list[Fragment]:
        """`text` as raw-text fragments and special token ids, in order; [] for empty text."""
        if not text:
            return []
        if self._first_char_pattern is None:
            return [text]
        occurrences = self._find_occurrences(text, parse_special)
        if not occurrences:
            return [text]
        # llama.cpp's order: longer tokens claim text first (ties: lower id; llama.cpp leaves ties
        # unspecified, and only overlapping distinct tokens of equal length could tell them apart).
        order = sorted(occurrences, key=self._rank)
        # (start, end, token id or -1 for raw text), covering the text in order.
        spans: list[tuple[int, int, int]] = [(0, len(text), -1)]
        for token_text in order:
            spans = self._claim(
                spans, occurrences[token_text], len(token_text), self._lookup[token_text] >> 1
            )
        return [text[start:end] if token_id < 0 else token_id for start, end, token_id in spans]

    def _rank(self, text: str) -> tuple[int, int]:
        """Sort key: llama.cpp orders by UTF-8 byte length (which can differ from the character count),
        longest first; then by id."""
        return -len(text.encode("utf-8", "surrogatepass")), self._lookup[text] >> 1

    def _find_occurrences(self, text: str, parse_special: bool) -> dict[str, list[int]]:
        """Token text -> sorted start positions of every (possibly overlapping) occurrence."""
        occurrences: dict[str, list[int]] = {}
        assert self._first_char_pattern is not None  # split() returns early without special tokens
        lengths_by_first = self._lengths_by_first
        lookup = self._lookup
        for match in self._first_char_pattern.finditer(text):
            start = match.start()
            for length in lengths_by_first[match.group()]:
                candidate = text[start : start + length]
                entry = lookup.get(candidate)
                if entry is not None and (parse_special or not entry & 1):
                    occurrences.setdefault(candidate, []).append(start)
        return occurrences

    @staticmethod
    def _claim(
        spans: list[tuple[int, int, int]], positions: list[int], length: int, token_id: int
    ) -> list[tuple[int, int, int]]:
        """Cut each occurrence lying wholly inside a raw span out of it, left to right, skipping
        occurrences that overlap one already taken (llama.cpp resumes its search after a match)."""
        result: list[tuple[int, int, int]] = []
        next_position = 0
        for start, end, span_token in spans:
            if span_token >= 0:
                result.append((start, end, span_token))
                continue
            cursor = start
            while next_position < len(positions) and positions[next_position] < end:
                position = positions[next_position]
                next_position += 1
                if position < cursor or position + length > end:
                    continue
                if position > cursor:
                    result.append((cursor, position, -1))
                result.append((position, position + length, token_id))
                cursor = position + length
            if cursor < end:
                result.append((cursor, end, -1))
        return result

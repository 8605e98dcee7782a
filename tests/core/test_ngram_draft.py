"""The n-gram (prompt lookup) drafter: longest suffix match, most recent occurrence, its continuation,
token-aligned matches only, the bounded search window, and the adaptive draft length."""

from __future__ import annotations

import random
from array import array

import pytest

from bitserve.core.ngram_draft import MAX_PAUSE_STEPS, NGRAM_MAX, NGRAM_MIN, DraftState, find_drafts


def packed(token_ids: list[int]) -> bytes:
    return array("I", token_ids).tobytes()


def reference_drafts(tokens: list[int], num_drafts: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Brute force: the longest suffix with an earlier occurrence, its latest one, what followed it (the
    drafts themselves continuing where the sequence ends)."""
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # occurrences that end before the last token
            if tokens[start : start + n] == suffix:
                sequence = list(tokens)
                first = start + n
                drafts: list[int] = []
                while len(drafts) < num_drafts:
                    drafts.append(sequence[first + len(drafts)])
                    sequence.append(drafts[-1])
                return drafts
    return []


def test_the_defaults_are_suffixes_of_three_down_to_two_tokens() -> None:
    assert (NGRAM_MAX, NGRAM_MIN) == (3, 2)
    assert find_drafts(packed([5, 6, 9, 5]), 2) == []  # a one-token match is not used by default
    assert find_drafts(packed([5, 6, 9, 5]), 2, ngram_min=1) == [6, 9]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    # suffix "1 2 3": occurred at the start (followed by 40 41); "2 3" alone occurred later (followed by 99)
    tokens = [1, 2, 3, 40, 41, 7, 2, 3, 99, 8, 1, 2, 3]
    assert find_drafts(packed(tokens), 2) == [40, 41]


def test_the_most_recent_occurrence_wins() -> None:
    tokens = [5, 6, 10, 11, 5, 6, 20, 21, 9, 5, 6]
    assert find_drafts(packed(tokens), 2) == [20, 21]


def test_no_earlier_occurrence_gives_no_drafts() -> None:
    assert find_drafts(packed([1, 2, 3, 4, 5]), 4) == []
    assert find_drafts(packed([7]), 4) == []
    assert find_drafts(packed([1, 2, 1]), 0) == []


def test_a_continuation_reaching_the_end_repeats_the_period() -> None:
    # "a b a b": the latest earlier "a b" ends two tokens back: its continuation is "a b", then the drafts
    assert find_drafts(packed([8, 9, 8, 9]), 5) == [8, 9, 8, 9, 8]
    assert find_drafts(packed([4, 4]), 3, ngram_min=1) == [4, 4, 4]


def test_a_match_across_token_boundaries_is_not_a_match() -> None:
    # bytes of 0x01020300, 0x00000004 are 00 03 02 01 | 04 00 00 00: offset 1 reads as 0x04010203
    tokens = [0x01020300, 0x00000004, 77, 0x04010203]
    assert find_drafts(packed(tokens), 3, ngram_min=1) == []
    tokens = [0x04010203, 55, 0x01020300, 0x00000004, 77, 0x04010203]  # an aligned one further back
    assert find_drafts(packed(tokens), 2, ngram_min=1) == [55, 0x01020300]


def test_the_search_window_bounds_the_work() -> None:
    tokens = [1, 2, 3, 50, 51] + list(range(100, 200)) + [1, 2, 3]
    assert find_drafts(packed(tokens), 2) == [50, 51]
    assert find_drafts(packed(tokens), 2, scan_tokens=50) == []


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_brute_force_reference(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        vocab = rng.choice([2, 3, 5, 50, 70000])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        num_drafts = rng.randrange(1, 8)
        ngram_min = rng.choice([1, 2, 3])
        ngram_max = rng.choice([ngram_min, 3, 5])
        expected = reference_drafts(tokens, num_drafts, ngram_max, ngram_min)
        got = find_drafts(packed(tokens), num_drafts, ngram_max=ngram_max, ngram_min=ngram_min)
        assert got == expected, (tokens, ngram_min, ngram_max)


def test_state_packs_incrementally_and_proposes_within_the_limit() -> None:
    state = DraftState(max_drafts=4)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert state.propose(tokens, limit=10) == [3, 4, 5, 6]
    assert state.propose(tokens, limit=2) == [3, 4]
    tokens += [3, 9]  # appended: only the new ids are packed
    assert state.propose(tokens, limit=10) == []
    assert bytes(state.packed) == packed(tokens)


def test_draft_length_adapts_to_acceptance() -> None:
    state = DraftState(max_drafts=6)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert len(state.propose(tokens, 99)) == 6
    state.record(6, 2)  # partial: the accepted run plus one
    assert len(state.propose(tokens, 99)) == 3
    state.record(3, 3)  # all accepted: one longer
    assert len(state.propose(tokens, 99)) == 4
    state.record(4, 0)  # none: down to one draft
    assert len(state.propose(tokens, 99)) == 1
    assert (state.num_drafted, state.num_accepted) == (13, 5)


def test_drafting_pauses_after_misses_and_resumes_after_a_hit() -> None:
    state = DraftState(max_drafts=4)
    tokens = [1, 2, 3, 4, 1, 2]
    state.record(4, 0)
    pauses = []
    for _ in range(7):
        state.record(1, 0)  # a miss at length 1: pause 1, 2, 4, ... steps
        pauses.append(state.num_paused)
        for _ in range(state.num_paused):
            assert state.propose(tokens, 99) == []
        assert state.propose(tokens, 99) == [3]
    assert pauses == [1, 2, 4, 8, 16, 32, MAX_PAUSE_STEPS]
    state.record(1, 1)
    assert state.pause_steps == 0 and state.draft_len == 2
    state.record(2, 0)
    state.record(1, 0)
    assert state.num_paused == 1  # the backoff starts over after a hit

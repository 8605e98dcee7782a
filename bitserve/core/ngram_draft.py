"""Prompt-lookup drafting (n-gram speculation): the next tokens of a sequence guessed from its own past.

For a sequence t_0 .. t_{L-1}, find the longest suffix n-gram (n from NGRAM_MAX down to NGRAM_MIN) that
also occurs earlier, take its most recent earlier occurrence, and propose the tokens that followed it.
Text that copies from its prompt (repeat, fix the typos in, edit this code) continues as the prompt did,
so the drafts are often right; the runner verifies them all in one step (runner/speculative.py).

Defaults: vLLM's ngram method uses n = 5..5 (its source: "arbitrarily chosen"), llama.cpp's lookup
n = 1..4; here n = 3..2. A one-token match is mostly chance (a common word seen before): replaying
SmolLM2's greedy answers to benchmarks/bench_speculative.py's prompts through this drafter, 3..1 drafts
were accepted 66% (copying answers) / 40% (open chat) of the time, 3..2 75% / 55%, and priced with the
measured cost of verify rows 3..2 came out ahead on both (1.28x / 1.05x against 1.22x / 1.01x); 5..3
accepted more but drafted too rarely (benchmarks/RESULTS.md, "Speculative decoding"). A wrong guess only
costs its verify rows, and `DraftState` stops guessing for a request whose guesses keep missing.

Pure Python, no torch: the scheduler drafts while it plans a step. Bounded work per call: the tokens are
kept packed as uint32 (4 bytes each, appended incrementally) and searched with bytearray.rfind, in C, over
the last SCAN_TOKENS tokens only: ~5 us per call at 4096 tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

NGRAM_MAX = 3
NGRAM_MIN = 2
SCAN_TOKENS = 4096  # the search window: the most recent tokens only, so a call costs the same at any length
MAX_PAUSE_STEPS = 32  # longest a request goes without drafts after its guesses missed (doubles per miss)
_ITEM = 4  # bytes per packed token id
assert array("I").itemsize == _ITEM, "array('I') must hold 32-bit ids on this platform"


def find_drafts(
    packed: bytes | bytearray,
    num_drafts: int,
    *,
    ngram_max: int = NGRAM_MAX,
    ngram_min: int = NGRAM_MIN,
    scan_tokens: int = SCAN_TOKENS,
) -> list[int]:
    """Up to `num_drafts` tokens guessed to follow the sequence `packed` (its ids as uint32, native
    order); [] when no suffix of ngram_min..ngram_max tokens occurred earlier in the window."""
    num_tokens = len(packed) // _ITEM
    if num_drafts < 1 or num_tokens < 2:
        return []
    lowest = max(0, num_tokens - scan_tokens) * _ITEM
    for n in range(min(ngram_max, num_tokens - 1), ngram_min - 1, -1):
        pattern = bytes(packed[-n * _ITEM :])
        # an earlier occurrence ends before the last token, i.e. within bytes [lowest, (L - 1) * 4)
        end = (num_tokens - 1) * _ITEM
        while (found := packed.rfind(pattern, lowest, end)) >= 0:
            if found % _ITEM == 0:  # a match across token boundaries is no match: look further back
                return _continuation(packed, found // _ITEM + n, num_drafts)
            end = found + len(pattern) - 1
    return []


def _continuation(packed: bytes | bytearray, start: int, num_drafts: int) -> list[int]:
    """The `num_drafts` tokens from position `start` on; where they run into the sequence's end they go on
    with the drafts themselves (a period shorter than num_drafts repeats: "ab ab ab" drafts "ab ab")."""
    num_tokens = len(packed) // _ITEM
    ids = array("I")
    ids.frombytes(packed[start * _ITEM : (start + num_drafts) * _ITEM])
    drafts = ids.tolist()
    period = num_tokens - start
    while len(drafts) < num_drafts:
        drafts.append(drafts[len(drafts) - period])
    return drafts


class DraftState:
    """One request's drafter: its tokens packed for the search, and how many drafts it should try.

    Adaptive length: a step that accepted every draft lengthens the next guess by one (up to the
    configured most); one that rejected some shortens it to the accepted run plus one; a step that
    accepted none at length 1 pauses drafting for a while (1, 2, 4 ... MAX_PAUSE_STEPS decode steps),
    so a request whose text matches nothing runs plain one-token steps.
    """

    __slots__ = (
        "packed",
        "max_drafts",
        "draft_len",
        "pause_steps",
        "num_paused",
        "num_drafted",
        "num_accepted",
    )

    def __init__(self, max_drafts: int) -> None:
        self.packed = bytearray()
        self.max_drafts = max_drafts
        self.draft_len = max_drafts
        self.pause_steps = 0  # the next pause's length (0: none yet)
        self.num_paused = 0  # decode steps left without drafts
        self.num_drafted = 0
        self.num_accepted = 0

    def propose(self, token_ids: Sequence[int], limit: int) -> list[int]:
        """Drafts to follow `token_ids` (the request's whole sequence, which only ever grows), at most
        `limit` (the caller's caps: budget, max_tokens, context) and the adaptive length."""
        if self.num_paused > 0:
            self.num_paused -= 1
            return []
        num_packed = len(self.packed) // _ITEM
        if num_packed > len(token_ids):  # never expected (tokens are only appended): start over
            self.packed.clear()
            num_packed = 0
        if num_packed < len(token_ids):
            self.packed += array("I", token_ids[num_packed:]).tobytes()
        return find_drafts(self.packed, min(limit, self.draft_len))

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """The verify step's result for this request: `num_accepted` of its `num_drafted` drafts held."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if num_accepted == num_drafted:
            self.draft_len = min(self.max_drafts, self.draft_len + 1)
            self.pause_steps = 0
        elif num_accepted > 0:
            self.draft_len = num_accepted + 1
            self.pause_steps = 0
        elif self.draft_len > 1:
            self.draft_len = 1
        else:
            self.pause_steps = min(MAX_PAUSE_STEPS, max(1, 2 * self.pause_steps))
            self.num_paused = self.pause_steps

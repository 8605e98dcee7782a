"""The content filter's rules and hold-back window, as units: a banned phrase split at every point across
deltas is never emitted, clean text comes out unchanged and complete, a stream gets the same text as the
whole answer, and prompts that match are refused without echoing the rule."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bitserve.errors import RequestRefused
from bitserve.server.plugins.base import OutputContext, RequestContext
from bitserve.server.plugins.config import PluginConfig
from bitserve.server.plugins.content_filter import (
    REDACTION,
    ContentFilter,
    HoldBackFilter,
    Matcher,
    parse_rules,
)
from bitserve.server.protocol import ChatCompletionRequest

PHRASE = "vast, unforgiving"
RULES = f"# rules\n{PHRASE}\n\nre:fabric of \\w+\nforbidden topic\n"
MAX_PATTERN_CHARS = 24
CLEAN = "The sea is a calm and gentle place where the boundaries shift with the tide. " * 3


def matcher(rules: str = RULES) -> Matcher:
    return Matcher(parse_rules(rules, MAX_PATTERN_CHARS))


def streamed(deltas: list[str], rules: str = RULES) -> list[str]:
    hold_back = HoldBackFilter(matcher(rules))
    return [hold_back.feed(delta) for delta in deltas] + [hold_back.flush()]


def split_at(text: str, points: list[int]) -> list[str]:
    bounds = [0, *sorted(points), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_a_phrase_split_at_every_point_is_never_emitted() -> None:
    prefix, suffix = "The sea is a ", ", and the sky is grey."
    text = prefix + PHRASE.upper() + suffix  # case-insensitive
    start = len(prefix)
    for first in range(start, start + len(PHRASE) + 1):
        for second in range(first, start + len(PHRASE) + 1):
            # the phrase alone: the window is exactly its length, so any shorter hold-back would leak
            out = streamed(split_at(text, [first, second]), PHRASE)
            joined = "".join(out)
            # exactly the text with the match replaced: no fragment of the phrase went out before it
            assert joined == prefix + REDACTION + suffix, (first, second)
            assert not any("unforg" in piece.lower() or "vast," in piece.lower() for piece in out)


def test_one_character_at_a_time_and_random_splits() -> None:
    text = f"Once {PHRASE} and the very fabric of reality, then {PHRASE} again."
    expected = f"Once {REDACTION} and the very {REDACTION}, then {REDACTION} again."
    assert "".join(streamed(list(text))) == expected
    rng = random.Random(0)
    for _ in range(200):
        points = rng.sample(range(1, len(text)), rng.randint(1, 12))
        assert "".join(streamed(split_at(text, points))) == expected
        assert matcher().redact(text)[0] == expected  # the whole answer gets the same text


def test_clean_text_is_emitted_unchanged_complete_and_held_back_no_more_than_the_window() -> None:
    rng = random.Random(1)
    window = matcher().window
    assert window == MAX_PATTERN_CHARS  # longer than every phrase here
    for _ in range(50):
        deltas = split_at(CLEAN, rng.sample(range(1, len(CLEAN)), 20))
        hold_back = HoldBackFilter(matcher())
        fed = emitted = 0
        for delta in deltas:
            fed += len(delta)
            emitted += len(hold_back.feed(delta))
            assert fed - emitted <= window - 1  # released as soon as no match can still include it
        assert emitted + len(hold_back.flush()) == len(CLEAN)
    assert "".join(streamed(split_at(CLEAN, [5, 30, 31]))) == CLEAN


def test_regex_context_reaches_back_across_releases() -> None:
    # \b needs the character before the match, which an earlier delta already released
    rules = "re:\\bcat\\b"
    text = "concatenate the cat and a bobcat"
    expected = f"concatenate the {REDACTION} and a bobcat"
    for point in range(1, len(text)):
        assert "".join(streamed(split_at(text, [point]), rules)) == expected
    assert "".join(streamed(list(text), rules)) == expected
    # a look-behind of several characters, one character a delta: the context outlives several releases
    text = "the cat and a hat cat, the cat"
    expected = f"the {REDACTION} and a hat cat, the {REDACTION}"
    assert "".join(streamed(list(text), "re:(?<=the )cat")) == expected


def reference_redaction(text: str, phrases: list[str]) -> str:
    """Leftmost, then longest, phrase match, case-insensitively, by brute force."""
    out, pos, lowered = [], 0, text.lower()
    while pos < len(text):
        found = [p for p in phrases if lowered.startswith(p.lower(), pos)]
        if found:
            out.append(REDACTION)
            pos += max(len(p) for p in found)
        else:
            out.append(text[pos])
            pos += 1
    return "".join(out)


def test_the_phrase_trie_matches_like_a_brute_force_search() -> None:
    rng = random.Random(2)
    for _ in range(300):
        phrases = list({"".join(rng.choices("abAB ", k=rng.randint(1, 5))).strip() or "a" for _ in range(6)})
        text = "".join(rng.choices("abAB c", k=40))
        rules = "\n".join(phrases)
        assert matcher(rules).redact(text)[0] == reference_redaction(text, phrases), (phrases, text)
        points = rng.sample(range(1, len(text)), 5)
        assert "".join(streamed(split_at(text, points), rules)) == reference_redaction(text, phrases)


def test_rules_file_errors_name_the_line() -> None:
    with pytest.raises(ValueError, match="line 2: not a valid regular expression"):
        parse_rules("ok\nre:(unclosed\n", 8)
    with pytest.raises(ValueError, match="line 1: the pattern matches the empty string"):
        parse_rules("re:a*\n", 8)
    with pytest.raises(ValueError, match="no rules"):
        parse_rules("# only a comment\n\n", 8)
    rules = parse_rules("  Spaced Phrase  \nre:x+\n", 8)
    assert [(rule.kind, rule.line, rule.max_chars) for rule in rules] == [
        ("phrase", 1, 13),
        ("pattern", 2, 8),
    ]


class Decoder:
    def decode(self, token_ids: list[int]) -> str:
        return "decoded " + " ".join(str(token_id) for token_id in token_ids)


def chat_context(content: str) -> RequestContext:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": content}]})
    return RequestContext("chatcmpl", "model", body, Decoder())  # type: ignore[arg-type]


def content_filter(tmp_path: Path) -> ContentFilter:
    rules = tmp_path / "rules.txt"
    rules.write_text(RULES, encoding="utf-8")
    return ContentFilter(PluginConfig(content_filter_rules=str(rules), content_filter_max_match_chars=24))


def test_a_matching_prompt_is_refused_without_echoing_the_rule(tmp_path: Path) -> None:
    plugin = content_filter(tmp_path)
    assert plugin.pre_inference(chat_context("Tell me a story about the sea.")) is None
    for prompt, kind in (
        ("Tell me about the Forbidden Topic.", "phrase"),
        ("the fabric of space", "pattern"),
    ):
        with pytest.raises(RequestRefused, match=f"blocked {kind}") as refused:
            plugin.pre_inference(chat_context(prompt))
        assert "forbidden" not in str(refused.value).lower() and "fabric" not in str(refused.value)


def test_whole_outputs_are_redacted_and_a_missing_rules_file_fails_the_start(tmp_path: Path) -> None:
    plugin = content_filter(tmp_path)
    context = OutputContext(chat_context("hi"), 0)
    assert plugin.post_inference(context, f"a {PHRASE}!") == f"a {REDACTION}!"
    with pytest.raises(ValueError, match="rules file"):
        ContentFilter(PluginConfig())
    with pytest.raises(OSError):
        ContentFilter(PluginConfig(content_filter_rules=str(tmp_path / "missing.txt")))

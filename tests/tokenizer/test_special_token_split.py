"""SpecialTokenMatcher reproduces llama.cpp's tokenizer_st_partition, including its quirks."""

from __future__ import annotations

from bitserve.tokenizer.special_tokens import SpecialTokenMatcher

# (text, id, is_control)
ENTRIES = [("<a>", 10, True), ("<a><b>", 11, True), ("a>b>", 12, True), ("<u>", 20, False), ("ééé", 30, True)]


def test_no_special_tokens_leaves_text_whole() -> None:
    matcher = SpecialTokenMatcher(ENTRIES)
    assert matcher.split("", parse_special=True) == []
    assert matcher.split("plain text", parse_special=True) == ["plain text"]
    assert SpecialTokenMatcher([]).split("<a>", parse_special=True) == ["<a>"]


def test_every_occurrence_is_cut_out_in_order() -> None:
    matcher = SpecialTokenMatcher(ENTRIES)
    assert matcher.split("x<a>y<a><a>", parse_special=True) == ["x", 10, "y", 10, 10]


def test_longer_tokens_claim_text_first_even_when_they_start_later() -> None:
    """llama.cpp processes tokens longest first: in "<a>b>" the 4-char "a>b>" wins over the
    leftmost "<a>" (a leftmost-longest matcher such as HF's would pick "<a>" instead)."""
    matcher = SpecialTokenMatcher(ENTRIES)
    assert matcher.split("<a>b>", parse_special=True) == ["<", 12]
    assert matcher.split("<a><b>", parse_special=True) == [11]


def test_order_uses_utf8_byte_length() -> None:
    """ "ééé" is 3 characters but 6 bytes, so it outranks the 4-byte "a>b>" in llama.cpp."""
    matcher = SpecialTokenMatcher([("ééa>", 40, True), ("a>b>", 12, True)])
    assert matcher.split("ééa>b>", parse_special=True) == [40, "b>"]


def test_control_tokens_need_parse_special_but_user_defined_do_not() -> None:
    matcher = SpecialTokenMatcher(ENTRIES)
    assert matcher.split("<a> <u>", parse_special=False) == ["<a> ", 20]
    assert matcher.split("<a> <u>", parse_special=True) == [10, " ", 20]


def test_overlapping_occurrences_of_one_token_take_the_leftmost() -> None:
    matcher = SpecialTokenMatcher([("aa", 1, True)])
    assert matcher.split("aaa", parse_special=True) == [1, "a"]
    assert matcher.split("aaaa", parse_special=True) == [1, 1]

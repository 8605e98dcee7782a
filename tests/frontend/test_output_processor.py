"""OutputProcessor with several tokens per step (a speculative decode's accepted run): a stop string ends
the choice at the token that completes it, so the tokens after it (and their logprobs) are dropped."""

from __future__ import annotations

from bitserve.core.request import FinishReason
from bitserve.core.step_outputs import TokenLogprobs
from bitserve.engine.messages import EngineOutput
from bitserve.frontend.output_processor import OutputProcessor
from bitserve.sampling_params import SamplingParams

WORDS = {1: "the", 2: " cat", 3: " sat", 4: " on", 5: " the", 6: " mat", 7: "."}


class WordTokenizer:
    """Token i is WORDS[i]: just what IncrementalDetokenizer and OutputProcessor read."""

    eos_token_ids = frozenset({0})

    def token_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes:
        return WORDS[token_id].encode()


def logprob(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -0.5, 1, ())


def run(params: SamplingParams, steps: list[list[int]]) -> list:
    processor = OutputProcessor(WordTokenizer())  # type: ignore[arg-type]
    (request,) = processor.add_choices("p", [1], params)
    deltas = []
    for token_ids in steps:
        output = EngineOutput(request.request_id, token_ids, [logprob(t) for t in token_ids], None, 0)
        step_deltas, abort_ids = processor.process([output])
        deltas += step_deltas
        if abort_ids:
            break
    return [delta.output for delta in deltas]


def test_a_stop_string_inside_a_multi_token_step_ends_at_its_token() -> None:
    params = SamplingParams(stop=["sat on"], logprobs=0)
    plain = run(params, [[t] for t in (2, 3, 4, 5, 6)])
    spec = run(params, [[2, 3], [4, 5, 6]])  # " on" completes the stop string; " the mat" follow it
    for outputs in (plain, spec):
        assert "".join(o.text for o in outputs) == " cat "
        assert [t for o in outputs for t in o.token_ids] == [2, 3, 4]
        assert [lp.token_id for o in outputs for lp in o.logprobs] == [2, 3, 4]
        assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == "sat on"


def test_without_stop_strings_every_token_of_a_step_is_kept() -> None:
    outputs = run(SamplingParams(), [[2, 3, 4], [5, 6]])
    assert [o.token_ids for o in outputs] == [[2, 3, 4], [5, 6]]
    assert "".join(o.text for o in outputs) == " cat sat on the mat"


def test_an_engine_finish_in_a_multi_token_step_keeps_its_tokens() -> None:
    processor = OutputProcessor(WordTokenizer())  # type: ignore[arg-type]
    (request,) = processor.add_choices("p", [1], SamplingParams(stop=["never"]))
    output = EngineOutput(request.request_id, [2, 3, 7], None, FinishReason.STOP, 0)
    (delta,), abort_ids = processor.process([output])
    assert delta.output.token_ids == [2, 3, 7] and delta.output.text == " cat sat."
    assert delta.output.finish_reason == "stop" and abort_ids == []

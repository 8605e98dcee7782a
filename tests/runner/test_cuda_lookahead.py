"""runner/cuda_lookahead.py: when a decode step launched ahead is the step the scheduler asks for next.

The launch itself needs a CUDA device (tests/gpu/test_cuda_engine.py checks that tokens with lookahead equal
the CPU reference's and the tokens with it off); here, the rules that decide whether a guess is used, on
the host alone: a wrong "yes" would return another step's tokens.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from bitserve.core.scheduler_output import ScheduledRequest
from bitserve.runner.cuda_lookahead import Lookahead, ends_with_this_step, is_plain_greedy, next_positions
from bitserve.sampling_params import SamplingParams

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)


def decode(
    request_id: str, token: int, position: int, blocks: list[int], **params: object
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id,
        token_ids=[token],
        start_position=position,
        block_ids=blocks,
        sample=True,
        params=dataclasses.replace(GREEDY, **params),
        num_computed_tokens_before=position,
        prompt_token_ids=(1, 2, 3),
    )


def launched_after(requests: list[ScheduledRequest], tokens: list[int]) -> Lookahead:
    """The lookahead the runner records after `requests`, fed `tokens` (their sampled ids)."""
    positions = next_positions(requests, max_model_len=64, block_size=BLOCK_SIZE)
    assert positions is not None
    return Lookahead(
        request_ids=tuple(r.request_id for r in requests),
        positions=tuple(positions),
        num_blocks=tuple(len(r.block_ids) for r in requests),
        readback=None,  # type: ignore[arg-type]  # the device's part: tests/gpu/test_cuda_engine.py
        fed_token_ids=tokens,
    )


def test_the_next_step_of_the_same_sequences_matches() -> None:
    step = [decode("a", 7, 5, [3, 9]), decode("b", 8, 2, [4])]
    ahead = launched_after(step, [11, 12])
    assert ahead.positions == (6, 3)
    assert ahead.matches([decode("a", 11, 6, [3, 9]), decode("b", 12, 3, [4])])
    # blocks appended since the launch (the scheduler's lookahead slot): the launch's table is a prefix
    assert ahead.matches([decode("a", 11, 6, [3, 9]), decode("b", 12, 3, [4, 8])])


@pytest.mark.parametrize(
    "next_step",
    [
        [decode("a", 11, 6, [3, 9])],  # b finished
        [decode("b", 12, 3, [4]), decode("a", 11, 6, [3, 9])],  # another order
        [decode("a", 11, 6, [3, 9]), decode("b", 13, 3, [4])],  # b fed another token
        [decode("a", 11, 7, [3, 9]), decode("b", 12, 3, [4])],  # a at another position
        [decode("a", 11, 6, [3]), decode("b", 12, 3, [4])],  # a holds fewer blocks (another table)
        [decode("a", 11, 6, [3, 9]), decode("b", 12, 3, [4]), decode("c", 1, 0, [6])],  # c joined
        [decode("a", 11, 6, [3, 9]), decode("b", 12, 3, [4], temperature=0.7)],  # b samples
        [decode("a", 11, 6, [3, 9], logprobs=2), decode("b", 12, 3, [4])],  # a wants logprobs
    ],
)
def test_any_other_step_does_not_match(next_step: list[ScheduledRequest]) -> None:
    ahead = launched_after([decode("a", 7, 5, [3, 9]), decode("b", 8, 2, [4])], [11, 12])
    assert not ahead.matches(next_step)


def test_a_lookahead_whose_tokens_the_host_has_not_read_matches_nothing() -> None:
    step = [decode("a", 7, 5, [3, 9])]
    ahead = launched_after(step, [])
    assert not ahead.matches([decode("a", 11, 6, [3, 9])])


def test_no_guess_where_the_next_position_needs_a_new_block_or_passes_the_context() -> None:
    assert next_positions([decode("a", 7, 7, [3, 9])], max_model_len=64, block_size=BLOCK_SIZE) is None
    assert next_positions([decode("a", 7, 6, [3, 9])], max_model_len=64, block_size=BLOCK_SIZE) == [7]
    assert next_positions([decode("a", 7, 6, [3, 9])], max_model_len=7, block_size=BLOCK_SIZE) is None


def test_no_guess_after_a_sequence_samples_its_last_token_by_max_tokens() -> None:
    """The scheduler finishes a request once its outputs reach max_tokens: a step launched after the
    step that samples the last one would be dropped (and a batch that loses a sequence mismatches)."""
    step = decode("a", 7, 9, [3, 9, 4], max_tokens=5)
    assert not ends_with_this_step(dataclasses.replace(step, output_token_ids=(1, 2, 3)))  # samples the 4th
    assert ends_with_this_step(dataclasses.replace(step, output_token_ids=(1, 2, 3, 4)))  # samples the 5th
    assert not ends_with_this_step(dataclasses.replace(step, params=GREEDY, output_token_ids=(1,) * 99))


def test_only_rows_the_sampler_leaves_at_argmax_are_plain_greedy() -> None:
    assert is_plain_greedy(decode("a", 1, 0, [0]))
    assert is_plain_greedy(decode("a", 1, 0, [0], temperature=0.8, top_k=1))
    for params in (
        {"temperature": 0.8},
        {"logprobs": 0},
        {"presence_penalty": 0.5},
        {"repetition_penalty": 1.1},
        {"logit_bias": ((5, 2.0),)},
        {"min_tokens": 3},
    ):
        assert not is_plain_greedy(decode("a", 1, 0, [0], **params)), params
    prefill = dataclasses.replace(decode("a", 1, 0, [0]), token_ids=[1, 2])
    assert not is_plain_greedy(prefill)
    assert not is_plain_greedy(dataclasses.replace(decode("a", 1, 0, [0]), sample=False))


def test_blocks_appended_since_the_table_was_written_reach_the_device_table() -> None:
    """A launch ahead replays the last step's graph, whose block table the host wrote then: a block the
    scheduler appended since (the lookahead slot's) must be written into the row before the replay, and a
    table past the graph's width must launch nothing (the attention kernel would read padding)."""
    pytest.importorskip("triton")  # runner/cuda_graphs.py imports the CUDA decoder's kernels
    from bitserve.runner.cuda_graphs import DecodeGraphs, GraphKey, append_blocks

    table = torch.full((2, 4), 99, dtype=torch.int32)  # the host's copy of the last launch's table
    table_blocks = [2, 1]
    assert append_blocks(table, table_blocks, [decode("a", 1, 7, [3, 9, 5]), decode("b", 1, 2, [4])])
    assert table.tolist() == [[99, 99, 5, 99], [99, 99, 99, 99]]
    assert table_blocks == [3, 1]
    assert not append_blocks(table, table_blocks, [decode("a", 1, 8, [3, 9, 5]), decode("b", 1, 3, [4])])
    graphs = object.__new__(DecodeGraphs)  # the unit alone: its width check, no CUDA device
    graphs._last = GraphKey(size=2, width=2, greedy=True)
    grown = [decode("a", 1, 8, [3, 9, 5]), decode("b", 1, 3, [4])]
    assert graphs.replay_next(grown, [8, 3]) is None


def test_graphs_refuse_a_head_with_more_rows_than_the_token_table() -> None:
    """The graphs' argmax feeds each token to the next step's embedding gather, which does not check it:
    a head wider than the table is refused at capture, not read past the table later."""
    pytest.importorskip("triton")
    from bitserve.errors import UnsupportedModel
    from bitserve.runner.cuda_graphs import DecodeGraphs

    graphs = object.__new__(DecodeGraphs)  # the unit alone: no CUDA device
    graphs.decoder = SimpleNamespace(embedding=torch.zeros(10, 4))
    graphs._check_vocab(10)
    with pytest.raises(UnsupportedModel, match="11 rows but the token embedding 10"):
        graphs._check_vocab(11)


def test_a_greedy_graph_only_where_the_decoders_greedy_head_fits() -> None:
    """Buckets the greedy head fits (kernels/cuda/greedy_head.py: the argmax alone, from an int8 copy) get
    a greedy graph beside the full one; the others keep only the full logits."""
    pytest.importorskip("triton")
    from bitserve.runner.cuda_graphs import DecodeGraphs, GraphKey, bucket_keys, held_output_bytes

    graphs = object.__new__(DecodeGraphs)  # the unit alone: no CUDA device
    graphs.decoder = SimpleNamespace(greedy_head_fits=lambda rows: rows <= 2)
    assert bucket_keys(graphs.decoder, 2, 16) == [GraphKey(2, 16, False), GraphKey(2, 16, True)]
    assert bucket_keys(graphs.decoder, 4, 16) == [GraphKey(4, 16, False)]
    # the outputs the KV sizing reserves: rows 1+1, 2+2, 4 per width, 10 logits + one int64 id a row
    assert held_output_bytes(
        graphs.decoder, max_batch=4, max_blocks_per_seq=1, block_size=16, vocab_size=10
    ) == (10 * (4 * 10 + 8))
    # a greedy step (run, held_graph) replays the bucket's greedy graph where it has one, else its full one
    graphs.graphs = {key: None for size in (2, 4) for key in bucket_keys(graphs.decoder, size, 16)}
    assert graphs._key(2, 16, greedy=True) == GraphKey(2, 16, True)
    assert graphs._key(2, 16, greedy=False) == GraphKey(2, 16, False)
    assert graphs._key(4, 16, greedy=True) == GraphKey(4, 16, False)

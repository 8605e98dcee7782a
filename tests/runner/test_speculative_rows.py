"""The runner's side of speculative decoding, without a model: the batch layout of a verify (one-token
rows over one block table), each row's sampling state, the acceptance rule, and the seeded generator
left where plain decoding would leave it."""

from __future__ import annotations

import torch

from bitserve.core.scheduler_output import ScheduledRequest
from bitserve.layers.sampler import Sampler, SamplerOutput, make_generator, row_uniform
from bitserve.runner import speculative
from bitserve.runner.input_batch import build_batch_inputs
from bitserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)


def scheduled(
    request_id: str,
    token_ids: list[int],
    start: int,
    block_ids: list[int],
    *,
    sample: bool = True,
    drafts: tuple[int, ...] = (),
    outputs: tuple[int, ...] = (),
    params: SamplingParams = GREEDY,
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id,
        token_ids,
        start,
        block_ids,
        sample,
        params,
        start,
        (1, 2, 3),
        output_token_ids=outputs,
        draft_token_ids=drafts,
    )


def test_a_verify_is_laid_out_as_one_token_rows_over_its_block_table() -> None:
    block_size = 4
    requests = [
        scheduled("prefill", [5, 6, 7], 0, [3], sample=False),
        scheduled("verify", [9, 10, 11, 12], 6, [1, 2, 4], drafts=(10, 11, 12), outputs=(9,)),
        scheduled("decode", [8], 2, [5]),
    ]
    batch = build_batch_inputs(requests, block_size)
    assert batch.input_ids.tolist() == [5, 6, 7, 9, 10, 11, 12, 8]
    assert batch.positions.tolist() == [0, 1, 2, 6, 7, 8, 9, 2]
    # positions 6..9 of the verify: block 2 (slots 8+2, 8+3), then block 4 (slots 16, 17)
    assert batch.attn.slot_mapping.tolist() == [12, 13, 14, 10, 11, 16, 17, 22]
    host = batch.attn.host
    assert host is not None
    assert host.seq_lens == (3, 7, 8, 9, 10, 3)  # one sequence per verified position
    assert host.query_start_loc == (0, 3, 4, 5, 6, 7, 8)
    assert batch.attn.block_table[1:5].tolist() == [[1, 2, 4]] * 4
    assert batch.sample_indices.tolist() == [3, 4, 5, 6, 7]
    assert batch.sampled_request_ids == ["verify"] * 4 + ["decode"]
    assert host.decode is not None and host.other_seq_ids == (0,)  # the verify rows are decodes
    assert batch.attn.max_query_len == 3


def test_a_step_of_verifies_and_decodes_only_is_all_one_token_sequences() -> None:
    requests = [scheduled("verify", [9, 10, 11], 6, [1, 2, 3], drafts=(10, 11)), scheduled("d", [8], 2, [5])]
    batch = build_batch_inputs(requests, 4)
    assert batch.attn.decode_only and batch.attn.num_seqs == batch.input_ids.shape[0] == 4


def test_row_i_samples_with_the_outputs_and_the_first_i_drafts() -> None:
    request = scheduled("v", [9, 10, 11], 6, [1, 2], drafts=(10, 11), outputs=(4, 9))
    generator = make_generator(3)
    rows = speculative.sampling_rows(request, generator)
    assert [tuple(row.output_token_ids) for row in rows] == [(4, 9), (4, 9, 10), (4, 9, 10, 11)]
    assert all(row.generator is generator and row.params is GREEDY for row in rows)
    assert (
        speculative.num_rows(request) == 3
        and len(speculative.sampling_rows(scheduled("p", [1], 0, [1]), None)) == 1
    )


def test_acceptance_keeps_the_confirmed_drafts_and_the_next_token() -> None:
    assert speculative.num_accepted([10, 11, 12, 13], (10, 11, 12)) == 3  # all: k + 1 tokens
    assert (
        speculative.num_accepted([10, 99, 12, 13], (10, 11, 12)) == 1
    )  # rows after a miss are not looked at
    assert speculative.num_accepted([99, 11, 12, 13], (10, 11, 12)) == 0
    assert speculative.num_accepted([7], ()) == 0


def test_collect_returns_accepted_runs_and_their_logprobs() -> None:
    requests = [
        scheduled("v", [9, 10, 11], 6, [1, 2], drafts=(10, 11)),
        scheduled("d", [8], 2, [5]),
        scheduled("w", [3, 4, 5], 0, [6], drafts=(4, 5)),
    ]
    sampled = SamplerOutput(
        token_ids=[10, 42, 43, 7, 4, 5, 6], logprobs=["a", "b", "c", "d", None, None, None]
    )
    output = speculative.collect(requests, sampled, {}, {})
    assert output.sampled_token_ids == {"v": [10, 42], "d": [7], "w": [4, 5, 6]}
    assert output.logprobs == {"v": ["a", "b"], "d": ["d"]}


def test_a_seeded_verify_leaves_the_generator_one_draw_per_returned_token_on() -> None:
    params = SamplingParams(temperature=1.0, seed=11)
    request = scheduled("v", [9, 10, 11, 12], 6, [1, 2, 3], drafts=(10, 11, 12), params=params)
    generators = {"v": make_generator(11)}
    saved = speculative.save_generators([request], generators)
    assert set(saved) == {"v"}
    logits = torch.zeros(4, 16)
    logits[:, 10:13] = 5.0  # mass on 10, 11, 12 so that some drafts can hold
    rows = speculative.sampling_rows(request, generators["v"])
    out = Sampler()(logits, rows)
    result = speculative.collect([request], out, generators, saved)
    num_kept = len(result.sampled_token_ids["v"])
    assert num_kept < 4  # (seed 11 rejects the second draft) so a generator left 4 draws on shows
    reference = make_generator(11)
    expected_uniforms = [float(row_uniform(reference, "cpu")) for _ in range(5)]
    after = [float(row_uniform(generators["v"], "cpu")) for _ in range(5 - num_kept)]
    assert after == expected_uniforms[num_kept:]  # the stream continues at draw num_kept
    # the kept tokens used draws 0 .. num_kept - 1, the draws plain decoding makes for them
    replay = make_generator(11)
    for i, token in enumerate(result.sampled_token_ids["v"]):
        plain = Sampler()(logits[i : i + 1].clone(), [speculative.sampling_rows(request, replay)[i]])
        assert plain.token_ids == [token]


def test_greedy_and_unseeded_verifies_save_no_generator() -> None:
    greedy = scheduled("g", [9, 10], 6, [1, 2], drafts=(10,), params=SamplingParams(temperature=0, seed=4))
    unseeded = scheduled("u", [9, 10], 6, [1, 2], drafts=(10,), params=SamplingParams(temperature=1.0))
    plain = scheduled("p", [9], 6, [1, 2], params=SamplingParams(temperature=1.0, seed=4))
    generators = {"g": make_generator(4), "u": None, "p": make_generator(4)}
    assert speculative.save_generators([greedy, unseeded, plain], generators) == {}

"""The decode graphs' own ends (runner/cuda_graphs.py): the first kernel, which turns fed ids and positions
into embeddings, KV slots and context lengths (kernels/cuda/decode_inputs.py), and the argmax's feed of
the next step (kernels/cuda/argmax.py's StepFeed), against the host's arithmetic; and the final norm
written in the LM head's dtype, against the f32 norm rounded.
Runs on a CUDA device (`pytest -m gpu`), or in Triton's interpreter with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from bitserve.testing.kernel_device import kernel_test_device

pytestmark = pytest.mark.gpu

DEVICE = kernel_test_device()

from bitserve.kernels.cuda.argmax import BLOCK, StepFeed, argmax_rows, cast_argmax_rows  # noqa: E402
from bitserve.kernels.cuda.decode_inputs import prepare_decode_step  # noqa: E402
from bitserve.kernels.cuda.elementwise import rms_norm  # noqa: E402

BLOCK_SIZE = 4
SCRATCH = 50  # the scratch page's block id: padded rows' tables hold only it


def step_inputs(ids: list[int], positions: list[int]) -> torch.Tensor:
    """int64 [4, size]: ids, positions, and slots / seq_lens rows of junk the kernel must overwrite."""
    size = len(ids)
    return torch.tensor([ids, positions, [-7] * size, [-7] * size], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prepare_gathers_embeddings_and_derives_slots_and_lengths(dtype: torch.dtype) -> None:
    embedding = torch.randn(40, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    table = [[7, 3, 11], [9, SCRATCH, SCRATCH], [SCRATCH] * 3]  # two sequences and a padded row
    ids, positions = [5, 39, 0], [9, 2, 0]
    inputs = step_inputs(ids, positions)
    device_table = torch.tensor(table, dtype=torch.int32, device=DEVICE)
    hidden = prepare_decode_step(inputs, device_table, embedding.to(DEVICE), BLOCK_SIZE)
    assert hidden.dtype == torch.float32
    assert torch.equal(hidden.cpu(), embedding[ids].to(torch.float32))
    slots = [11 * BLOCK_SIZE + 1, 9 * BLOCK_SIZE + 2, SCRATCH * BLOCK_SIZE]  # table[r][p // 4] * 4 + p % 4
    assert inputs.cpu().tolist() == [ids, positions, slots, [10, 3, 1]]


def test_prepare_copies_rows_wider_than_one_program() -> None:
    embedding = torch.randn(3, 4096 + 100, generator=torch.Generator().manual_seed(4))
    inputs = step_inputs([2], [0])
    table = torch.tensor([[1]], dtype=torch.int32, device=DEVICE)
    hidden = prepare_decode_step(inputs, table, embedding.to(DEVICE), BLOCK_SIZE)
    assert torch.equal(hidden.cpu(), embedding[[2]])


def test_prepare_refuses_inputs_of_the_wrong_layout() -> None:
    table = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    embedding = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        prepare_decode_step(step_inputs([1, 2], [0, 0]).to(torch.int32), table, embedding, BLOCK_SIZE)
    with pytest.raises(ValueError, match="block_table"):
        prepare_decode_step(step_inputs([1, 2, 3], [0, 0, 0]), table, embedding, BLOCK_SIZE)


def test_the_argmax_feeds_the_next_step_and_the_host() -> None:
    """Real rows get their token as the next id and their position + 1; a padded row (table starting
    with the scratch block) keeps its inputs; every row's token lands in host row position % 2."""
    vocab = 2 * BLOCK + 3
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    logits[0, BLOCK + 1] = 100.0
    logits[1, 7] = 100.0
    logits[2, 2 * BLOCK] = 100.0
    inputs = step_inputs([4, 8, 0], [6, 3, 0])
    table = torch.tensor([[2, 5], [6, 8], [SCRATCH, SCRATCH]], dtype=torch.int32, device=DEVICE)
    host_tokens = torch.full((2, 8), -1, dtype=torch.int64)  # wider than the bucket, as the graphs' is
    if DEVICE == "cuda":
        host_tokens = host_tokens.pin_memory()
    feed = StepFeed(inputs, table, SCRATCH, host_tokens[:, :3])
    widened, ids = cast_argmax_rows(logits.to(DEVICE), feed)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert ids.tolist() == [BLOCK + 1, 7, 2 * BLOCK]
    assert torch.equal(widened.cpu(), logits.to(torch.float32))
    assert inputs.cpu()[:2].tolist() == [[BLOCK + 1, 7, 0], [7, 4, 0]]
    # position 6 (even) -> row 0, position 3 (odd) -> row 1, the padded row's position 0 -> row 0
    assert host_tokens[:, :3].tolist() == [[BLOCK + 1, -1, 2 * BLOCK], [-1, 7, -1]]
    assert host_tokens[:, 3:].eq(-1).all()
    # the next launch, fed: each real row one position on, its token in the other host row
    argmax_rows(logits.to(DEVICE))  # a plain launch between feeds neither
    again = cast_argmax_rows(logits.to(DEVICE), feed)[1]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert again.tolist() == ids.tolist()
    assert inputs.cpu()[:2].tolist() == [[BLOCK + 1, 7, 0], [8, 5, 0]]
    assert host_tokens[:, :3].tolist() == [[BLOCK + 1, 7, 2 * BLOCK], [BLOCK + 1, 7, -1]]


def test_the_feed_is_checked_against_the_logits() -> None:
    logits = torch.randn(2, 16).to(DEVICE)
    table = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    tokens = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="inputs"):
        cast_argmax_rows(logits, StepFeed(step_inputs([1, 2, 3], [0, 0, 0]), table, SCRATCH, tokens))
    with pytest.raises(ValueError, match="host_tokens"):
        cast_argmax_rows(logits, StepFeed(step_inputs([1, 2], [0, 0]), table, SCRATCH, tokens[:, :1]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_in_the_head_dtype_is_the_f32_norm_rounded(dtype: torch.dtype) -> None:
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter truncates f32 -> bf16 (the GPU rounds to nearest even)")
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(6)) * 40
    weight = torch.rand(200, generator=torch.Generator().manual_seed(7)) + 0.5
    wide = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6)
    narrow = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6, dtype)
    assert narrow.dtype == dtype
    assert torch.equal(narrow.cpu(), wide.cpu().to(dtype))
    with pytest.raises(ValueError, match="f32, f16 or bf16"):
        rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6, torch.int8)

"""The one attention-metadata type: laid out on the host, moved to the device, and what each forward
reads of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from bitserve.kernels.attention_metadata import AttentionMetadata
from bitserve.layers.attention import PagedAttention

PACKAGE = Path(__file__).resolve().parents[2] / "bitserve"


def _mixed_step() -> AttentionMetadata:
    """Sequence 0: a 3-token prefill chunk after 2 cached; 1 and 2: decodes at 5 and 9 keys."""
    block_size = 4
    block_table = torch.tensor([[3, 1, 0], [2, 5, 0], [4, 6, 7]], dtype=torch.int64)
    slots = torch.tensor([3 * 4 + 2, 3 * 4 + 3, 1 * 4 + 0, 5 * 4 + 0, 7 * 4 + 0])
    return AttentionMetadata.from_host(slots, block_table, [5, 5, 9], [0, 3, 4, 5], block_size)


def test_a_host_step_batches_its_decodes_and_keeps_the_rest_apart() -> None:
    metadata = _mixed_step()
    schedule = metadata.host
    assert schedule is not None and schedule.decode is not None
    assert schedule.other_seq_ids == (0,)
    assert schedule.decode.token_rows.tolist() == [3, 4]
    assert schedule.decode.seq_lens.tolist() == [5, 9]
    # padded to the longest decode's 3 blocks; a key exists where its position < the sequence's length
    assert schedule.decode.key_mask.sum(dim=1).tolist() == [5, 9]
    assert metadata.max_query_len == 3 and not metadata.decode_only and metadata.num_seqs == 3
    assert metadata.seq_lens.tolist() == [5, 5, 9] and metadata.query_start_loc.tolist() == [0, 3, 4, 5]


def test_batch_decodes_off_leaves_every_sequence_to_attend_alone() -> None:
    metadata = _mixed_step()
    alone = AttentionMetadata.from_host(
        metadata.slot_mapping, metadata.block_table, [5, 5, 9], [0, 3, 4, 5], 4, batch_decodes=False
    )
    assert alone.host is not None and alone.host.decode is None and alone.host.other_seq_ids == (0, 1, 2)


def test_to_device_keeps_the_facts_in_the_kernels_widths_and_drops_the_host_schedule() -> None:
    metadata = _mixed_step()
    sent: list[torch.Tensor] = []

    def send(tensor: torch.Tensor) -> torch.Tensor:
        sent.append(tensor)
        return tensor.clone()

    device = metadata.to_device(send)
    assert device.host is None and len(sent) == 4
    assert device.block_table.dtype == torch.int32 and device.seq_lens.dtype == torch.int32
    assert torch.equal(device.block_table.long(), metadata.block_table)
    assert device.seq_lens.tolist() == [5, 5, 9] and device.query_start_loc.tolist() == [0, 3, 4, 5]
    assert torch.equal(device.slot_mapping, metadata.slot_mapping)
    assert (device.block_size, device.max_query_len) == (4, 3)


def test_one_sequence_is_a_decode_exactly_when_it_has_one_new_token() -> None:
    table = torch.zeros(1, 2, dtype=torch.int32)
    assert AttentionMetadata.one_sequence(torch.tensor([6]), table, 7, 4).decode_only
    prefill = AttentionMetadata.one_sequence(torch.arange(7), table, 7, 4)
    assert not prefill.decode_only and prefill.query_start_loc.tolist() == [0, 7] and prefill.host is None


def test_the_module_forward_refuses_a_step_laid_out_for_the_device() -> None:
    device_step = _mixed_step().to_device(lambda tensor: tensor)
    q = torch.zeros(5, 2, 8)
    kv = torch.zeros(5, 1, 8)
    cache = torch.zeros(2, 8, 4, 1, 8)
    with pytest.raises(ValueError, match="laid out on the host"):
        PagedAttention(2, 1, 8)(q, kv, kv, cache, device_step)


def test_bitserve_declares_one_attention_metadata_type() -> None:
    """No second metadata class for one backend (there were two: a host form and a device form)."""
    declared = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("AttentionMetadata"):
                declared.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert declared == ["kernels/attention_metadata.py:AttentionMetadata"]

"""Chained content hashes of FULL KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal prefixes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# NOTE: SHA-256 makes accidental collisions negligible (2^-128 birthday bound at 2^64 blocks), so a
# cache hit is trusted without comparing token ids. A weaker hash (Python's `hash` of a tuple) would
# need the token ids stored beside each cached block and compared on every hit.
BlockHash = bytes

_ROOT_DOMAIN = b"bitserve/kv-block/v1"


def root_hash(extra_key: str | None = None) -> BlockHash:
    """The parent hash of a sequence's first block.

    `extra_key` separates caches whose KV differs for the same tokens (a model revision, an adapter):
    blocks hashed under different keys never match.
    """
    digest = hashlib.sha256(_ROOT_DOMAIN)
    if extra_key is not None:
        digest.update(b"\x00")
        digest.update(extra_key.encode("utf-8"))
    return digest.digest()


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block: SHA-256(parent hash || token ids as little-endian int64)."""
    data = array("q", token_ids)
    if data.itemsize != 8:  # pragma: no cover - 'q' is 8 bytes on every supported platform
        raise RuntimeError("array('q') is not 64-bit on this platform")
    digest = hashlib.sha256(parent_hash)
    digest.update(data.tobytes())
    return digest.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    root: BlockHash,
) -> None:
    """Append hashes to `block_hashes` until it covers the first `num_blocks` full blocks.

    `block_hashes[i]` covers `token_ids[: (i + 1) * block_size]`; only full blocks are ever hashed.
    Token ids of a sequence never change once appended, so the list only grows.
    """
    num_full_blocks = len(token_ids) // block_size
    if num_blocks > num_full_blocks:
        raise ValueError(f"asked for {num_blocks} block hashes but only {num_full_blocks} blocks are full")
    parent = block_hashes[-1] if block_hashes else root
    for index in range(len(block_hashes), num_blocks):
        start = index * block_size
        parent = hash_block(parent, token_ids[start : start + block_size])
        block_hashes.append(parent)

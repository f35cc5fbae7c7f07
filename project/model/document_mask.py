"""Document masking without a T x T mask: FlexAttention's block mask, built from the documents' positions.

A packed sequence holds several documents, and each token attends to the earlier tokens of its own document only.
A dense [B, 1, T, T] mask costs O(T^2) memory per sequence and keeps fused attention kernels out. FlexAttention's
block mask records, for each 128 x 128 tile of (query, key) positions, whether it is empty, full or partial; its
kernels skip the empty tiles and apply the rule only inside partial ones. The mask then takes O((T/128)^2) memory,
and the work follows the documents' lengths rather than the sequence's. It is built from the documents at the
tiles' edges (`document_block_mask`), so building it never visits the T x T pairs either.

On a GPU attention runs through a torch.compile'd flex_attention, its fused kernel (compiled once per process, as
torchtitan does). On a CPU the dense mask stays: FlexAttention has no backward pass there (torch 2.13 raises
"FlexAttention does not support backward on CPU"), and its eager forward materializes every score anyway. Both
paths apply one rule; tests/test_model.py holds FlexAttention's forward under the block mask to the dense mask's on
the CPU, and `make gpu-check` trains through it on a GPU against the CPU's dense path.
A torch without FlexAttention (before 2.5) keeps the dense mask everywhere.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5
    BlockMask = None  # type: ignore[assignment,misc]

_compiled_flex_attention: Any = None


def has_flex_attention() -> bool:
    return BlockMask is not None


def document_mask(document_ids: torch.Tensor) -> torch.Tensor | BlockMask:
    """Causal attention within each document of document_ids [B, T]: a block mask where FlexAttention trains
    (a GPU), else the dense mask."""
    if document_ids.device.type == "cuda" and has_flex_attention():
        return document_block_mask(document_ids)
    return dense_document_mask(document_ids)


TILE = 128  # FlexAttention's default block size, in positions


def document_block_mask(document_ids: torch.Tensor) -> BlockMask:
    """Causal attention within each document of document_ids [B, T] (non-decreasing along T, as `document_ids` of
    project.training.lit_module gives them), as a block mask shared by every head.

    Built from the documents' ids at the tiles' edges, never from the T x T pairs of positions (torch's
    `create_block_mask` evaluates the rule on every pair): since ids only grow along the sequence, a key tile at or
    before a query tile meets it when its last document is at least the query tile's first, and is full when it
    lies strictly before and both tiles hold one and the same document. O((T/128)^2) work and memory."""
    batch, seq_len = document_ids.shape
    tiles = -(-seq_len // TILE)
    starts = torch.arange(tiles, device=document_ids.device) * TILE
    first = document_ids[:, starts]  # [B, tiles]: the document of each tile's first position
    last = document_ids[:, (starts + TILE).clamp(max=seq_len) - 1]  # and of its last
    q_tile = kv_tile = torch.arange(tiles, device=document_ids.device)  # made on the device: no copy to wait for
    q_tile = q_tile[:, None]
    meets = (kv_tile <= q_tile) & (last[:, None, :] >= first[:, :, None])  # [B, q tiles, kv tiles]
    # A tile with padding (the last, when T is not a multiple of 128) is never full, as torch builds it: its mask
    # is then applied, and the padding's positions are left out by the rule.
    whole = starts + TILE <= seq_len
    full = (kv_tile < q_tile) & (first[:, None, :] == last[:, :, None]) & whole[:, None] & whole[None, :]
    partial = meets & ~full

    def causal_within_document(b, h, q, kv):
        # Positions past the sequence's end (its last tile's padding) are clamped: the kernel discards them.
        q, kv = q.clamp(max=seq_len - 1), kv.clamp(max=seq_len - 1)
        return (q >= kv) & (document_ids[b, q] == document_ids[b, kv])

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # as torch orders a block mask's tables
        counts = blocks.sum(dim=-1, dtype=torch.int32)[:, None]
        indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts, indices[:, None]

    kv_num_blocks, kv_indices = ordered(partial)
    full_kv_num_blocks, full_kv_indices = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks,
        full_kv_indices,
        BLOCK_SIZE=TILE,
        mask_mod=causal_within_document,
        seq_lengths=(seq_len, seq_len),
    )


def dense_document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The same rule as a boolean [B, 1, T, T] mask, for SDPA where FlexAttention is missing."""
    seq_len = document_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    return (causal & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]


def flex_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, enable_gqa: bool
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, H_kv, T, D] under `block_mask`; grouped heads read in place."""
    global _compiled_flex_attention
    if q.device.type == "cuda":
        if _compiled_flex_attention is None:
            _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    with warnings.catch_warnings():
        # Off a GPU only for a forward pass (a test of the mask): its advice, to compile it, is the GPU path's.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)

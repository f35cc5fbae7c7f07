"""Document masking without a T x T mask: FlexAttention's block mask, built from the documents' positions.

A packed sequence holds several documents, and each token attends to the earlier tokens of its own document only.
A dense [B, 1, T, T] mask costs O(T^2) memory per sequence and keeps fused attention kernels out. FlexAttention's
block mask records, for each 128 x 128 tile of (query, key) positions, whether it is empty, full or partial; its
kernels skip the empty tiles and apply the rule only inside partial ones. The mask then takes O((T/128)^2) memory,
and the work follows the documents' lengths rather than the sequence's. It is built from the documents at the
tiles' edges (`document_block_mask`), so building it never visits the T x T pairs either.

On a GPU attention runs through a torch.compile'd flex_attention, its fused kernel (project.model.kernels). On a
CPU the dense mask stays: FlexAttention has no backward pass there (torch 2.13 raises
"FlexAttention does not support backward on CPU"), and its eager forward materializes every score anyway. Both
paths apply one rule; tests/test_model.py holds FlexAttention's forward under the block mask to the dense mask's on
the CPU, and `make gpu-check` trains through it on a GPU against the CPU's dense path.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask


def document_mask(document_ids: torch.Tensor, query_positions: torch.Tensor | None = None) -> torch.Tensor | BlockMask:
    """Causal attention within each document of document_ids [B, T]: a block mask where FlexAttention trains
    (a GPU), else the dense mask. `query_positions` [T_q] (increasing), optional: only those positions' rows,
    against every key (context parallelism's rank keeps some of the sequence's queries); all T by default."""
    if document_ids.device.type == "cuda":
        return document_block_mask(document_ids, query_positions)
    return dense_document_mask(document_ids, query_positions)


TILE = 128  # FlexAttention's default block size, in positions


def document_block_mask(document_ids: torch.Tensor, query_positions: torch.Tensor | None = None) -> BlockMask:
    """Causal attention within each document of document_ids [B, T] (non-decreasing along T, as `document_ids` of
    project.training.lit_module gives them), as a block mask shared by every head; for the queries at
    `query_positions` [T_q] (increasing; all T by default) against all T keys.

    Built from the documents' ids at the tiles' edges, never from the T_q x T pairs of positions (torch's
    `create_block_mask` evaluates the rule on every pair): since positions and ids only grow along a tile, a key
    tile meets a query tile when it starts at or before the query tile's last position and its documents overlap
    the query tile's; it is full when it ends at or before the query tile's first position and both tiles hold one
    and the same document. O(T_q / 128 x T / 128) work and memory. Where query positions jump inside a tile (two
    chunks of context parallelism shorter than a tile), "meets" may count a tile the rule leaves empty: it is then
    computed under the rule, never wrongly skipped."""
    batch, seq_len = document_ids.shape
    device = document_ids.device
    if query_positions is None:
        query_positions = torch.arange(seq_len, device=device)
    q_len = query_positions.shape[0]

    def edges(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each tile's first and last index among `length`, and whether the tile is whole (no padding)."""
        starts = torch.arange(-(-length // TILE), device=device) * TILE
        return starts, (starts + TILE).clamp(max=length) - 1, starts + TILE <= length

    kv_first_pos, kv_last_pos, kv_whole = edges(seq_len)
    q_first, q_last, q_whole = edges(q_len)
    q_first_pos, q_last_pos = query_positions[q_first], query_positions[q_last]
    # [B, q tiles] and [B, kv tiles]: the documents at the tiles' edges.
    q_first_doc, q_last_doc = document_ids[:, q_first_pos], document_ids[:, q_last_pos]
    kv_first_doc, kv_last_doc = document_ids[:, kv_first_pos], document_ids[:, kv_last_pos]
    meets = (
        (kv_first_pos[None, :] <= q_last_pos[:, None])
        & (kv_last_doc[:, None, :] >= q_first_doc[:, :, None])
        & (kv_first_doc[:, None, :] <= q_last_doc[:, :, None])
    )  # [B, q tiles, kv tiles]
    # A tile with padding (the last, when a length is not a multiple of 128) is never full, as torch builds it: its
    # mask is then applied, and the padding's positions are left out by the rule.
    full = (
        (kv_last_pos[None, :] <= q_first_pos[:, None])
        & (kv_first_doc[:, None, :] == q_last_doc[:, :, None])
        & q_whole[:, None]
        & kv_whole[None, :]
    )
    partial = meets & ~full

    def causal_within_document(b, h, q, kv):
        # Indices past the ends (the last tiles' padding) are clamped: the kernel discards them. Ids of one sequence
        # ([1, T]: Llama 4's chunks without documents) serve every sequence of the batch, which the kernel numbers.
        q, kv, b = query_positions[q.clamp(max=q_len - 1)], kv.clamp(max=seq_len - 1), b.clamp(max=batch - 1)
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
        seq_lengths=(q_len, seq_len),
    )


def dense_document_mask(document_ids: torch.Tensor, query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """The same rule as a boolean [B, 1, T_q, T] mask, for SDPA where FlexAttention is missing."""
    seq_len = document_ids.shape[1]
    keys = torch.arange(seq_len, device=document_ids.device)
    queries = keys if query_positions is None else query_positions
    causal = queries[:, None] >= keys[None, :]
    return (causal & (document_ids[:, queries, None] == document_ids[:, None, :]))[:, None]

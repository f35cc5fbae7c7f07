"""Document masking without a T x T mask: FlexAttention's block mask, built from the documents' positions.

A packed sequence holds several documents, and each token attends to the earlier tokens of its own document only.
A dense [B, 1, T, T] mask costs O(T^2) memory per sequence and keeps fused attention kernels out. FlexAttention's
block mask records, for each 128 x 128 tile of (query, key) positions, whether it is empty, full or partial; its
kernels skip the empty tiles and apply the rule only inside partial ones. The mask then takes O((T/128)^2) memory,
and the work follows the documents' lengths rather than the sequence's.

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
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
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


def document_block_mask(document_ids: torch.Tensor) -> BlockMask:
    """Causal attention within each document of document_ids [B, T], as a block mask shared by every head."""
    batch, seq_len = document_ids.shape

    def causal_within_document(b, h, q, kv):
        return (q >= kv) & (document_ids[b, q] == document_ids[b, kv])

    return create_block_mask(causal_within_document, batch, None, seq_len, seq_len, device=document_ids.device)


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

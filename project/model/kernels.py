"""Which kernel computes attention, chosen outside the model's classes: torch's scaled_dot_product_attention (plain
causal, or under a dense mask) or FlexAttention (under a document mask's block mask, project.model.document_mask).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

_compiled_flex_attention: Any = None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim) + mask) v: q [B, H, T, D] over k, v [B, H_kv, S, D]; `mask` None: causal, a
    boolean tensor: where True, a block mask: FlexAttention's."""
    # Each key/value head serves a group of query heads. SDPA reads them in place (no repeated copies)
    # where its kernel for the case takes grouped heads: on the CPU, and on GPUs unmasked in 16 bits
    # (the flash kernel); elsewhere enable_gqa would drop it to the slow math kernel, so repeat them.
    # FlexAttention (a document mask's block mask) reads grouped heads in place everywhere.
    groups = q.shape[1] // k.shape[1]
    flex = not isinstance(mask, torch.Tensor) and mask is not None
    in_place = flex or q.device.type == "cpu" or (mask is None and q.dtype in (torch.float16, torch.bfloat16))
    gqa = groups > 1 and in_place
    if groups > 1 and not in_place:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return flex_attend(q, k, v, mask, enable_gqa=gqa)


def flex_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, enable_gqa: bool
) -> torch.Tensor:
    """Attention of q [B, H, T, D] over k, v [B, H_kv, T, D] under `block_mask`; grouped heads read in place."""
    global _compiled_flex_attention
    if q.device.type == "cuda":  # its fused kernel, compiled once per process, as torchtitan does
        if _compiled_flex_attention is None:
            _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    with warnings.catch_warnings():
        # Off a GPU only for a forward pass (a test of the mask): its advice, to compile it, is the GPU path's.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)

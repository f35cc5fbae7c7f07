"""Llama 4's text model: the mixture of experts' model (project.model.families.moe) with Llama 4's attention.

Which layer attends how is the attention's own (`Llama4Attention.positioned`), from what the model gives every layer
(`Llama4Masks`): the global mask, the chunked one, and the queries' positions. Under context parallelism the
positions and both masks are those of the rank's own queries (the model asks its `document_masking`, which the
strategy replaces); a chunk's boundary cuts attention as a document's does (`chunk_segments`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from project.model.document_mask import dense_document_mask
from project.model.families.llama4.config import Llama4Config
from project.model.families.moe.model import MoEFeedForward, MoELlama
from project.model.llama import Attention, Block, KVCache


class Llama4Masks(NamedTuple):
    full: Any  # the rope-free layers': None (causal), the documents' mask, or the cached positions' (Llama's own)
    chunked: Any  # the rotary layers': within each chunk (and document)
    positions: torch.Tensor  # [T] the queries' positions in the whole sequence, for the temperature


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """Each pair of neighbouring channels (x0, x1) turned a quarter: (-x1, x0) (Meta's layout of the rotary pairs)."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def chunk_segments(positions: torch.Tensor, chunk: int, document_ids: torch.Tensor | None) -> torch.Tensor:
    """Ids [B or 1, T] that change where a chunk of `chunk` positions or a document ends, non-decreasing: attention
    within each, as a document mask, is chunked attention within documents."""
    chunks = positions // chunk
    if document_ids is None:
        return chunks[None]
    # Past the last chunk's id: known on the host from the length (reading it off the device would wait for it).
    return document_ids * (-(-positions.shape[0] // chunk)) + chunks


def head_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, heads, T, head_dim] divided by its root mean square over head_dim (no gain: an L2 norm), in float32 as
    Meta's. Computed in the heads' own layout [B, T, heads, head_dim] (rms_norm's output is laid out as its input
    reads), which attention's output then keeps: the output projection reads it without a copy."""
    return F.rms_norm(x.float().transpose(1, 2), (x.shape[-1],), eps=eps).transpose(1, 2).type_as(x)


class Llama4Attention(Attention):
    def __init__(self, config: Llama4Config, index: int):
        super().__init__(config)
        self.rotary = config.rotates(index)
        self.qk_norm = config.qk_norm and self.rotary
        self.temperature = config.temperature_tuning and not self.rotary
        self.eps, self.floor_scale, self.attn_scale = config.norm_eps, config.floor_scale, config.attn_scale

    def positioned(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Llama4Masks
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        if self.rotary:
            q, k = q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin
            if self.qk_norm:
                q, k = head_norm(q, self.eps), head_norm(k, self.eps)
            return q, k, mask.chunked
        if self.temperature:
            steps = torch.floor((mask.positions.float() + 1.0) / self.floor_scale)
            q = (q * (torch.log1p(steps) * self.attn_scale + 1.0)[:, None]).to(q.dtype)
        return q, k, mask.full


class Llama4(MoELlama):
    config: Llama4Config

    def block(self, config: Llama4Config, index: int) -> Block:  # type: ignore[override]
        feed_forward = MoEFeedForward(config) if config.is_moe_layer(index) else None
        return Block(config, feed_forward, Llama4Attention(config, index))

    @staticmethod
    def channel_angles(angles: torch.Tensor) -> torch.Tensor:
        # Pair i is channels 2i and 2i + 1 (Meta's complex rotation), not i and i + head_dim / 2.
        return angles.repeat_interleave(2, dim=-1)

    def attention_mask(
        self, seq_len: int, device: torch.device, document_ids: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> Llama4Masks:
        full = super().attention_mask(seq_len, device, document_ids, cache)
        start = 0 if cache is None else cache.length
        positions, whole = self.document_masking.queries(seq_len, device)
        positions = positions + start
        chunk = self.config.attention_chunk_size
        if chunk is None:
            return Llama4Masks(full, full, positions)
        segments = chunk_segments(torch.arange(start + whole, device=device), chunk, document_ids)
        if cache is not None:  # the new queries against every cached key: a dense mask of their rows
            return Llama4Masks(full, dense_document_mask(segments, query_positions=positions), positions)
        return Llama4Masks(full, self.document_masking(segments), positions)

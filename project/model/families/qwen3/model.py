"""Qwen3's attention: grouped-query attention whose queries and keys are each RMS-normalized per head, over head_dim,
before the rotary embedding (transformers' Qwen3Attention). Everything else is the Llama's (project.model.llama)."""

from __future__ import annotations

import torch

from project.model.families.qwen3.config import Qwen3Config
from project.model.llama import Attention, Block, Llama, RMSNorm


class Qwen3Attention(Attention):
    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().heads(x)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3(Llama):
    def block(self, config: Qwen3Config, index: int) -> Block:  # type: ignore[override]
        return Block(config, attention=Qwen3Attention(config))

"""Qwen3Config: the shape of a dense Qwen3, as plain data (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from project.model.config import WHOLE, HeadNorms, LlamaConfig
from project.model.spec import TensorSpec
from project.runtime.settings import setting, whole


@dataclass
class Qwen3Config(LlamaConfig):
    family: str = "qwen3"
    # Each head's width, which Qwen3 sets apart from dim / n_heads (0.6B: 16 heads of 128 over a dim of 1024).
    head_dim: int = setting(128, whole(1), WHOLE)

    def check_head_width(self) -> None:
        # Not dim / n_heads: Qwen3's projections map dim to n_heads * head_dim, whatever dim is.
        if self.head_dim % 2:
            raise ValueError(
                f"model.head_dim={self.head_dim} is odd, and the rotary embedding turns pairs of channels: set an "
                "even head_dim (Qwen3's published models use 128)."
            )

    def head_norms(self, index: int) -> HeadNorms:
        return HeadNorms(gain=True)

    def attention_tensors(self, index: int) -> list[TensorSpec]:
        """A Llama's, and the gains of the per-head norms of queries and keys: applied to each head, so under tensor
        parallelism to the heads a rank holds ("heads")."""
        return [
            *super().attention_tensors(index),
            TensorSpec("attention.q_norm.weight", (self.head_dim,), "heads", None, decay=False),
            TensorSpec("attention.k_norm.weight", (self.head_dim,), "heads", None, decay=False),
        ]

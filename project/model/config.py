"""LlamaConfig: the shape of a Llama, as plain data.

Kept apart from the model so that settings can be checked (project.config.checks) without importing torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from project.model.spec import TensorSpec, gain, residual_std, swiglu
from project.runtime.settings import above, check_fields, or_null, setting, whole

# The dtypes a model's weights, compute or gradient reductions may take, by torch's names (getattr(torch, name)).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


WHOLE = "a whole number above 0"
# The most float32 logits the loss holds at once by default (512 MiB): the budget LlamaConfig.chunk_tokens keeps to.
LOSS_CHUNK_LOGITS = 2**27


class Mixture(NamedTuple):
    """A block's mixture of experts as plain numbers (project.model.families.moe builds it; project.planning sizes
    it)."""

    experts: int
    top_k: int  # experts each token goes through
    width: int  # each expert's SwiGLU width
    shared: bool  # a shared expert every token goes through beside its routed ones
    balancing_loss: bool  # whether a balancing loss joins the objective (its gradient flows back through the router)


class HeadNorms(NamedTuple):
    """A block's RMS norms of each query and key head over head_dim, as plain numbers (project.planning counts what
    they keep for the backward): Qwen3's, with a gain, and Llama 4's, without."""

    gain: bool


@dataclass
class LlamaConfig:
    # The model family (project.model.families) whose config this is: each family's config class sets its own.
    family: str = "llama"
    vocab_size: int = setting(32000, whole(2), "a whole number, at least the tokenizer's size")
    dim: int = setting(4096, whole(1), WHOLE)
    n_layers: int = setting(32, whole(1), WHOLE)
    n_heads: int = setting(32, whole(1), WHOLE)
    # None: multi-head attention (n_kv_heads == n_heads)
    n_kv_heads: int | None = setting(None, or_null(whole(1)), "null (= n_heads) or a whole number above 0")
    ffn_dim_multiplier: float | None = setting(None, or_null(above(0)), "null or above 0")
    multiple_of: int = setting(256, whole(1), WHOLE)
    # The FFN's width as published (HF's intermediate_size); None: Meta's rule (ffn_hidden_dim).
    ffn_dim: int | None = setting(None, or_null(whole(1)), "null (the rule of multiple_of) or a whole number above 0")
    norm_eps: float = setting(1e-5, above(0), "above 0, e.g. 1e-5")
    rope_theta: float = setting(10000.0, above(0), "above 0, e.g. 10000")
    # Llama-3.1 style frequency scaling: {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; None keeps plain RoPE.
    rope_scaling: dict | None = None
    max_seq_len: int = setting(2048, whole(1), "a whole number of tokens above 0")
    tie_embeddings: bool = False
    init_std: float = setting(0.02, above(0), "above 0, e.g. 0.02")
    # The head and the loss run over this many tokens at a time (project.model.loss): a chunk's float32 logits
    # take loss_chunk_tokens x vocab_size x 4 bytes, and no more of them exist at once. Not part of the shape.
    # None: from the vocabulary (chunk_tokens), so that no preset or vocabulary holds more than a fixed budget.
    loss_chunk_tokens: int | None = setting(
        None, or_null(whole(1)), "null (from the vocabulary) or a whole number of tokens above 0, e.g. 1024"
    )

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if self.family != type(self).family:
            raise ValueError(
                f"model.family={self.family} is not the family of {type(self).__name__}: {type(self).family}."
            )
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self.check_head_width()
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each key/value head across a whole group of query heads)."
            )
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)

    @property
    def kv_heads(self) -> int:
        """n_kv_heads as resolved (set to n_heads when given as None)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def chunk_tokens(self) -> int:
        """Tokens the head and the loss take at a time: loss_chunk_tokens as set, else the largest power of two whose
        float32 logits fit in LOSS_CHUNK_LOGITS (Llama 3's vocabulary of 128,256: 1,024 tokens, 525 MB; Llama 2's
        32,000: 4,096; a test's 96: 1,048,576, one chunk for any batch)."""
        if self.loss_chunk_tokens is not None:
            return self.loss_chunk_tokens
        return 2 ** max(0, (LOSS_CHUNK_LOGITS // self.vocab_size).bit_length() - 1)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check_head_width(self) -> None:
        """Raise where the heads cannot have their width: dim / n_heads, a whole number and even (the rotary embedding
        turns pairs of channels). A family that sets head_dim apart from dim checks only the latter (Qwen3)."""
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}.")
        if self.head_dim % 2:
            raise ValueError(
                f"model.dim / model.n_heads = {self.head_dim} channels per head: an odd number, and the rotary "
                "embedding turns pairs of channels. Choose a dim and n_heads whose quotient is even."
            )

    def hf_format_differences(self) -> list[str]:
        """The settings its family's Hugging Face format cannot hold (project.model.families.without_hf_format)."""
        return []

    def block_tensors(self, index: int) -> list[TensorSpec]:
        """Block `index`'s parameters, by their names within it, in the order the block holds them: attention with its
        norm, then the feed-forward with its norm."""
        return self.attention_tensors(index) + [gain("ffn_norm.weight", self.dim)] + self.feed_forward_tensors(index)

    def attention_tensors(self, index: int) -> list[TensorSpec]:
        """Grouped-query attention: q, k and v column-wise parallel (heads per rank), o row-wise."""
        d, q, kv, std = self.dim, self.n_heads * self.head_dim, self.kv_heads * self.head_dim, self.init_std
        return [
            gain("attention_norm.weight", d),
            TensorSpec("attention.wq.weight", (q, d), "rows", std, float8=True),
            TensorSpec("attention.wk.weight", (kv, d), "rows", std, float8=True),
            TensorSpec("attention.wv.weight", (kv, d), "rows", std, float8=True),
            TensorSpec("attention.wo.weight", (d, q), "cols", residual_std(std, self.n_layers), float8=True),
        ]

    def feed_forward_tensors(self, index: int) -> list[TensorSpec]:
        """Block `index`'s feed-forward: a SwiGLU of ffn_hidden_dim (a family whose feed-forward differs says so)."""
        return swiglu("feed_forward", self.dim, self.ffn_hidden_dim, self.init_std, self._residual_std)

    def model_tensors(self) -> list[TensorSpec]:
        """The parameters outside the blocks: the embedding, the final norm, and the output head unless it is the
        embedding (tied)."""
        embedding = TensorSpec("tok_embeddings.weight", (self.vocab_size, self.dim), "rows", self.init_std)
        head = [] if self.tie_embeddings else [dataclasses.replace(embedding, name="output.weight")]
        return [embedding, gain("norm.weight", self.dim), *head]

    def tensors(self) -> list[TensorSpec]:
        """Every parameter of the whole model, by its name in the model, in the model's order; a tied output matrix
        is the embedding, listed once."""
        embedding, *rest = self.model_tensors()
        return [embedding, *(t.in_block(i) for i in range(self.n_layers) for t in self.block_tensors(i)), *rest]

    def attention_span(self, index: int, seq_len: int) -> int:
        """The keys a query of block `index` is scored against in a sequence of `seq_len` tokens, for the attention
        FLOPs (project.model.flops): all of them (the causal mask's saving not counted, as PaLM and Megatron-LM)."""
        return seq_len

    def head_norms(self, index: int) -> HeadNorms | None:
        """Block `index`'s norms of each query and key head; None: a Llama's attention has none."""
        return None

    @property
    def _residual_std(self) -> float:
        return residual_std(self.init_std, self.n_layers)

    def mixture(self, index: int) -> Mixture | None:
        """Block `index`'s mixture of experts, for the planner's tensors and traffic; None: a dense SwiGLU of
        `ffn_hidden_dim` (every block of a dense Llama)."""
        return None

    def refuses_precision(self, precision: str) -> str | None:
        """Why this model cannot train under `trainer.precision` (an `error:` paragraph naming the fix), or None: a
        dense Llama trains under every precision Lightning offers."""
        return None

    def values_summed_each_step(self) -> int:
        """How many float32 values the model sums over every rank after each optimizer step (its step_statistics,
        where they change training: a mixture's routing biases), for the planner's traffic; 0 for a dense one."""
        return 0

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        # Meta's rule: 2/3 of 4*dim, scaled, rounded up to a multiple of `multiple_of`.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

"""A family's tensors as the rest of the platform sees them, known without building the model (and without torch).

Each family's config lists its parameters (`LlamaConfig.tensors`): name, shape, and how training treats each one:
how tensor parallelism splits it, its initial values' spread, whether weight decay applies, whether float8 may
convert its product, and what share of it a token's products use. Parameter counts and FLOPs (project.model.flops),
the planner's memory and traffic (project.planning), Hugging Face shapes (project.hf), initialization and the
optimizer's groups ask this list, never a family's class or a name's suffix.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# How tensor parallelism splits a tensor: "rows" (dim 0 of a matrix [out, in]: column-wise parallel, the vocabulary of
# an embedding), "cols" (dim 1: row-wise parallel), each of stacked experts' matrices alike; None: every rank holds it
# whole; "heads": whole too, but applied to each attention head's activations [B, T, heads, head_dim], of which a rank
# holds some (a per-head norm's gain, whose gradient the ranks then sum).
SPLITS = ("rows", "cols", "heads", None)


@dataclass(frozen=True)
class TensorSpec:
    name: str  # within a block (`attention.wq.weight`) or the model (`tok_embeddings.weight`)
    shape: tuple[int, ...]  # whole; a mixture's stacked experts [experts, out, in]
    split: str | None = None  # SPLITS
    std: float | None = None  # of its normal initial values; None: ones (a norm's gain)
    decay: bool = True  # whether AdamW's weight decay applies (not to a norm's gain)
    float8: bool = False  # a projection whose product float8 training may take (where its shape allows)
    used: float = 1.0  # the share of it one token's products use: top_k / experts of stacked experts, else all
    mixture: bool = False  # part of a mixture of experts: never float8; its router whole under tensor parallelism

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"{self.name}: split={self.split!r} is none of {SPLITS}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def experts(self) -> int | None:
        """How many experts' matrices it stacks along dim 0, or None for a plain matrix or vector."""
        return self.shape[0] if len(self.shape) == 3 else None

    @property
    def matrix(self) -> tuple[int, int]:
        """(rows, cols) of one matrix of it: a vector [n] is [n, 1], stacked experts each expert's."""
        return (self.shape[-2], self.shape[-1]) if len(self.shape) > 1 else (self.shape[0], 1)

    @property
    def per_token(self) -> int:
        """Its parameters one token's products use (all of a matrix, top_k of the stacked experts')."""
        return round(self.numel * self.used)

    def in_block(self, index: int) -> TensorSpec:
        """The same tensor named as the model names it in block `index`."""
        return dataclasses.replace(self, name=f"layers.{index}.{self.name}")


def gain(name: str, dim: int) -> TensorSpec:
    """A norm's gain: ones at first, no weight decay, whole on every tensor-parallel rank."""
    return TensorSpec(name, (dim,), std=None, decay=False)


def swiglu(prefix: str, dim: int, hidden: int, std: float, out_std: float, mixture: bool = False) -> list[TensorSpec]:
    """A SwiGLU's three matrices, w2(silu(w1 x) * w3 x): w1 and w3 column-wise parallel, w2 row-wise into the residual
    stream; float8 where not part of a mixture (whose shared expert is one)."""
    return [
        TensorSpec(f"{prefix}.w1.weight", (hidden, dim), "rows", std, float8=not mixture, mixture=mixture),
        TensorSpec(f"{prefix}.w3.weight", (hidden, dim), "rows", std, float8=not mixture, mixture=mixture),
        TensorSpec(f"{prefix}.w2.weight", (dim, hidden), "cols", out_std, float8=not mixture, mixture=mixture),
    ]


def residual_std(init_std: float, n_layers: int) -> float:
    """The spread of a projection into the residual stream: init_std / sqrt(2 * n_layers), as GPT-2 scales it, so
    that the stream's variance does not grow with depth."""
    return init_std / math.sqrt(2 * n_layers)


def own_name(name: str) -> str:
    """A parameter's name as its family lists it, without the parts wrappers put in the middle (torch's FSDP,
    activation checkpointing and compile name their wrapped module with a leading underscore; no family names a
    module so)."""
    return ".".join(part for part in name.split(".") if not part.startswith("_"))

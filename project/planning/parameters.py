"""Which parameters a rank holds: the model's tensors cut by tensor parallelism (torchtitan's plan, as
project.parallel.tensor_parallel applies it), pipeline stages (project.parallel.pipeline's split) and
the data-parallel shards of FSDP (dim-0 shards, the first ranks holding the rounded-up share)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from project.model.config import LlamaConfig, Mixture
from project.model.spec import TensorSpec
from project.parallel.float8_rules import takes_shape
from project.parallel.pipeline_layout import chunk_ranks, stage_layer_counts
from project.planning.candidates import Candidate

# Initial values one CPU core draws per second, a rank drawing its own shard's (project.model.initial_values):
# `python -m benchmarks.init` measured 95 to 130 million a second per rank (1 to 4 ranks of fsdp2, one
# thread each) on this project's 2-core CPU machine on 2026-11-25 (experiments/benchmarks/2026-11-25-vm-init.md).
# The dry run and the planner turn a rank's parameters into its seconds of initialization with it.
INIT_VALUES_PER_SECOND = 1.0e8


class Weight(NamedTuple):
    rows: int  # dim 0 of a matrix, the dimension FSDP shards; of stacked experts, each expert's
    cols: int
    tensor_split: str | None  # "rows" (column-wise parallel, vocabulary), "cols" (row-wise parallel), None: replicated
    experts: int | None = None  # a mixture's experts stacked [experts, rows, cols] (families/moe/model.py: Experts)
    used: float = 1.0  # of the stacked experts, the share one token's products go through (top_k / experts)
    mixture: bool = False  # part of a mixture of experts: never float8; its router whole under tensor parallelism

    @property
    def numel(self) -> int:
        return (self.experts or 1) * self.rows * self.cols

    @property
    def per_token(self) -> float:
        """Its parameters one token multiplies by (its products: all of a matrix, top_k of the experts')."""
        return self.numel * self.used

    def local(self, tp: int, ep: int = 1) -> Weight:
        """What a rank holds of it: a tensor-parallel rank's part (of stacked experts, of each one's hidden units),
        an expert-parallel rank's experts (each receiving `ep` times the share of a group's tokens, so that a token's
        products stay the same)."""
        held = self if self.experts is None else self._replace(experts=self.experts // ep, used=self.used * ep)
        if tp == 1:  # whole, and still saying how tensor parallelism would split it
            return held
        if self.tensor_split == "rows":
            return held._replace(rows=self.rows // tp, tensor_split=None)
        if self.tensor_split == "cols":
            return held._replace(cols=self.cols // tp, tensor_split=None)
        return held


def weight(tensor: TensorSpec) -> Weight:
    """The planner's view of one of a family's tensors (project.model.spec)."""
    rows, cols = tensor.matrix
    return Weight(rows, cols, tensor.split, tensor.experts, tensor.used, tensor.mixture)


def block_weights(config: LlamaConfig, index: int = 0) -> list[Weight]:
    """Block `index`'s tensors, whole, in the order the block holds them."""
    return list(_block_weights(_config_key(config), index))


# The planner asks for every block of every candidate layout (a million times for the 405B's plan): each kind of
# block's list, and each layout's view of a rank's blocks, is made once, keyed by the config's values.
def _config_key(config: LlamaConfig) -> tuple[type[LlamaConfig], tuple, tuple]:
    fields = vars(config)
    values = tuple(fields.values())
    try:
        hash(values)
    except TypeError:  # a dict among them (rope_scaling)
        values = tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in values)
    return type(config), tuple(fields), values


@functools.lru_cache(maxsize=4096)
def _block_weights(key: tuple[type[LlamaConfig], tuple, tuple], index: int) -> tuple[Weight, ...]:
    kind, names, values = key
    config = kind(**dict(zip(names, values, strict=True)))
    return tuple(weight(t) for t in config.block_tensors(index))


@functools.lru_cache(maxsize=4096)
def _local_blocks(key: tuple, indices: tuple[int, ...], tp: int, ep: int) -> tuple[tuple[Weight, ...], ...]:
    return tuple(tuple(w.local(tp, ep) for w in _block_weights(key, i)) for i in indices)


def mixture_of(config: LlamaConfig, index: int) -> Mixture | None:
    """Block `index`'s mixture of experts, None for a dense feed-forward."""
    return config.mixture(index)


def float8_weights(config: LlamaConfig, candidate: Candidate, index: int = 0) -> list[bool]:
    """For each of `block_weights(config, index)`: whether the candidate trains it in float8 (strategy.float8: the
    projections whose shapes, as each tensor-parallel rank holds them, float8 kernels take; project.parallel.
    float8_rules; a mixture's tensors never)."""
    weights = block_weights(config, index)
    if not candidate.float8:
        return [False] * len(weights)
    return [
        w.cols > 1 and not w.mixture and takes_shape((local.rows, local.cols))
        for w, local in ((w, w.local(candidate.tensor_parallel)) for w in weights)
    ]


def rank_layer_ids(config: LlamaConfig, candidate: Candidate, pipeline_rank: int) -> list[list[int]]:
    """The blocks (their indices in the model) of each stage chunk this pipeline rank runs (all blocks in one chunk
    without a pipeline)."""
    if candidate.pipeline_parallel == 1:
        return [list(range(config.n_layers))]
    n_chunks = candidate.pipeline_parallel * candidate.virtual_stages
    counts = stage_layer_counts(config.n_layers, n_chunks)
    starts = [sum(counts[:s]) for s in range(n_chunks)]
    ranks = chunk_ranks(candidate.schedule or "1f1b", candidate.pipeline_parallel, n_chunks)
    return [list(range(starts[s], starts[s] + counts[s])) for s in range(n_chunks) if ranks[s] == pipeline_rank]


def rank_layers(config: LlamaConfig, candidate: Candidate, pipeline_rank: int) -> list[int]:
    """How many blocks each stage chunk this pipeline rank runs holds (all blocks in one chunk without a pipeline)."""
    return [len(ids) for ids in rank_layer_ids(config, candidate, pipeline_rank)]


def held_blocks(config: LlamaConfig, candidate: Candidate, pipeline_rank: int) -> list[int]:
    """The indices of every block this pipeline rank holds."""
    return [i for ids in rank_layer_ids(config, candidate, pipeline_rank) for i in ids]


def holds_first_and_last(candidate: Candidate, pipeline_rank: int) -> tuple[bool, bool]:
    """Whether this pipeline rank holds the embedding (first chunk) and the output head (last chunk)."""
    if candidate.pipeline_parallel == 1:
        return True, True
    n_chunks = candidate.pipeline_parallel * candidate.virtual_stages
    ranks = chunk_ranks(candidate.schedule or "1f1b", candidate.pipeline_parallel, n_chunks)
    return ranks[0] == pipeline_rank, ranks[-1] == pipeline_rank


def local_block(config: LlamaConfig, candidate: Candidate, index: int) -> list[Weight]:
    """Block `index`'s tensors as one rank holds them after tensor and expert parallelism."""
    (block,) = _local_blocks(_config_key(config), (index,), candidate.tensor_parallel, candidate.expert_parallel)
    return list(block)


def rank_blocks(config: LlamaConfig, candidate: Candidate, pipeline_rank: int = 0) -> list[list[Weight]]:
    """Each block's tensors one rank holds after tensor, expert and pipeline parallelism, before data-parallel
    sharding."""
    held = tuple(held_blocks(config, candidate, pipeline_rank))
    blocks = _local_blocks(_config_key(config), held, candidate.tensor_parallel, candidate.expert_parallel)
    return [list(block) for block in blocks]


def rank_own(config: LlamaConfig, candidate: Candidate, pipeline_rank: int = 0) -> list[Weight]:
    """The tensors besides the blocks one rank holds: the embedding on the first chunk's, the final norm and the
    output head (unless tied to the embedding on the same rank) on the last's."""
    first, last = holds_first_and_last(candidate, pipeline_rank)
    tensors = {t.name: weight(t) for t in config.model_tensors()}
    embedding = tensors["tok_embeddings.weight"]
    own = [embedding] if first else []
    if last:
        own.append(tensors["norm.weight"])
        if not config.tie_embeddings or not first:  # a tied head on another stage holds a copy of the embedding
            own.append(tensors.get("output.weight", embedding))
    return [w.local(candidate.tensor_parallel) for w in own]


def rank_weights(config: LlamaConfig, candidate: Candidate, pipeline_rank: int = 0) -> list[Weight]:
    """The tensors one rank holds after tensor, expert and pipeline parallelism, before data-parallel sharding."""
    blocks = rank_blocks(config, candidate, pipeline_rank)
    return [w for block in blocks for w in block] + rank_own(config, candidate, pipeline_rank)


def unsharded_parameters(config: LlamaConfig, candidate: Candidate, pipeline_rank: int = 0) -> int:
    return sum(w.numel for w in rank_weights(config, candidate, pipeline_rank))


def shard_ranks(candidate: Candidate, weight: Weight) -> int:
    """The ranks FSDP2 shards a tensor over: data x context; a mixture's experts split by expert parallelism, the
    ranks holding the same experts (project.parallel.fsdp2, over `expert_data`)."""
    if weight.experts is not None and candidate.expert_parallel > 1:
        return candidate.expert_shard_ranks
    return candidate.shard_ranks


def shard_numel(weight: Weight, ranks: int) -> int:
    """The parameters of the first (largest) of FSDP2's shards of `weight` over `ranks`: dim 0 cut into `ranks` pieces
    rounded up; stacked experts along a width the ranks divide (project.parallel.fsdp2.stacked_experts_by_width),
    else along dim 0, the experts."""
    if weight.experts is not None:
        if weight.rows % ranks == 0 or weight.cols % ranks == 0:
            return weight.numel // ranks
        return math.ceil(weight.experts / ranks) * weight.rows * weight.cols
    return math.ceil(weight.rows / ranks) * weight.cols


def sharded_parameters(config: LlamaConfig, candidate: Candidate, pipeline_rank: int = 0) -> int:
    """Parameters of data-parallel rank 0's shards: FSDP2 cuts each tensor into dp pieces (dp x cp under context
    parallelism; `shard_numel`), the first ones rounded up."""
    return sum(shard_numel(w, shard_ranks(candidate, w)) for w in rank_weights(config, candidate, pipeline_rank))

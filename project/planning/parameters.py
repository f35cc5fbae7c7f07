"""Which parameters a rank holds: the model's tensors cut by tensor parallelism (torchtitan's plan, as
project.parallel.tensor_parallel applies it), pipeline stages (project.parallel.pipeline's split) and
the data-parallel shards of FSDP (dim-0 shards, the first ranks holding the rounded-up share)."""

from __future__ import annotations

import math
from typing import NamedTuple

from project.model.config import LlamaConfig
from project.parallel.float8_rules import takes_shape
from project.parallel.pipeline_layout import chunk_ranks, stage_layer_counts
from project.planning.candidates import Candidate

# Initial values one CPU core draws per second, a rank drawing its own shard's (project.model.initial_values):
# `python -m project.tooling.bench_init` measured 95 to 130 million a second per rank (1 to 4 ranks of fsdp2, one
# thread each) on this project's 2-core CPU machine on 2026-11-25 (experiments/benchmarks/2026-11-25-vm-init.md).
# The dry run and the planner turn a rank's parameters into its seconds of initialization with it.
INIT_VALUES_PER_SECOND = 1.0e8


class Weight(NamedTuple):
    rows: int  # dim 0, the dimension FSDP shards
    cols: int
    tensor_split: str | None  # "rows" (column-wise parallel, vocabulary), "cols" (row-wise parallel), None: replicated

    def local(self, tp: int) -> Weight:
        if self.tensor_split == "rows":
            return Weight(self.rows // tp, self.cols, None)
        if self.tensor_split == "cols":
            return Weight(self.rows, self.cols // tp, None)
        return self


def block_weights(config: LlamaConfig) -> list[Weight]:
    h, kv, f = config.dim, config.n_kv_heads * config.head_dim, config.ffn_hidden_dim
    return [
        Weight(h, 1, None),  # attention_norm
        Weight(h, h, "rows"),
        Weight(kv, h, "rows"),
        Weight(kv, h, "rows"),  # wq, wk, wv: column-wise parallel
        Weight(h, h, "cols"),  # wo: row-wise parallel
        Weight(h, 1, None),  # ffn_norm
        Weight(f, h, "rows"),
        Weight(f, h, "rows"),
        Weight(h, f, "cols"),  # w1, w3, w2
    ]


def float8_weights(config: LlamaConfig, candidate: Candidate) -> list[bool]:
    """For each of `block_weights`: whether the candidate trains it in float8 (strategy.float8: the projections
    whose shapes, as each tensor-parallel rank holds them, float8 kernels take; project.parallel.float8_rules)."""
    if not candidate.float8:
        return [False] * len(block_weights(config))
    return [
        w.cols > 1 and takes_shape((local.rows, local.cols))
        for w, local in ((w, w.local(candidate.tensor_parallel)) for w in block_weights(config))
    ]


def rank_layers(config: LlamaConfig, candidate: Candidate, pipeline_rank: int) -> list[int]:
    """Blocks of each stage chunk this pipeline rank runs (all blocks in one chunk without a pipeline)."""
    if candidate.pipeline_parallel == 1:
        return [config.n_layers]
    n_chunks = candidate.pipeline_parallel * candidate.virtual_stages
    counts = stage_layer_counts(config.n_layers, n_chunks)
    ranks = chunk_ranks(candidate.schedule or "1f1b", candidate.pipeline_parallel, n_chunks)
    return [counts[s] for s in range(n_chunks) if ranks[s] == pipeline_rank]


def holds_first_and_last(candidate: Candidate, pipeline_rank: int) -> tuple[bool, bool]:
    """Whether this pipeline rank holds the embedding (first chunk) and the output head (last chunk)."""
    if candidate.pipeline_parallel == 1:
        return True, True
    n_chunks = candidate.pipeline_parallel * candidate.virtual_stages
    ranks = chunk_ranks(candidate.schedule or "1f1b", candidate.pipeline_parallel, n_chunks)
    return ranks[0] == pipeline_rank, ranks[-1] == pipeline_rank


def rank_weights(config: LlamaConfig, candidate: Candidate, pipeline_rank: int = 0) -> list[Weight]:
    """The tensors one rank holds after tensor and pipeline parallelism, before data-parallel sharding."""
    tp = candidate.tensor_parallel
    weights = block_weights(config) * sum(rank_layers(config, candidate, pipeline_rank))
    first, last = holds_first_and_last(candidate, pipeline_rank)
    vocabulary = Weight(config.vocab_size, config.dim, "rows")
    if first:
        weights.append(vocabulary)  # the embedding, split over the vocabulary
    if last:
        weights.append(Weight(config.dim, 1, None))  # final norm
        if not config.tie_embeddings or not first:
            weights.append(vocabulary)  # output head
    return [w.local(tp) if tp > 1 else w for w in weights]


def unsharded_parameters(config: LlamaConfig, candidate: Candidate, pipeline_rank: int = 0) -> int:
    return sum(w.rows * w.cols for w in rank_weights(config, candidate, pipeline_rank))


def sharded_parameters(config: LlamaConfig, candidate: Candidate, pipeline_rank: int = 0) -> int:
    """Parameters of data-parallel rank 0's shards: FSDP2 cuts each tensor on dim 0 into dp pieces (dp x cp under
    context parallelism), the first ones rounded up. FSDP1 (strategy fsdp) flattens each block and pads it to dp
    equal pieces."""
    dp = candidate.shard_ranks
    weights = rank_weights(config, candidate, pipeline_rank)
    if candidate.strategy == "fsdp":
        per_block = len(block_weights(config))
        blocks = [weights[i : i + per_block] for i in range(0, len(weights), per_block)]  # the root: the rest
        return sum(math.ceil(sum(w.rows * w.cols for w in unit) / dp) for unit in blocks)
    return sum(math.ceil(w.rows / dp) * w.cols for w in weights)

"""Time per optimizer step of a layout: compute at an achievable fraction of the peak, the communication
each parallelism adds (over the cluster's links, overlapped where the strategy overlaps it), and the
pipeline bubble.

Collectives take the ring algorithm's time (Thakur et al. 2005; NCCL's "bus bandwidth"): an all-reduce of
B bytes over n ranks moves 2(n-1)/n * B per rank, an all-gather or reduce-scatter (n-1)/n * B, plus a fixed
latency each. A group of consecutive ranks that fits in a node uses the node's links, else the links
between nodes (ranks are laid out tensor-parallel innermost, then context, then data, then pipeline: MeshShape).
Context parallelism divides each rank's tokens, and adds per block and microbatch an all-gather of the sequence's
keys and values in the forward (again under full recompute) and a reduce-scatter of their gradients in the backward
(project.parallel.context_parallel), on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass

from project.model.config import LlamaConfig
from project.planning.candidates import Candidate
from project.planning.cluster import Cluster
from project.planning.memory import COMPUTE_BYTES, GRAD_REDUCE_BYTES, STORAGE_BYTES
from project.planning.parameters import block_weights, holds_first_and_last, rank_layers, unsharded_parameters


@dataclass
class StepTime:
    """Seconds per optimizer step, by where they go; `total` is the sum."""

    compute: float  # every microbatch's forward and backward on the slowest rank, recompute included
    tensor_parallel: float  # the all-reduces inside each block: on the critical path
    pipeline_transfers: float
    bubble: float  # pipeline ranks idle while the schedule fills and drains
    data_parallel: float  # gradient reduction and parameter gathering not hidden behind compute
    context_parallel: float = 0.0  # the keys' and values' all-gathers and their gradients' reduce-scatters

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.tensor_parallel
            + self.pipeline_transfers
            + self.bubble
            + self.data_parallel
            + self.context_parallel
        )


def block_flops_per_token(config: LlamaConfig, seq_len: int, recompute: str) -> tuple[float, float]:
    """(model, hardware) FLOPs per token of one block's forward and backward. Model FLOPs are 6 per
    parameter plus the attention term (project.model.flops); hardware FLOPs add what is recomputed: the
    whole forward again under full recompute (x 4/3), QK^T again in a fused attention's backward otherwise."""
    matmul = sum(w.rows * w.cols for w in block_weights(config) if w.cols > 1)
    attention = 12 * config.dim * seq_len
    model = 6 * matmul + attention
    extra = {"full": 2 * matmul + attention / 3, "selective": attention / 6, "none": 0.0}[recompute]
    return model, model + extra


def head_flops_per_token(config: LlamaConfig, tokens: int = 1) -> float:
    """The output head's forward and backward per token, plus its forward again where the loss runs over
    several chunks of the microbatch's `tokens` (project.model.loss recomputes each chunk's logits)."""
    recompute = 2 if tokens > config.chunk_tokens else 0
    return (6 + recompute) * config.vocab_size * config.dim


def _ring(bytes_: float, ranks: int, bandwidth: float, latency: float, all_reduce: bool = False) -> float:
    if ranks <= 1:
        return 0.0
    volume = (2 if all_reduce else 1) * (ranks - 1) / ranks * bytes_
    return volume / bandwidth + latency


def step_time(
    config: LlamaConfig,
    candidate: Candidate,
    seq_len: int,
    precision: str,
    cluster: Cluster,
    achievable_fraction: float,
) -> StepTime:
    c, dp, tp, pp = candidate, candidate.data_parallel, candidate.tensor_parallel, candidate.pipeline_parallel
    compute_bytes = COMPUTE_BYTES[precision]
    rate = cluster.peak_flops("fp32" if compute_bytes == 4 else "bf16") * achievable_fraction
    latency = cluster.collective_latency_us * 1e-6
    cp = c.context_parallel
    tokens = seq_len * c.micro_batch_size // cp  # per microbatch, on each rank
    _, block_hw = block_flops_per_token(config, seq_len, c.recompute)  # a token's attention spans the whole sequence
    activation = tokens * config.dim * compute_bytes

    # The slowest pipeline rank's time per microbatch (the only rank without a pipeline).
    slowest = (0.0, 0.0, 0.0)
    for rank in range(pp):
        layers = sum(rank_layers(config, c, rank))
        first, last = holds_first_and_last(c, rank)
        flops = tokens * (layers * block_hw + (head_flops_per_token(config, tokens) if last else 0.0)) / tp
        # Per block: an all-reduce after attention and after the feed-forward, in the forward and again in
        # the backward (full recompute repeats the forward's); the embedding's output and the head's input
        # once each way. Sequence parallelism turns each all-reduce into a reduce-scatter and an all-gather:
        # the same bytes, twice the collectives.
        all_reduces = (6 if c.recompute == "full" else 4) * layers + 2 * first + 2 * last
        if c.sequence_parallel:
            tensor = 2 * all_reduces * _ring(activation, tp, cluster.bandwidth(tp), latency)
        else:
            tensor = all_reduces * _ring(activation, tp, cluster.bandwidth(tp), latency, all_reduce=True)
        if tp > 1:
            tensor += layers * cluster.tensor_parallel_block_overhead_ms * 1e-3
        chunks = len(rank_layers(config, c, rank)) if pp > 1 else 0
        boundary = activation / (tp if c.sequence_parallel else 1)
        transfers = (
            2 * chunks * (boundary / cluster.bandwidth(2 * tp * dp) + latency)
        )  # activations forward, gradients back
        if flops / rate + tensor + transfers > sum(slowest):
            slowest = (flops / rate, tensor, transfers)
    compute, tensor, transfers = (c.microbatches * x for x in slowest)
    context = 0.0
    if cp > 1:  # the keys and values of every rank's part, per block and microbatch (sharded by tensor parallelism)
        kv = seq_len * c.micro_batch_size * 2 * config.n_kv_heads * config.head_dim * compute_bytes / tp
        gathers = 2 if c.recompute == "full" else 1
        bandwidth = cluster.bandwidth(tp * cp)
        per_block = (gathers + 1) * _ring(kv, cp, bandwidth, latency)  # the gathers, and the gradients' reduce-scatter
        context = c.microbatches * sum(rank_layers(config, c, 0)) * per_block
    slot = sum(slowest)
    bubble = 0.0
    if pp > 1:
        interleaved = c.schedule in ("interleaved_1f1b", "looped_bfs")
        bubble = (pp - 1) / (c.virtual_stages if interleaved else 1) * slot

    data = _data_parallel_exposed(
        config, c, precision, cluster, latency, slowest[0] if cluster.overlaps_communication else 0.0
    )
    return StepTime(compute, tensor, transfers, bubble, data, context)


def _data_parallel_exposed(
    config: LlamaConfig, c: Candidate, precision: str, cluster: Cluster, latency: float, microbatch_compute: float
) -> float:
    """Seconds of data-parallel communication per step that compute does not hide (FSDP2 over data x context)."""
    dp = c.shard_ranks
    if dp == 1:
        return 0.0
    params = max(unsharded_parameters(config, c, r) for r in range(c.pipeline_parallel))
    bandwidth = cluster.bandwidth(c.tensor_parallel * dp)
    gather = _ring(params * COMPUTE_BYTES[precision], dp, bandwidth, latency)
    # FSDP1 under Lightning reduces in the compute dtype (FSDPPrecision); our FSDP2 in float32.
    reduce_bytes = COMPUTE_BYTES[precision] if c.strategy == "fsdp" else GRAD_REDUCE_BYTES
    reduce = _ring(params * reduce_bytes, dp, bandwidth, latency)
    if c.strategy == "ddp":  # one all-reduce of the gradients, bucketed behind the last microbatch's backward
        all_reduce = _ring(params * STORAGE_BYTES[precision], dp, bandwidth, latency, all_reduce=True)
        return max(0.0, all_reduce - 2 / 3 * microbatch_compute)
    if c.pipeline_parallel > 1:  # gathered once and kept; reduce-scattered after the last backward
        return max(0.0, 2 * gather - microbatch_compute) + reduce
    # FSDP: per microbatch, parameters gathered for the forward (and, ZeRO-3, again for the backward) and
    # gradients reduce-scattered, each block's overlapping the next block's compute.
    per_microbatch = (2 if c.zero_level == 3 else 1) * gather + reduce
    return c.microbatches * max(0.0, per_microbatch - microbatch_compute)

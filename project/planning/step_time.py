"""Time per optimizer step of a layout: compute at an achievable fraction of the peak, the communication
each parallelism adds (over the cluster's links, overlapped where the strategy overlaps it), and the
pipeline bubble.

The communication is project.planning.communication's collectives, the ones our strategies issue (tests/test_comms.py
holds them to a run's): each takes the ring algorithm's time (Thakur et al. 2005; NCCL's "bus bandwidth"), what its
buffers put on a rank's links over the links' bandwidth, plus a fixed latency per call. A group of consecutive ranks
that fits in a node uses the node's links, else the links between nodes (ranks are laid out tensor-parallel
innermost, then context, then data, then pipeline: MeshShape). Tensor and context parallelism's collectives are on
the critical path; data parallelism's hide behind compute where they overlap; the step's own reductions (the loss,
the gradient norm) are small and never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from project.model.config import LlamaConfig
from project.planning.candidates import Candidate
from project.planning.cluster import Cluster
from project.planning.communication import (
    Collective,
    context_parallel,
    data_parallel,
    expert_parallel,
    norm_gradients,
    pipeline_transfers,
    ring_passes,
    step_reductions,
    tensor_parallel,
)
from project.planning.memory import COMPUTE_BYTES
from project.planning.parameters import (
    block_weights,
    float8_weights,
    held_blocks,
    holds_first_and_last,
    rank_layers,
)


@dataclass
class StepTime:
    """Seconds per optimizer step, by where they go; `total` is the sum."""

    compute: float  # every microbatch's forward and backward on the slowest rank, recompute included
    tensor_parallel: float  # the all-reduces inside each block: on the critical path
    pipeline_transfers: float
    bubble: float  # pipeline ranks idle while the schedule fills and drains
    data_parallel: float  # gradient reduction and parameter gathering not hidden behind compute
    context_parallel: float = 0.0  # the keys' and values' all-gathers and their gradients' reduce-scatters
    reductions: float = 0.0  # the step's own: the loss's mean over the ranks, the gradient norm's
    expert_parallel: float = 0.0  # a mixture's tokens sent to their experts' ranks and back: on the critical path

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.tensor_parallel
            + self.pipeline_transfers
            + self.bubble
            + self.data_parallel
            + self.context_parallel
            + self.reductions
            + self.expert_parallel
        )


def block_flops_per_token(config: LlamaConfig, seq_len: int, recompute: str, index: int = 0) -> tuple[float, float]:
    """(model, hardware) FLOPs per token of block `index`'s forward and backward. Model FLOPs are 6 per
    parameter a token multiplies by (of a mixture, the gate and its top_k experts') plus the attention term over
    every pair of positions (PaLM's count, project.model.flops: what MFU is measured against). Hardware FLOPs are
    what the kernels compute: a fused causal attention kernel (recompute `selective` or `full`) only the pairs at or
    below the diagonal, half of them, where attention that keeps its scores (`none`) multiplies every pair and masks;
    plus what is recomputed: the whole forward again under full recompute (x 4/3), QK^T again in a fused
    attention's backward otherwise."""
    matmul = sum(w.per_token for w in block_weights(config, index) if w.cols > 1)
    attention = 12 * config.dim * seq_len
    model = 6 * matmul + attention
    computed = attention if recompute == "none" else attention / 2
    extra = {"full": 2 * matmul + computed / 3, "selective": computed / 6, "none": 0.0}[recompute]
    return model, 6 * matmul + computed + extra


def float8_flops_per_token(config: LlamaConfig, c: Candidate, index: int = 0) -> float:
    """Of block `index`'s hardware FLOPs per token (block_flops_per_token), those of its float8 products
    (strategy.float8): forward and backward of each float8 projection, and its forward again under full recompute."""
    weights = zip(block_weights(config, index), float8_weights(config, c, index))
    matmul = sum(w.per_token for w, f in weights if f)
    return (6 + 2 * (c.recompute == "full")) * matmul


def float8_cast_bytes(config: LlamaConfig, c: Candidate, tokens: int, compute_bytes: int, index: int = 0) -> float:
    """Bytes a block's float8 casts move in one microbatch of `tokens` tokens on a rank: each cast reads its tensor
    twice (its maximum, then the cast) and writes it as float8, for every float8 projection's input and output
    gradient (the rank's part under tensor parallelism) and its weight in the forward and again in the backward.
    Fused into neighbouring kernels by torch.compile, some of this is saved: an upper bound."""
    per_element = 2 * compute_bytes + 1
    moved = 0.0
    for w, float8 in zip(block_weights(config, index), float8_weights(config, c, index)):
        if float8:
            local = w.local(c.tensor_parallel)
            moved += tokens * (local.cols + local.rows) + 2 * local.rows * local.cols
    return moved * per_element


def head_flops_per_token(config: LlamaConfig, tokens: int = 1) -> float:
    """The output head's forward and backward per token, plus its forward again where the loss runs over
    several chunks of the microbatch's `tokens` (project.model.loss recomputes each chunk's logits)."""
    recompute = 2 if tokens > config.chunk_tokens else 0
    return (6 + recompute) * config.vocab_size * config.dim


def seconds(collectives: list[Collective], cluster: Cluster) -> float:
    """The collectives' time one after the other, each over the links its group spans."""
    latency = cluster.collective_latency_us * 1e-6
    return sum(x.seconds(cluster.bandwidth(x.span), latency) for x in collectives)


def step_time(
    config: LlamaConfig,
    candidate: Candidate,
    seq_len: int,
    precision: str,
    cluster: Cluster,
    achievable_fraction: float,
) -> StepTime:
    c, tp, pp = candidate, candidate.tensor_parallel, candidate.pipeline_parallel
    compute_bytes = COMPUTE_BYTES[precision]
    rate = cluster.peak_flops("fp32" if compute_bytes == 4 else "bf16") * achievable_fraction
    tokens = seq_len * c.micro_batch_size // c.context_parallel  # per microbatch, on each rank
    if c.float8:
        cluster.check_float8()
    latency = cluster.collective_latency_us * 1e-6

    # The slowest pipeline rank's time per microbatch (the only rank without a pipeline).
    slowest = (0.0, 0.0, 0.0, 0.0)
    slowest_rank = 0
    for rank in range(pp):
        _, last = holds_first_and_last(c, rank)
        blocks = sum(block_seconds(config, c, seq_len, tokens, compute_bytes, cluster, achievable_fraction, i)
                     for i in held_blocks(config, c, rank))  # fmt: skip
        compute = blocks + tokens * (head_flops_per_token(config, tokens) if last else 0.0) / tp / rate
        tensor = seconds(tensor_parallel(config, c, seq_len, precision, rank), cluster)
        if tp > 1:
            tensor += sum(rank_layers(config, c, rank)) * cluster.tensor_parallel_block_overhead_ms * 1e-3
        transfers = _pipeline_critical_path(config, c, seq_len, precision, rank, cluster, latency)
        experts = seconds(expert_parallel(config, c, seq_len, precision, rank), cluster)
        if compute + tensor + transfers + experts > sum(slowest):
            slowest, slowest_rank = (compute, tensor, transfers, experts), rank
    compute, tensor, transfers, experts = (c.microbatches * x for x in slowest)
    if pp > 1:  # a stage reduces its norms' gradients once per step (communication.norm_gradients)
        tensor += seconds(norm_gradients(config, c, precision, slowest_rank), cluster)
    # Every pipeline rank holds equally many blocks but for a remainder: the first's keys and values.
    context = c.microbatches * seconds(context_parallel(config, c, seq_len, precision, 0), cluster)
    if c.context_parallel_kv == "ring":
        context = c.microbatches * _ring_exposed(config, c, seq_len, precision, cluster, achievable_fraction, tokens)
    slot = sum(slowest)
    bubble = 0.0
    if pp > 1:
        interleaved = c.schedule in ("interleaved_1f1b", "looped_bfs")
        bubble = (pp - 1) / (c.virtual_stages if interleaved else 1) * slot

    microbatch_compute = slowest[0] if cluster.overlaps_communication else 0.0
    data = _data_parallel_exposed(config, c, precision, cluster, microbatch_compute)
    reductions = seconds(step_reductions(config, c, slowest_rank), cluster)
    return StepTime(compute, tensor, transfers, bubble, data, context, reductions, experts)


def _ring_exposed(
    config: LlamaConfig, c: Candidate, seq_len: int, precision: str, cluster: Cluster, fraction: float, tokens: int
) -> float:
    """Ring attention's transfers of one microbatch left on the critical path: a send and its receive share the
    time; the keys and values travel while the rank attends (in float32, at that rate) to the part in hand, the
    gradients once each step of the backward has computed them."""
    kv, gradients = ring_passes(config, c, seq_len, precision, 0)
    sends = [x for x in kv if x.kind == "send"], [x for x in gradients if x.kind == "send"]
    if not cluster.overlaps_communication:
        return seconds(sends[0], cluster) + seconds(sends[1], cluster)
    layers = sum(rank_layers(config, c, 0))
    attention = layers * tokens * 12 * config.dim * seq_len / 2 / c.tensor_parallel  # forward and backward, causal
    attention /= cluster.peak_flops("fp32") * fraction
    return max(0.0, seconds(sends[0], cluster) - attention) + seconds(sends[1], cluster)


def block_seconds(
    config: LlamaConfig,
    c: Candidate,
    seq_len: int,
    tokens: int,
    compute_bytes: int,
    cluster: Cluster,
    achievable_fraction: float,
    index: int,
) -> float:
    """Seconds of block `index`'s forward and backward for one microbatch of `tokens` tokens on a rank: its products
    at the compute dtype's achievable rate, split over the tensor-parallel ranks but for a mixture's router's (every
    rank of the group routes every token), its float8 products at float8's rate with their casts at memory speed."""
    rate = cluster.peak_flops("fp32" if compute_bytes == 4 else "bf16") * achievable_fraction
    _, hardware = block_flops_per_token(config, seq_len, c.recompute, index)  # attention spans the whole sequence
    passes = 6 + 2 * (c.recompute == "full")  # forward, backward, the forward again under full recompute
    whole = passes * sum(w.per_token for w in block_weights(config, index) if w.cols > 1 and w.tensor_split is None)
    float8 = float8_flops_per_token(config, c, index) if c.float8 else 0.0  # counted at float8's rate below
    if c.regather_kv and c.context_parallel > 1 and c.recompute != "full":  # attention's forward again, in backward
        hardware += 12 * config.dim * seq_len / 2 / 3  # a causal kernel's half of the pairs
    spent = tokens * ((hardware - whole - float8) / c.tensor_parallel + whole) / rate
    if float8:
        float8_rate = cluster.peak_flops("fp8") * achievable_fraction
        casts = float8_cast_bytes(config, c, tokens, compute_bytes, index) / (cluster.memory_gbps or 1) / 1e9
        spent += tokens * float8 / c.tensor_parallel / float8_rate + casts
    return spent


def _pipeline_critical_path(
    config: LlamaConfig, c: Candidate, seq_len: int, precision: str, rank: int, cluster: Cluster, latency: float
) -> float:
    """Seconds of transfers per microbatch on the schedule's critical path: in the steady state each of a rank's
    chunks waits for one transfer each way (its input in the forward, its output's gradient in the backward), each
    as long as one send of the rank's (communication.pipeline_transfers) takes."""
    sends = [x for x in pipeline_transfers(config, c, seq_len, precision, rank) if x.kind == "send"]
    if not sends:
        return 0.0
    send = sends[0]
    chunks = len(rank_layers(config, c, rank))
    return 2 * chunks * (send.bytes / send.calls / cluster.bandwidth(send.span) + latency)


def _data_parallel_exposed(
    config: LlamaConfig, c: Candidate, precision: str, cluster: Cluster, microbatch_compute: float
) -> float:
    """Seconds of data-parallel communication per step that compute does not hide (FSDP over data x context), on
    the pipeline rank that communicates the most."""
    exposed = 0.0
    for rank in range(c.pipeline_parallel):
        found = data_parallel(config, c, precision, rank)
        if not found:
            continue
        gather = seconds([x for x in found if x.kind == "all_gather"], cluster)
        reduce = seconds([x for x in found if x.kind == "reduce_scatter"], cluster)
        if c.strategy == "ddp":  # the gradients' buckets, reduced behind the last microbatch's backward
            rank_exposed = max(0.0, seconds(found, cluster) - 2 / 3 * microbatch_compute)
        elif c.pipeline_parallel > 1:  # gathered once and kept; reduce-scattered after the last backward
            rank_exposed = max(0.0, gather - microbatch_compute) + reduce
        else:
            # Each block's gathers and reductions overlapping the next block's compute, microbatch by microbatch.
            rank_exposed = c.microbatches * max(0.0, (gather + reduce) / c.microbatches - microbatch_compute)
        exposed = max(exposed, rank_exposed)
    return exposed

"""The collectives of one optimizer step on one rank: kind, process group, calls and bytes, as our strategies issue
them. project.planning.step_time turns them into seconds; benchmarks.count_collectives counts them in a run, and
tests/test_comms.py holds the two together for every layout (the same calls, bytes within 10%).

Bytes are those of the whole buffer each call works on: an all-reduce's or a broadcast's tensor, an all-gather's
output, a reduce-scatter's input, a send's or a receive's tensor. A rank's links carry what the ring algorithm moves
(Thakur et al. 2005; NCCL's "bus bandwidth"): 2(n-1)/n of that for an all-reduce over n ranks, (n-1)/n for an
all-gather, a reduce-scatter or an all-to-all, all of it for a broadcast, a send or a receive.

What each parallelism issues, per microbatch unless said (L: the rank's blocks; the embedding on the first pipeline
stage, the final norm and output head on the last; the microbatch's activation [b, s/c, h] in the compute dtype):
- Tensor parallelism (project.parallel.tensor_parallel, Megatron's plan): an all-reduce of the activation after
  attention and after the feed-forward in each block's forward, and one before each in its backward (4 per block, 6
  under full recompute, whose backward runs the forward again); after the embedding in the forward; before the head
  in the backward. Sequence parallelism turns each into an all-gather and a reduce-scatter of the same activation,
  and all-reduces each norm's weight gradient (h values; the norms see a part of the sequence each) where FSDP2
  reduces gradients: each microbatch, once per step in a pipeline stage. Loss parallel (the default) reduces the
  vocabulary-split logits' maxima, their exponentials' sums and the targets' logits: three all-reduces of the head's
  tokens in float32 per chunk of the loss, six where the loss runs in several chunks (each computed again in the
  backward).
- Context parallelism (project.parallel.context_parallel): per block, all-gathers of the keys and of the values of the
  whole sequence (again under full recompute) and reduce-scatters of their gradients: two calls each.
- Pipeline parallelism (torch's schedules): per chunk of the rank, its input received and its gradient sent back,
  its output sent on and the output's gradient received, wherever the neighbouring chunk is on another rank.
- FSDP2 (fully_shard per block and at each root: the model, or each pipeline chunk) over data x context: per
  microbatch each group's parameters all-gathered in the compute dtype for the forward and again for the backward,
  and its gradients reduce-scattered in float32; inside a pipeline, gathered once per step and kept, and
  reduce-scattered once after the last microbatch (torch's PipelineStage). Each tensor's dim 0 padded to a multiple
  of the ranks. strategy.reshard_after_forward=false gathers once per microbatch, for its forward, and keeps the
  parameters for its backward. HSDP (strategy.data_parallel_shard_size) gathers and reduce-scatters within its
  shard groups and all-reduces each reduce-scattered shard across them. strategy.gradient_sync=replicas_at_last
  all-reduces across the groups after a step's last microbatch only, at_last reduce-scatters only then too.
- strategy=fsdp is FSDP2 with Lightning's names (project.parallel.strategies.fsdp); the planner's fsdp layouts are
  its SHARD_GRAD_OP (strategy.reshard_after_forward=false).
- DDP: the gradients all-reduced once per step, in buckets of DDP's caps (1 MiB first, then 25 MiB).
- float8 (strategy.float8=tensorwise, project.parallel.float8): FSDP2 gathers the float8 weights as float8 (one
  byte each; a block's norms keep the compute dtype) and, before each forward that gathers them, all-reduces their
  maxima (a float32 each) once over each dimension they are split on (data x context, and tensor); under tensor
  parallelism each cast of a sharded tensor all-reduces its maximum (a float64): a row-parallel projection's input,
  a column-parallel one's output gradient, and the weights themselves where FSDP2 does not gather them in float8
  (forward and backward). Sequence parallelism's gathers in float8 (torchao's float8 styles, on GPUs: gloo has no
  float8 collectives) are counted in the compute dtype.
- Per step, whatever the layout: the loss averaged over every rank (an all-reduce of one float, for the loss-spike
  check); the gradient norm's reduction (DTensor's: one all-reduce of a float per parameter tensor
  per mesh dimension the tensors are split over); under a pipeline, the norm summed over the stages and the loss
  broadcast from the last stage.

Not counted: collectives of setup (broadcasts of the model, checkpoint loads), the first step's extras (DDP's
bucket rebuild at its second step, torch's pipeline shape exchange), those of logging and deciding steps (metrics
reduced, the stop-signal flag, barriers around checkpoints), and of validation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple

from project.model.config import LlamaConfig
from project.parallel.mesh import DENSE, MeshShape
from project.parallel.pipeline_layout import SPLIT_BACKWARD, chunk_ranks
from project.planning.candidates import Candidate
from project.planning.memory import COMPUTE_BYTES, GRAD_REDUCE_BYTES, STORAGE_BYTES
from project.planning.parameters import (
    Weight,
    block_weights,
    float8_weights,
    held_blocks,
    holds_first_and_last,
    local_block,
    mixture_of,
    rank_layers,
    rank_own,
    rank_weights,
    shard_numel,
    weight,
)

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")
# What a rank's links carry per byte of the buffer, over n ranks (the ring algorithm).
RING = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}
FLOAT = 4  # norms and losses: float32
FLOAT8 = 1  # a float8 value
INT64 = 8  # a mixture's token counts per expert
EXPERTS = ("expert", "expert_data")  # expert parallelism's groups (dimension_of)
HSDP = ("data_shard", "data_replicate")  # HSDP's groups
AMAX = 8  # torchao's maximum of a sharded tensor, reduced as a float64
# DDP's gradient buckets (torch.distributed's defaults): the first one small, so that communication starts early.
DDP_FIRST_BUCKET_BYTES = 2**20
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Collective:
    """Calls of one kind on one process group, and the bytes of their buffers together."""

    kind: str
    group: str  # the mesh dimensions the group spans: "tensor", "data x context", "pipeline", ... (group_name)
    ranks: int
    span: int  # consecutive ranks its links reach over: inside a node if it fits (Cluster.bandwidth)
    calls: float
    bytes: float
    part: str  # what step_time counts it in: tensor_parallel, context_parallel, pipeline, data_parallel or step

    def seconds(self, bandwidth: float, latency: float) -> float:
        """The ring algorithm's time: the bytes a rank's links carry over their bandwidth, plus a latency each call."""
        return RING[self.kind](self.ranks) * self.bytes / bandwidth + self.calls * latency


def group_name(shape: MeshShape, dims: Iterable[str]) -> str:
    """The dimensions of `dims` that have more than one rank, outermost first: "data x context"; "" for none."""
    return " x ".join(d for d in DENSE if d in set(dims) and shape.dimensions[d].size > 1)


def dimension_of(ranks: Iterable[int], shape: MeshShape) -> str:
    """The mesh dimensions along which a process group's global ranks differ (group_name's form), for a group a run
    reports by its ranks: "" for a group of one rank. Under expert parallelism a group that is part of the data x
    context ranks it spans is one of the groups that regroup them (MeshShape): "expert" (neighbours that split a
    mixture's experts) or "expert_data" (the ranks that hold the same experts); under HSDP, "data_shard" (neighbours
    that shard each weight) or "data_replicate" (the ranks that hold the same shards). A group that is also a group of
    the dense dimensions takes their name."""
    ranks = sorted(set(ranks))
    varying = [d for d in DENSE if len({shape.coordinate(r, d) for r in ranks}) > 1]
    regrouped = (EXPERTS if shape.expert_parallel > 1 else ()) + (HSDP if shape.hybrid else ())
    if regrouped and ranks != shape.group(ranks[0], varying):
        for name in regrouped:
            if ranks == shape.group(ranks[0], (name,)):
                return name
    return " x ".join(varying)


class _Groups:
    """The process groups of a layout: ranks and span of each, by the dimensions it spans."""

    def __init__(self, c: Candidate):
        self.shape = c.shape
        # The consecutive ranks a group along a dimension reaches over: the dimension and all inside it; a pipeline's
        # sends reach the next stage only.
        dims = self.shape.dimensions
        self._spans = {d: dims[d].size * dims[d].stride for d in ("tensor", "context", "data")}
        self._spans |= {"pipeline": 2 * dims["pipeline"].stride, "world": self.shape.world_size}

    def collective(self, kind: str, dims: Iterable[str], calls: float, bytes_: float, part: str) -> Collective | None:
        dims = tuple(dims)
        if dims in (("expert",), ("expert_data",), ("data_shard",), ("data_replicate",)):
            return self._regrouped_collective(kind, dims[0], calls, bytes_, part)
        ranks = math.prod(self.shape.dimensions[d].size for d in dims)
        if ranks == 1 or calls == 0:  # a group of one rank communicates nothing (FSDP2 and DTensor call nothing)
            return None
        if set(dims) == set(DENSE):
            span = self._spans["world"]
        else:
            span = max(self._spans[d] for d in dims)
        return Collective(kind, group_name(self.shape, dims), ranks, span, calls, bytes_, part)

    def _regrouped_collective(self, kind: str, group: str, calls: float, bytes_: float, part: str) -> Collective | None:
        """On a group that regroups data x context, the first rank's: the expert group ("expert"), the ranks holding
        the same experts ("expert_data"), HSDP's shard group ("data_shard") or the ranks holding the same shards
        ("data_replicate"); named as a run's groups are (dimension_of)."""
        ranks = self.shape.group(0, (group,))
        if len(ranks) == 1 or calls == 0:
            return None
        return Collective(kind, dimension_of(ranks, self.shape), len(ranks), max(ranks) + 1, calls, bytes_, part)


def _kept(collectives: Iterable[Collective | None]) -> list[Collective]:
    return [c for c in collectives if c is not None]


def _local(weights: list[Weight], tp: int) -> list[Weight]:
    return [w.local(tp) if tp > 1 else w for w in weights]


def tensor_parallel(config: LlamaConfig, c: Candidate, seq_len: int, precision: str, rank: int = 0) -> list[Collective]:
    """One microbatch's tensor-parallel collectives on pipeline rank `rank` (module docstring)."""
    if c.tensor_parallel == 1:
        return []
    groups, compute = _Groups(c), COMPUTE_BYTES[precision]
    blocks = held_blocks(config, c, rank)
    layers = len(blocks)
    mixtures = [m for m in (mixture_of(config, i) for i in blocks) if m is not None]
    first, last = holds_first_and_last(c, rank)
    tokens = seq_len * c.micro_batch_size // c.context_parallel
    activation = tokens * config.dim * compute
    # Megatron's f and g: per block two in the forward and two in the backward (the forward again under full
    # recompute); the embedding's output in the forward, the head's input in the backward. A mixture of experts'
    # block reduces around attention as a dense block does, and around its shared expert (a SwiGLU split as a dense
    # one) where it has one; under sequence parallelism it gathers the mixture's input in the forward and its
    # output's gradient in the backward. Its routed experts' results are summed over the group in the forward (again
    # under full recompute), and their tokens' gradients in the backward: top_k copies of each token
    # (project.parallel.expert_parallel).
    again = c.recompute == "full"
    per_sub_layer = 3 if again else 2
    reductions = 2 * per_sub_layer * (layers - len(mixtures)) + first + last
    reductions += per_sub_layer * sum(2 if m.shared else 1 for m in mixtures)
    routed, routed_bytes = routed_reductions(config, c, seq_len, precision, rank)
    part, tensor = "tensor_parallel", ("tensor",)
    if c.sequence_parallel:
        shared = per_sub_layer * sum(m.shared for m in mixtures)  # inside the mixture: on its gathered input
        gathers = 2 * per_sub_layer * layers + first + last
        found = [
            groups.collective("all_gather", tensor, gathers, gathers * activation, part),
            groups.collective("reduce_scatter", tensor, reductions - shared, (reductions - shared) * activation, part),
            groups.collective("all_reduce", tensor, routed + shared, routed_bytes + shared * activation, part),
        ]
    else:
        found = [
            groups.collective("all_reduce", tensor, reductions + routed, reductions * activation + routed_bytes, part)
        ]
    if c.pipeline_parallel == 1:
        found += norm_gradients(config, c, precision, rank)
    if last:  # loss parallel: maxima, sums of exponentials and the targets' logits of each chunk of tokens
        positions = seq_len // c.context_parallel
        span = max(1, config.chunk_tokens // c.micro_batch_size)  # project.model.loss: positions per chunk
        chunks = math.ceil(positions / span)
        passes = 1 if chunks == 1 else 2  # several chunks are each computed again in the backward
        found.append(groups.collective("all_reduce", tensor, 3 * chunks * passes, 3 * tokens * FLOAT * passes, part))
    casts = sum(_float8_tensor_casts(config, c, i) for i in blocks)
    found.append(groups.collective("all_reduce", tensor, casts, casts * AMAX, part))
    # Each mixture's routing, the group's first rank's broadcast to the others (RouteAlike): float32 scores, weights
    # and choices of every token, in each forward (again under full recompute).
    forwards = 2 if again else 1
    routing = sum(tokens * (m.experts + 2 * m.top_k) * FLOAT for m in mixtures)
    found.append(groups.collective("broadcast", tensor, forwards * len(mixtures), forwards * routing, part))
    return _kept(found)


def routed_reductions(
    config: LlamaConfig, c: Candidate, seq_len: int, precision: str, rank: int = 0
) -> tuple[int, float]:
    """(calls, bytes) of one microbatch's all-reduces of a mixture's routed experts over the tensor-parallel group on
    pipeline rank `rank` (project.parallel.expert_parallel): per mixture block, the results in the forward (again under
    full recompute) and their tokens' gradients in the backward, top_k copies of each token of the sequence."""
    if c.tensor_parallel == 1:
        return 0, 0.0
    mixtures = [m for m in (mixture_of(config, i) for i in held_blocks(config, c, rank)) if m is not None]
    per_sub_layer = 3 if c.recompute == "full" else 2
    tokens = seq_len * c.micro_batch_size // c.context_parallel
    copies = sum(tokens * m.top_k for m in mixtures)
    return per_sub_layer * len(mixtures), per_sub_layer * copies * config.dim * COMPUTE_BYTES[precision]


def _float8_tensor_casts(config: LlamaConfig, c: Candidate, index: int) -> int:
    """A block's float8 casts of tensor-parallel-sharded tensors per microbatch, each scaled by the whole tensor's
    maximum, one all-reduce each (torchao's casts of DTensors): a row-parallel projection's input in the forward
    (again under full recompute), a column-parallel one's output gradient in the backward, and each float8 weight in
    the forward (again under full recompute) and the backward, unless FSDP2 gathers it in float8 with its scale."""
    again = c.recompute == "full"
    weights = not float8_gathers(c)
    casts = 0
    for w, float8 in zip(block_weights(config, index), float8_weights(config, c, index)):
        if float8:
            casts += (w.tensor_split == "cols") * (1 + again) + (w.tensor_split == "rows")
            casts += weights * (2 + again)
    return casts


def norm_gradients(config: LlamaConfig, c: Candidate, precision: str, rank: int = 0) -> list[Collective]:
    """Gains whose gradient each tensor-parallel rank holds a part of, all-reduced over the tensor-parallel ranks where
    FSDP2 reduces gradients (each microbatch; once per step in a pipeline stage, which accumulates its microbatches'
    gradients before reducing them): under sequence parallelism the residual stream's norms (each rank sees a part of
    the sequence), and always those applied to each head (project.model.spec's "heads": each rank holds some)."""
    if c.tensor_parallel == 1:
        return []
    held = [w for i in held_blocks(config, c, rank) for w in block_weights(config, i)]
    final = (
        [weight(t) for t in config.model_tensors() if t.name == "norm.weight"]
        if holds_first_and_last(c, rank)[1]
        else []
    )
    # Gains are the family's vectors ([n] as a Weight of one column); "heads": applied to each head.
    gains = [
        w
        for w in held + final
        if w.tensor_split == "heads" or (c.sequence_parallel and w.tensor_split is None and w.cols == 1)
    ]
    size = sum(w.numel for w in gains) * COMPUTE_BYTES[precision]
    return _kept([_Groups(c).collective("all_reduce", ("tensor",), len(gains), size, "tensor_parallel")])


def context_parallel(
    config: LlamaConfig, c: Candidate, seq_len: int, precision: str, rank: int = 0
) -> list[Collective]:
    """One microbatch's context-parallel collectives on pipeline rank `rank`: the keys and the values of every block
    gathered (twice under full recompute, or with regather_kv: again in the backward), their gradients
    reduce-scattered, each its own call."""
    if c.context_parallel == 1:
        return []
    groups = _Groups(c)
    layers = sum(rank_layers(config, c, rank))
    # Keys and values of the whole sequence (gathered), the rank's heads of them.
    kv = (
        seq_len
        * c.micro_batch_size
        * 2
        * config.kv_heads
        * config.head_dim
        * COMPUTE_BYTES[precision]
        / c.tensor_parallel
    )
    gathers = 2 if c.recompute == "full" or c.regather_kv else 1
    part, context = "context_parallel", ("context",)
    ring = [x for passes in ring_passes(config, c, seq_len, precision, rank) for x in passes]
    if ring:
        gathers = 0
    # A mixture's balancing loss sums each sequence's routed tokens and scores per expert, and its tokens, over the
    # sequence's parts (ContextParallelSequenceSums): in the forward (again under full recompute), and in the backward
    # where the loss joins the objective (aux_loss_coef > 0; otherwise its graph is dropped).
    sums, summed = 0, 0.0
    for m in (mixture_of(config, i) for i in held_blocks(config, c, rank)):
        if m is not None:
            calls = (2 if c.recompute == "full" else 1) + m.balancing_loss
            sums, summed = sums + calls, summed + calls * c.micro_batch_size * (2 * m.experts + 1) * FLOAT
    return _kept(
        [
            groups.collective("all_gather", context, 2 * gathers * layers, gathers * layers * kv, part),
            groups.collective("reduce_scatter", context, 2 * layers if gathers else 0, layers * kv, part),
            groups.collective("all_reduce", context, sums, summed, part),
            *ring,
        ]
    )


def ring_passes(
    config: LlamaConfig, c: Candidate, seq_len: int, precision: str, rank: int = 0
) -> tuple[list[Collective], list[Collective]]:
    """Ring attention's sends and receives of one microbatch on pipeline rank `rank`: (those of the keys and values,
    which travel while the rank attends to the part in hand; those of their float32 gradients, sent on once a step
    of the backward has computed them). Per block: cp - 1 passes of K and V in each forward (again under full
    recompute) and in the backward, and cp passes of their gradients, the last to their own rank."""
    if c.context_parallel == 1 or c.context_parallel_kv != "ring":
        return [], []
    groups, layers, cp = _Groups(c), sum(rank_layers(config, c, rank)), c.context_parallel
    part = seq_len * c.micro_batch_size * config.kv_heads * config.head_dim / cp / c.tensor_parallel  # K's or V's
    forwards = 2 if c.recompute == "full" else 1
    kv_calls = 2 * layers * (forwards + 1) * (cp - 1)
    kv_bytes = kv_calls * part * COMPUTE_BYTES[precision]
    grad_calls = 2 * layers * cp
    grad_bytes = grad_calls * part * FLOAT

    def both(calls: float, size: float) -> list[Collective]:
        return _kept(
            groups.collective(kind, ("context",), calls, size, "context_parallel") for kind in ("send", "recv")
        )

    return both(kv_calls, kv_bytes), both(grad_calls, grad_bytes)


def expert_parallel(config: LlamaConfig, c: Candidate, seq_len: int, precision: str, rank: int = 0) -> list[Collective]:
    """One microbatch's expert-parallel all-to-alls on pipeline rank `rank` (project.parallel.expert_parallel): per
    mixture block, in the forward (again under full recompute) the experts' token counts (int64), the routed copies
    of the rank's tokens sent to their experts' ranks and the results sent back; in the backward, the results'
    gradients and the copies' gradients the other way. What a rank receives depends on the routing: planned as an
    even spread, the rank's own top_k copies of each token of its part of the sequence (every token of it on each
    tensor-parallel rank, which routes them all)."""
    if c.expert_parallel == 1:
        return []
    mixtures = [m for m in (mixture_of(config, i) for i in held_blocks(config, c, rank)) if m is not None]
    tokens = seq_len * c.micro_batch_size // c.context_parallel
    forwards = 2 if c.recompute == "full" else 1
    calls = (3 * forwards + 2) * len(mixtures)
    copies = sum((2 * forwards + 2) * tokens * m.top_k for m in mixtures)
    counts = sum(forwards * m.experts * INT64 for m in mixtures)
    size = copies * config.dim * COMPUTE_BYTES[precision] + counts
    return _kept([_Groups(c).collective("all_to_all", ("expert",), calls, size, "expert_parallel")])


def pipeline_transfers(
    config: LlamaConfig, c: Candidate, seq_len: int, precision: str, rank: int = 0
) -> list[Collective]:
    """One microbatch's sends and receives on pipeline rank `rank`: per chunk, its input in and its gradient back,
    its output on and the output's gradient in, wherever the neighbouring chunk runs on another rank."""
    if c.pipeline_parallel == 1:
        return []
    n_chunks = c.pipeline_parallel * c.virtual_stages
    ranks = chunk_ranks(c.schedule or "1f1b", c.pipeline_parallel, n_chunks)
    neighbours = 0  # chunk boundaries of this rank that cross to another rank
    for s in range(n_chunks):
        if ranks[s] != rank:
            continue
        neighbours += s > 0 and ranks[s - 1] != rank
        neighbours += s < n_chunks - 1 and ranks[s + 1] != rank
    tokens = seq_len * c.micro_batch_size // c.context_parallel
    boundary = tokens * config.dim * COMPUTE_BYTES[precision] / (c.tensor_parallel if c.sequence_parallel else 1)
    groups, pipeline = _Groups(c), ("pipeline",)
    return _kept(
        [
            groups.collective(kind, pipeline, neighbours, neighbours * boundary, "pipeline")
            for kind in ("send", "recv")  # each boundary: one way in the forward, the other in the backward
        ]
    )


class _FSDP2Group(NamedTuple):
    weights: list[Weight]  # local to the rank's tensor-parallel slice and expert-parallel experts
    float8: list[bool]  # which of them FSDP2 gathers in float8 (where float8_gathers)
    experts: bool  # a mixture's experts split by expert parallelism: sharded over the ranks holding the same ones


def _fsdp2_groups(config: LlamaConfig, c: Candidate, rank: int) -> list[_FSDP2Group]:
    """The parameters each FSDP2 group of the rank gathers at once: each block (under expert parallelism its
    mixture's experts a group of their own, project.parallel.fsdp2), and each root's own tensors (the embedding, the
    final norm and head), one root per pipeline chunk."""
    found = []
    for index in held_blocks(config, c, rank):
        weights, float8 = local_block(config, c, index), float8_weights(config, c, index)
        apart = [c.expert_parallel > 1 and w.experts is not None for w in weights]
        kept = [i for i, a in enumerate(apart) if not a]
        found.append(_FSDP2Group([weights[i] for i in kept], [float8[i] for i in kept], False))
        if any(apart):
            found.append(_FSDP2Group([w for w, a in zip(weights, apart) if a], [False] * sum(apart), True))
    if c.pipeline_parallel == 1:
        roots = [rank_own(config, c, rank)]
    else:  # the embedding's chunk and the head's chunk (the same chunk only without a pipeline)
        first, last = holds_first_and_last(c, rank)
        vocabulary = Weight(config.vocab_size, config.dim, "rows").local(c.tensor_parallel)
        roots = [r for r in ([vocabulary] if first else [], [Weight(config.dim, 1, None), vocabulary] if last else [])]
    return found + [_FSDP2Group(r, [False] * len(r), False) for r in roots if r]


def _padded(weights: list[Weight], ranks: int, sizes: Iterable[float]) -> float:
    """Bytes of the tensors FSDP2 gathers over `ranks`, each element of `sizes` bytes: every rank's shard as large as
    the first (parameters.shard_numel: dim 0 padded to a multiple of the ranks)."""
    return sum(shard_numel(w, ranks) * ranks * size for w, size in zip(weights, sizes))


def float8_gathers(c: Candidate) -> bool:
    """Whether FSDP2 gathers the float8 weights in float8 (tensorwise, sharded over several ranks: as
    LlamaParallelStrategy decides) and their scales are computed in one all-reduce before each forward that gathers
    them."""
    no_fsdp2 = c.pipeline_parallel > 1 and c.schedule in SPLIT_BACKWARD
    return c.float8 == "tensorwise" and c.strategy != "fsdp" and c.data_context_ranks > 1 and not no_fsdp2


def data_parallel(config: LlamaConfig, c: Candidate, precision: str, rank: int = 0) -> list[Collective]:
    """One step's gradient reductions and parameter gathers on pipeline rank `rank` (module docstring)."""
    n, m = c.data_context_ranks, c.microbatches
    groups, shard = _Groups(c), ("data", "context")
    if n == 1:
        return []
    part = "data_parallel"
    weights = rank_weights(config, c, rank)
    if c.strategy == "ddp":
        sizes = [w.numel * STORAGE_BYTES[precision] for w in weights]
        return _kept([groups.collective("all_reduce", shard, ddp_buckets(sizes), sum(sizes), part)])
    compute = COMPUTE_BYTES[precision]
    if c.pipeline_parallel > 1 and c.schedule in SPLIT_BACKWARD:
        return []  # no FSDP2 under these schedules (project.parallel.pipeline_layout refuses them with data parallel)
    in_float8 = float8_gathers(c)
    # A pipeline stage keeps its gathered parameters through the step; reshard_after_forward=False keeps them from
    # each micro batch's forward to its backward.
    gathers = 1 if c.pipeline_parallel > 1 else 2 * m if c.reshard_after_forward else m
    # strategy.gradient_sync: FSDP2 reduces after each micro batch, or holds back until the last.
    reduces = 1 if c.pipeline_parallel > 1 or c.gradient_sync == "at_last" else m
    across = 1 if c.pipeline_parallel > 1 or c.gradient_sync != "every_micro_batch" else m
    found = []
    for experts in (False, True):
        fsdp_groups = [g for g in _fsdp2_groups(config, c, rank) if g.experts == experts]
        ranks, dims = (c.expert_shard_ranks, ("expert_data",)) if experts else (c.shard_ranks, sharded_over(c))
        # A float8 weight is gathered as its float8 values.
        element_bytes = [[FLOAT8 if f and in_float8 else compute for f in g.float8] for g in fsdp_groups]
        gathered = sum(_padded(g.weights, ranks, size) for g, size in zip(fsdp_groups, element_bytes))
        padded = sum(_padded(g.weights, ranks, [1] * len(g.weights)) for g in fsdp_groups)
        reduced = reduces * padded * GRAD_REDUCE_BYTES
        found += [
            groups.collective("all_gather", dims, gathers * len(fsdp_groups), gathers * gathered, part),
            groups.collective("reduce_scatter", dims, reduces * len(fsdp_groups), reduced, part),
        ]
        if c.data_shard and not experts:  # HSDP: each reduce-scattered shard all-reduced across the groups
            calls, shards = across * len(fsdp_groups), across * padded * GRAD_REDUCE_BYTES / ranks
            found.append(groups.collective("all_reduce", ("data_replicate",), calls, shards, part))
    if in_float8:  # the float8 weights' maxima, all-reduced before each forward that gathers them (once per chunk
        # and step in a pipeline stage, which keeps them gathered): over each dimension the weights are split on
        scaled = sum(sum(float8_weights(config, c, i)) for i in held_blocks(config, c, rank))
        forwards = len(rank_layers(config, c, rank)) if c.pipeline_parallel > 1 else m
        for dims in (sharded_over(c), ("tensor",)):
            found.append(groups.collective("all_reduce", dims, forwards, forwards * scaled * FLOAT, part))
    return _kept(found)


def sharded_over(c: Candidate) -> tuple[str, ...]:
    """The mesh dimensions FSDP2 shards a dense weight over: data x context, or HSDP's `data_shard` groups."""
    return ("data_shard",) if c.data_shard else ("data", "context")


def ddp_buckets(sizes: list[int]) -> int:
    """How many buckets DDP cuts gradients of these byte sizes (the model's order) into: in reverse order, a bucket
    closes once it holds its cap or more (torch's compute_bucket_assignment_by_size)."""
    buckets, held = 0, 0
    for size in reversed(sizes):
        held += size
        if held >= (DDP_FIRST_BUCKET_BYTES if buckets == 0 else DDP_BUCKET_BYTES):
            buckets, held = buckets + 1, 0
    return buckets + (held > 0)


def step_reductions(config: LlamaConfig, c: Candidate, rank: int = 0) -> list[Collective]:
    """The step's own reductions on pipeline rank `rank`: the loss's mean over every rank, the gradient norm's, and a
    pipeline's sum of the norm over its stages and broadcast of the loss (module docstring)."""
    groups, part = _Groups(c), "step"
    found = [groups.collective("all_reduce", DENSE, 1, FLOAT, part)]
    if c.strategy != "ddp":
        # DTensor's norm: the per-tensor norms of each mesh's parameters, reduced once per dimension they are split
        # over. Tensor-parallel tensors (all but a mixture's router under sequence parallelism) lie on the (data,
        # tensor) mesh, the others on the data mesh; a mixture's experts under expert parallelism on their own
        # (expert_data, expert) mesh, and tensor too where tensor parallelism splits them.
        tensors = rank_weights(config, replace(c, tensor_parallel=1, expert_parallel=1), rank)
        experts = [w for w in tensors if c.expert_parallel > 1 and w.experts is not None]
        tensors = [w for w in tensors if not (c.expert_parallel > 1 and w.experts is not None)]
        tp = c.tensor_parallel > 1
        split = [w for w in tensors if tp and (w.tensor_split or (c.sequence_parallel and not w.mixture))]
        whole = len(tensors) - len(split)
        experts_over = [*EXPERTS, *(("tensor",) if tp else ())]
        found += [
            groups.collective("all_reduce", ("tensor",), 1 if split else 0, len(split) * FLOAT, part),
            groups.collective(
                "all_reduce", sharded_over(c), (1 if split else 0) + (1 if whole else 0), len(tensors) * FLOAT, part
            ),
            *(
                groups.collective("all_reduce", (g,), 1 if experts else 0, len(experts) * FLOAT, part)
                for g in experts_over
            ),
        ]
    if summed := config.values_summed_each_step():  # the model's own statistics (a mixture's routing biases move)
        found.append(groups.collective("all_reduce", DENSE, 1, summed * FLOAT, part))
    if c.pipeline_parallel > 1:
        found += [
            groups.collective("all_reduce", ("pipeline",), 1, FLOAT, part),
            groups.collective("broadcast", ("pipeline",), 1, FLOAT, part),
        ]
    return _kept(found)


def per_microbatch(config: LlamaConfig, c: Candidate, seq_len: int, precision: str, rank: int = 0) -> list[Collective]:
    """What each microbatch issues on pipeline rank `rank`: tensor, context, pipeline and expert parallelism's."""
    return [
        *tensor_parallel(config, c, seq_len, precision, rank),
        *context_parallel(config, c, seq_len, precision, rank),
        *pipeline_transfers(config, c, seq_len, precision, rank),
        *expert_parallel(config, c, seq_len, precision, rank),
    ]


def collectives(config: LlamaConfig, c: Candidate, seq_len: int, precision: str, rank: int = 0) -> list[Collective]:
    """Every collective of one optimizer step on pipeline rank `rank` (rank 0 of its data-, context- and
    tensor-parallel groups; the others issue the same), merged by kind, group and part."""
    scaled = [
        replace(x, calls=x.calls * c.microbatches, bytes=x.bytes * c.microbatches)
        for x in per_microbatch(config, c, seq_len, precision, rank)
    ]
    merged: dict[tuple[str, str, str], Collective] = {}
    once = [*data_parallel(config, c, precision, rank), *step_reductions(config, c, rank)]
    if c.pipeline_parallel > 1:
        once += norm_gradients(config, c, precision, rank)
    for x in [*scaled, *once]:
        key = (x.kind, x.group, x.part)
        if key in merged:
            before = merged[key]
            x = replace(before, calls=before.calls + x.calls, bytes=before.bytes + x.bytes)
        merged[key] = x
    return list(merged.values())


def by_kind(found: Iterable[Collective]) -> dict[str, tuple[float, float]]:
    """{kind: (calls, bytes)} over every group and part."""
    table: dict[str, tuple[float, float]] = {}
    for x in found:
        calls, size = table.get(x.kind, (0.0, 0.0))
        table[x.kind] = (calls + x.calls, size + x.bytes)
    return dict(sorted(table.items(), key=lambda item: KINDS.index(item[0])))


def by_kind_and_group(found: Iterable[Collective]) -> dict[tuple[str, str], tuple[float, float]]:
    """{(kind, group): (calls, bytes)} over every part."""
    table: dict[tuple[str, str], tuple[float, float]] = {}
    for x in found:
        calls, size = table.get((x.kind, x.group), (0.0, 0.0))
        table[(x.kind, x.group)] = (calls + x.calls, size + x.bytes)
    return dict(sorted(table.items(), key=lambda item: (KINDS.index(item[0][0]), item[0][1])))

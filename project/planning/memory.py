"""Memory per device of a layout: model states (parameters, gradients, AdamW's moments), the working
copies the strategy makes, and the activations the schedule keeps, plus a stated allowance.

Activations per block follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4), whose GPT block stores s*b*h*(34 + 5*a*s/h) bytes in 16-bit: 10*s*b*h
that tensor parallelism leaves whole (the layer-norm inputs, the inputs of the QKV and MLP projections,
two dropout masks), 24*s*b*h it splits over t ranks (Q, K, V, the attention output, the MLP's 4h-wide
tensors) and 5*a*s^2*b of attention scores. Sequence parallelism splits the first part over t too,
selective recompute drops the scores, and full recompute keeps only each block's input. Llama's block
has no dropout, K and V of n_kv_heads (g = n_kv_heads / n_heads), and a SwiGLU feed-forward of width f,
so in the same units it stores
    replicated: 8 (the two norm inputs, the attention and feed-forward inputs)
    split:      4 + 4g (Q, K, V, attention output) + 6f/h (w1 and w3 outputs, their product)
    scores:     2as/h (the softmax output; only where attention is not a fused kernel: recompute=none)
A fused implementation stores this: torch.compile'd blocks, Megatron-LM's SwiGLU. An eager block keeps more
(layer_activation_bytes counts it tensor by tensor: the norms' float32 copies and autocast's 16-bit copy of each
projection's input, silu(w1 x)), about 1.6 times as much for Llama shapes under bf16-mixed: the planner counts
that for runs without `compile`.
A family whose attention normalizes each query and key head (Qwen3, Llama 4: `LlamaConfig.head_norms`) keeps their
inputs too, and the normed heads where a gain scales them.
Context parallelism over c ranks leaves each rank s/c of every sequence, but the keys and values of the whole
sequence, gathered for attention, are kept for the backward too: (s - s/c) b h 4g more.
tests/test_planner.py holds the count to what our compiled block saves for its backward, and the eager count to
what an eager block saves, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from project.model.config import LlamaConfig, Mixture
from project.parallel.mesh import RING_TILE
from project.planning.candidates import HAS_COMPILE, Candidate
from project.planning.parameters import (
    held_blocks,
    holds_first_and_last,
    mixture_of,
    rank_blocks,
    rank_layers,
    sharded_parameters,
    unsharded_parameters,
)

# Bytes per parameter of what the optimizer updates (the parameters as stored), by trainer.precision.
STORAGE_BYTES = {"32-true": 4, "bf16-mixed": 4, "16-mixed": 4, "bf16-true": 2}
COMPUTE_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2, "bf16-true": 2}
GRAD_REDUCE_BYTES = 4  # float32 gradient reduction and accumulation (our FSDP2 reduce_dtype default)


@dataclass(frozen=True)
class Allowance:
    """What no formula here counts: the CUDA context and communication buffers (a fixed reserve), and the
    caching allocator's fragmentation (a fraction of what is allocated)."""

    reserve_gib: float = 1.0
    fragmentation: float = 0.05


@dataclass
class MemoryEstimate:
    """Bytes per device on the pipeline rank that needs the most (the first, for most schedules)."""

    params: float  # as stored: this rank's shards
    grads: float  # after the step's reduction: this rank's shards
    optimizer: float  # AdamW's two moments per parameter
    working: float  # gathered parameters, gradient buffers, 16-bit copies: see `working_note`
    activations: float
    overhead: float
    pipeline_rank: int = 0
    working_note: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.working + self.activations + self.overhead


def layer_activation_bytes(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int,
    candidate: Candidate,
    compute_bytes: int,
    compiled: bool,
    autocast: bool = False,
    index: int = 0,
) -> float:
    """Bytes block `index` keeps from its forward for its backward, for one microbatch (module docstring): compiled,
    or eager (`compiled=False`), under autocast's 16-bit compute of 32-bit weights (`autocast`) or not. A mixture of
    experts' block keeps its attention's and `mixture_activation_bytes`."""
    t, sp = candidate.tensor_parallel, candidate.sequence_parallel
    mixture = mixture_of(config, index)
    h = config.dim
    q, kv = config.n_heads * config.head_dim, config.kv_heads * config.head_dim  # the queries' and keys' widths
    f = 0 if mixture else config.ffn_hidden_dim  # the dense feed-forward's width
    sbh = seq_len * micro_batch * h * compute_bytes / 2  # the paper's units: s*b*h 16-bit values = 2 bytes each
    if candidate.recompute == "full":
        return 2 * sbh / (t if sp else 1)  # the block's input
    scores = 2 * config.n_heads * seq_len / h if candidate.recompute == "none" else 0.0
    mixed = mixture_activation_bytes(mixture, h, seq_len, micro_batch, compute_bytes, compiled, autocast, sp, t)
    norms = config.head_norms(index)
    if compiled:
        split = 4 * q / h + 4 * kv / h + 6 * f / h + (2 * (q + kv) / h if norms else 0.0)  # the norms' inputs
        return sbh * (8 / (t if sp else 1) + (split + scores) / t) + mixed
    # Eager, per token, as torch saves it (counted in tests/test_planner.py): under autocast the norms' float32
    # input and output and the float32 residual (12h), a 16-bit copy of the normed input for each of wq, wk, wv,
    # w1 and w3 (10h: autocast casts activations anew for every matrix product), Q and the attention output (4q),
    # K and V (4 kv), w1's and w3's outputs, silu(w1 x) and their product (8f); without autocast the norms'
    # inputs and outputs and the residual (5h), Q and the attention output (2q), K and V (2 kv) and 4f, each in the
    # compute dtype; both, attention's float32 log-sum-exp per head and the norms' statistics.
    if autocast:  # a mixture's gate keeps its float32 input in place of w1's and w3's copies (10h either way)
        replicated, split = 22 * h, 4 * q + 4 * kv + 8 * f
    else:
        replicated, split = compute_bytes * 5 * h, compute_bytes * (2 * q + 2 * kv + 4 * f)
    stats = 4 * config.n_heads / t + 8
    if norms:  # per-head norms of queries and keys: their float32 input (normalized in float32 whatever the compute
        # dtype), the normed heads in the compute dtype where a gain scales them, and a float32 statistic per head
        split += (q + kv) * (4 + (compute_bytes if norms.gain else 0))
        stats += 4 * (config.n_heads + config.kv_heads) / t
    return seq_len * micro_batch * (replicated / (t if sp else 1) + split / t + stats) + sbh * scores / t + mixed


def mixture_activation_bytes(
    mixture: Mixture | None,
    dim: int,
    seq_len: int,
    micro_batch: int,
    compute_bytes: int,
    compiled: bool,
    autocast: bool,
    sequence_parallel: bool,
    tensor_parallel: int = 1,
) -> float:
    """Bytes a mixture of experts' feed-forward (families/moe/model.py: MoEFeedForward) keeps for its backward, for one
    microbatch of `seq_len` positions (0 for a dense block). Under tensor parallelism every rank routes every token of
    the sequence (gathered first under sequence parallelism, that input kept too), and keeps its part of each
    expert's hidden units (the experts' width divided by the degree). Per token: the
    router's float32 scores (4 bytes per expert), its choices, weights and their sum, and the two orderings of the
    routed copies (int64); per routed copy (top_k per token), eager: the copy of its input, its expert's SwiGLU (4
    tensors of the expert's width, 3 once compiled: silu fused) and output, and the float32 weight it is scaled by;
    the shared expert's SwiGLU per token; per sequence, the balancing loss's sums. Under autocast (bf16-mixed) each
    expert product keeps its own 16-bit copy of its input, and the expert's outputs, 16-bit, are scaled in float32.
    tests/test_planner.py holds the eager count to what the mixture saves, exactly."""
    if mixture is None:
        return 0.0
    n, k, f, h = mixture.experts, mixture.top_k, mixture.width / tensor_parallel, dim
    tokens = seq_len * micro_batch
    c = 2 if autocast else compute_bytes
    per_token = 4 * n + 32 * k + 8 + (h * compute_bytes if sequence_parallel else 0)
    if compiled:
        routed = c * (2 * h + 3 * f)
    elif autocast:
        routed = 10 * h + 8 * f  # the float32 copies, 16-bit outputs, two 16-bit input copies, the SwiGLU
    else:
        routed = c * (3 * h + 4 * f)
    shared = (c * (3 if compiled else 4) * f + (4 * h if autocast and not compiled else 0)) if mixture.shared else 0
    return tokens * (per_token + k * routed + shared) + micro_batch * (16 * n + 8)


def in_flight(candidate: Candidate, pipeline_rank: int, layers: list[int]) -> float:
    """Block-microbatches whose activations the rank holds at its peak: a schedule's warm-up forwards."""
    p, m, v = candidate.pipeline_parallel, candidate.microbatches, candidate.virtual_stages
    if p == 1:
        return sum(layers)  # one microbatch at a time: accumulation frees each before the next
    if candidate.schedule in ("gpipe", "looped_bfs"):  # every forward before any backward
        return m * sum(layers)
    if candidate.schedule == "1f1b":
        return min(m, p - pipeline_rank) * sum(layers)
    # Interleaved 1F1B (Narayanan et al. 2021; torch's Interleaved1F1B): warm-up of (v-1)p + 2(p-r-1)
    # chunk forwards, then one more before the first backward.
    chunks = min(m * v, (v - 1) * p + 2 * (p - pipeline_rank - 1) + 1)
    return chunks * sum(layers) / len(layers)


def ring_working_bytes(config: LlamaConfig, candidate: Candidate, own: int, compute: int) -> float:
    """What ring attention's backward of one block holds beside what the blocks keep (project.parallel.ring_attention):
    float32 copies of the rank's queries, their output's gradient, the queries' gradient and the output (4 x
    [b, own, heads x head_dim / tp]); the keys and values in hand in float32, those arriving in the compute dtype, and
    two pairs of their float32 gradients in transit; three float32 tiles of scores (scores, weights, their
    gradients) of TILE x TILE positions per query head."""
    mb, tp = candidate.micro_batch_size, candidate.tensor_parallel
    queries = config.n_heads * config.head_dim / tp
    keys = config.kv_heads * config.head_dim / tp
    tile = min(RING_TILE, own // 2)
    return (
        mb * (4 * 4 * own * queries + (2 * 4 + 2 * compute + 4 * 4) * own * keys)
        + 3 * 4 * mb * (config.n_heads / tp) * tile * tile
    )


def estimate_memory(
    config: LlamaConfig,
    candidate: Candidate,
    seq_len: int,
    precision: str,
    accelerator: str,
    allowance: Allowance,
    pipeline_rank: int = 0,
    compiled: bool | None = None,
) -> MemoryEstimate:
    """Memory of one pipeline rank (rank 0 of its data- and tensor-parallel group); `compiled`: whether the blocks
    are compiled (None: as the planner's commands run them, compiled on GPUs where the strategy can)."""
    storage, compute = STORAGE_BYTES[precision], COMPUTE_BYTES[precision]
    if compiled is None:
        compiled = accelerator == "gpu" and candidate.strategy in HAS_COMPILE
    full = unsharded_parameters(config, candidate, pipeline_rank)
    dp, zero = candidate.shard_ranks, candidate.zero_level  # FSDP2 shards over data x context
    shard = sharded_parameters(config, candidate, pipeline_rank) if zero and dp > 1 else full
    block = max(sum(w.numel for w in b) for b in rank_blocks(config, candidate, pipeline_rank))  # the largest
    mixed = compute != storage  # 16-bit compute of 32-bit parameters
    if candidate.strategy == "ddp":
        params, grads, optimizer = full * storage, full * storage, 2 * full * storage
        working = full * storage + (full * compute if mixed else 0)
        note = "DDP's gradient buckets" + (" and autocast's 16-bit weight copies" if mixed else "")
    elif candidate.pipeline_parallel > 1 and (dp > 1 or mixed):
        # torch's pipeline stages keep FSDP2's gathered parameters and accumulate unsharded gradients over the
        # step's microbatches, reduce-scattering once at its end (PipelineStage.backward_maybe_with_nosync).
        params, grads, optimizer = shard * storage, shard * storage, 2 * shard * storage
        working = full * compute + full * GRAD_REDUCE_BYTES
        note = "the stage's gathered parameters and unsharded gradients, kept across microbatches"
    elif not candidate.reshard_after_forward and (dp > 1 or mixed):  # FSDP2 as ZeRO-2: kept from forward to backward
        params, grads, optimizer = shard * storage, shard * storage, 2 * shard * storage
        working = full * compute + block * GRAD_REDUCE_BYTES
        note = "parameters gathered for the whole forward and backward, one block's unsharded gradients"
        if candidate.gradient_sync == "at_last" and candidate.microbatches > 1:  # FSDP2 reduces after the last
            working += (full - block) * GRAD_REDUCE_BYTES
            note = "parameters gathered for the whole forward and backward, every block's unsharded gradients"
    else:  # FSDP2 (ZeRO-3): each block gathered just before use, one ahead
        params, grads, optimizer = shard * storage, shard * storage, 2 * shard * storage
        gathered = dp > 1 or mixed
        working = (2 * block * compute + block * GRAD_REDUCE_BYTES) if gathered else 0.0
        note = "two blocks' gathered parameters, one block's unsharded gradients" if gathered else ""
        if candidate.gradient_sync == "at_last" and candidate.microbatches > 1:  # FSDP2 reduces after the last
            working += full * GRAD_REDUCE_BYTES
            note = "two blocks' gathered parameters, every block's unsharded gradients through the step"

    layers = rank_layers(config, candidate, pipeline_rank)
    cp = candidate.context_parallel
    own = seq_len // cp  # each rank's part of every sequence
    held = held_blocks(config, candidate, pipeline_rank)
    per_layer = sum(
        layer_activation_bytes(config, own, candidate.micro_batch_size, candidate, compute, compiled, mixed, index)
        for index in held
    ) / len(held)  # the mean of the rank's blocks (a mixture of experts' blocks keep more than its dense ones)
    regathered = 0.0
    if cp > 1 and candidate.context_parallel_kv == "ring":  # what one block's ring backward holds while it runs
        regathered = ring_working_bytes(config, candidate, own, compute)
    # The rest of the sequence's keys and values, gathered (a ring keeps the rank's own only, counted with the block's).
    if cp > 1 and candidate.recompute != "full" and candidate.context_parallel_kv == "gather":
        kv = 4 * config.kv_heads * config.head_dim / candidate.tensor_parallel  # K and V, in 16-bit units
        rest = (seq_len - own) * candidate.micro_batch_size * compute / 2 * kv
        if candidate.regather_kv:  # kept by no block: one block's whole sequence exists while its backward runs
            regathered = rest * seq_len / (seq_len - own)
        else:
            per_layer += rest
    activations = in_flight(candidate, pipeline_rank, layers) * per_layer + regathered
    if candidate.recompute == "full":  # one block's activations exist again while it is recomputed: the largest's
        activations += max(
            layer_activation_bytes(
                config, own, candidate.micro_batch_size, _selective(candidate), compute, compiled, mixed, index
            )
            for index in held
        )
    _, last = holds_first_and_last(candidate, pipeline_rank)
    if last:  # logits in the compute dtype and their float32 log-probabilities, one chunk of tokens at a time
        tokens = own * candidate.micro_batch_size
        chunk = min(tokens, config.chunk_tokens)  # project.model.loss
        logits = chunk * config.vocab_size / candidate.tensor_parallel * (compute + 4)
        # A loss in one chunk keeps its logits for the backward (the microbatches in flight too); in several, each
        # chunk's logits are recomputed in the backward, so only the one being computed exists.
        in_one_chunk = chunk == tokens and candidate.schedule in ("gpipe", "looped_bfs")
        activations += logits * (candidate.microbatches if in_one_chunk else 1)
    allocated = params + grads + optimizer + working + activations
    overhead = allocated * allowance.fragmentation + allowance.reserve_gib * 2**30
    return MemoryEstimate(params, grads, optimizer, working, activations, overhead, pipeline_rank, note)


def _selective(candidate: Candidate) -> Candidate:
    return replace(candidate, recompute="selective")


def peak_memory(
    config: LlamaConfig,
    candidate: Candidate,
    seq_len: int,
    precision: str,
    accelerator: str,
    allowance: Allowance,
    compiled: bool | None = None,
) -> MemoryEstimate:
    """The estimate of the pipeline rank that needs the most memory."""
    ranks = range(candidate.pipeline_parallel)
    return max(
        (estimate_memory(config, candidate, seq_len, precision, accelerator, allowance, r, compiled) for r in ranks),
        key=lambda e: e.total,
    )

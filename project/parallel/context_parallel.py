"""Context parallelism: each sequence split over a group of ranks, attention across the split by gathered keys and
values (the Llama 3 paper's approach, section 3.3.2) or passed around a ring (`ring`: project.parallel.ring_attention),
applied to a single-device Llama from outside.

The sequence is cut into 2 x cp chunks and rank r keeps chunks r and 2 cp - 1 - r ("zig-zag"), so that causal
attention costs every rank the same: an early chunk with few keys before it and a late one with many. Each rank
runs the whole model on its part of every sequence; only attention needs the rest of the sequence, so:
- the model's `document_masking` is the rank's: it tells the model the positions of the rank's queries (their
  rotary angles, and a family's per-position factors: Llama 4's temperature), and makes the documents' mask of
  those rows only;
- the scaled dot product (`attention.attend`, project.model.llama.ScaledDotProduct) is wrapped: the keys and
  values of every rank of the group are gathered and put back in sequence order, and each of the rank's two chunks
  attends causally to the keys up to its own end (ContextParallelAttention). In the backward pass the gathered
  keys' and values' gradients are summed back onto the rank that computed them. Every block keeps its gathered
  keys and values for the backward, or, with `regather`, only its own part, gathered again in the backward.
The loss is then the mean over the rank's tokens; averaged over the group's ranks (they hold equally many) it is
the mean over each whole sequence, as one device computes it.

Document masking: the model is given the document ids of the whole sequences (computed from the whole tokens,
which every rank of the group reads) beside its part of the tokens, and its mask (`document_masking`) is made
for the rank's own queries against every key: FlexAttention's block mask of those rows on a GPU, the dense rows on
the CPU (project.model.document_mask, `query_positions`). Either is then used as it is, after the gather.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from project.model.document_mask import BlockMask, document_mask
from project.model.llama import DocumentMasking, Llama, mixtures_of
from project.parallel.ring_attention import Ring, ring_attention


@functools.lru_cache(maxsize=64)  # the same few sequence lengths every step, every layer
def zigzag_positions(seq_len: int, rank: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions [seq_len / size] of a sequence that rank `rank` of `size` keeps: chunks rank and
    2 size - 1 - rank of its 2 size equal chunks."""
    if seq_len % (2 * size):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2 x {size} equal chunks")
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, second])


def split_for_rank(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """The part of `x` (sequence along `dim`) that rank `rank` of `size` keeps, its two chunks side by side."""
    return x.index_select(dim, zigzag_positions(x.shape[dim], rank, size, x.device))


@functools.lru_cache(maxsize=64)
def ranks_order(seq_len: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions of the sequence in the ranks' order: rank 0's part, then rank 1's, ..."""
    return torch.cat([zigzag_positions(seq_len, r, size, device) for r in range(size)])


@functools.lru_cache(maxsize=64)
def sequence_order(seq_len: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    """Where each position of the sequence lies in the ranks' parts laid end to end (rank 0's, then rank 1's, ...):
    indexing the gathered parts with it gives the sequence in order."""
    return torch.argsort(ranks_order(seq_len, size, device))


class _GatherSequence(torch.autograd.Function):
    """All ranks' parts of x along dim 2, in sequence order; backward: each rank gets the sum, over the group, of the
    gradients of its own part (a reduce-scatter: half the traffic of an all-reduce)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        batch, heads, part, dim = x.shape
        # The ranks' parts concatenated along the first dimension (what the collective writes), then side by side.
        gathered = torch.empty(size * batch, heads, part, dim, dtype=x.dtype, device=x.device)
        dist.all_gather_single(gathered, x.contiguous(), group=group)
        stacked = gathered.view(size, batch, heads, part, dim)
        in_rank_order = stacked.permute(1, 2, 0, 3, 4).reshape(batch, heads, size * part, dim)
        return in_rank_order.index_select(2, sequence_order(size * part, size, x.device))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        size = ctx.size
        batch, heads, seq_len, dim = grad.shape
        by_rank = grad.index_select(2, ranks_order(seq_len, size, grad.device))  # each rank's positions together
        stacked = by_rank.view(batch, heads, size, seq_len // size, dim).permute(2, 0, 1, 3, 4).contiguous()
        mine = torch.empty(batch, heads, seq_len // size, dim, dtype=grad.dtype, device=grad.device)
        # Every rank's queries looked at every part: the parts' sums, each to its rank.
        dist.reduce_scatter_single(mine, stacked.view(size * batch, heads, seq_len // size, dim), group=ctx.group)
        return mine, None, None, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> torch.Tensor:
    """x [B, H, T / size, D] of every rank of `group`, as [B, H, T, D] in sequence order (differentiable)."""
    return _GatherSequence.apply(x, group, rank, size)


def lower_right_kernel(q: torch.Tensor) -> bool:
    """Whether torch has kernels for lower-right causal attention here (flash and memory-efficient: GPUs), so that
    the mask is never made; the CPU would make it in every call."""
    return q.device.type == "cuda"


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in autocast's dtype where autocast is on (under bf16-mixed the rotary angles leave the keys in float32:
    gathered as they are, they would send and keep twice the bytes attention then reads), else as it is."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v in one dtype: autocast's where it is on, else the widest. torch's lower-right causal mask calls
    its kernels directly, without autocast's casts, and refuses mixed dtypes (under bf16-mixed the rotary angles
    leave q and k in float32 beside a bfloat16 v)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


class ContextParallelAttention(nn.Module):
    """The model's attention kernel (`attention.attend`, project.model.llama.ScaledDotProduct) for this rank's
    queries over the whole sequence: the group's keys and values gathered in sequence order, then each of the rank's
    two chunks attends to the keys up to its own end, causally (its queries are the last of those keys: torch's
    lower-right causal alignment). No [T / cp, T] mask is made where torch has a kernel for that alignment (GPUs:
    `causal_lower_right`); on the CPU the two chunks' masks are made once per length and shared by every layer.
    With documents, the mask the model made for this rank's rows (ContextParallelDocumentMasking). With `ring`, the
    keys and values are passed around the group instead of gathered (project.parallel.ring_attention)."""

    def __init__(
        self,
        attend: nn.Module,
        group: dist.ProcessGroup,
        rank: int,
        size: int,
        masks: dict[tuple, torch.Tensor],
        regather: bool = False,
        ring: bool = False,
    ):
        super().__init__()
        self.attend, self.group, self.rank, self.size = attend, group, rank, size
        self._masks = masks  # the CPU's additive masks, per shape, dtype and device: one dict for every layer
        self.regather = regather
        self.ring = Ring(group, rank, size) if ring else None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None
    ) -> torch.Tensor:
        k, v = in_compute_dtype(k), in_compute_dtype(v)  # before the gather: its bytes, and those kept for backward
        if self.ring is not None:  # passed around the group instead (project.parallel.ring_attention)
            return ring_attention(q, k, v, mask, self.ring)
        if self.regather:  # keep this rank's keys and values only; gather (and attend) again in the backward
            return checkpoint(self._attend_gathered, q, k, v, mask, use_reentrant=False)
        return self._attend_gathered(q, k, v, mask)

    def _attend_gathered(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None
    ) -> torch.Tensor:
        seq_len = k.shape[2] * self.size
        k = gather_sequence(k, self.group, self.rank, self.size)
        v = gather_sequence(v, self.group, self.rank, self.size)
        if mask is not None:  # the documents' mask of this rank's rows [B, 1, T / cp, T] (dense or FlexAttention's)
            return self.attend(q, k, v, mask)
        chunk = seq_len // (2 * self.size)
        if lower_right_kernel(q):
            q, k, v = same_dtype(q, k, v)
        parts = []
        for i, index in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            end = (index + 1) * chunk
            queries = q[:, :, i * chunk : (i + 1) * chunk]
            parts.append(self.attend(queries, k[:, :, :end], v[:, :, :end], self._causal(chunk, end, q)))
        return torch.cat(parts, dim=2)

    def _causal(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        """Causal attention of `rows` queries that are the last of `cols` keys."""
        if lower_right_kernel(like):
            return causal_lower_right(rows, cols)
        key = (rows, cols, like.dtype, like.device)
        if key not in self._masks:  # additive: a boolean one would be converted to a new one in every call
            allowed = torch.ones(rows, cols, dtype=torch.bool, device=like.device).tril(cols - rows)
            zeros = torch.zeros(rows, cols, dtype=like.dtype, device=like.device)
            self._masks[key] = zeros.masked_fill(~allowed, float("-inf"))
        return self._masks[key]


class ContextParallelDocumentMasking(DocumentMasking):
    """The model's document mask (`document_masking`, project.model.llama.DocumentMasking) for this rank's queries
    only, against every key of the whole sequences: T / cp x T rather than T x T."""

    def __init__(self, rank: int, size: int):
        super().__init__()
        self.rank, self.size = rank, size

    def forward(self, document_ids: torch.Tensor) -> torch.Tensor | BlockMask:
        mine = zigzag_positions(document_ids.shape[1], self.rank, self.size, document_ids.device)
        return document_mask(document_ids, query_positions=mine)

    def queries(self, rows: int, device: torch.device) -> tuple[torch.Tensor, int]:
        return zigzag_positions(rows * self.size, self.rank, self.size, device), rows * self.size


class _SumOverGroup(torch.autograd.Function):
    """The sum over a group's ranks of each rank's tensor; its gradient, every rank's output gradient summed (each
    output depends on every rank's input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


class ContextParallelSequenceSums(nn.Module):
    """A mixture of experts' per-sequence sums (project.model.families.moe.model.SequenceSums: its balancing loss's
    tokens and scores per expert) over the whole sequences: every rank's part summed."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, sums: torch.Tensor) -> torch.Tensor:
        return _SumOverGroup.apply(sums, self.group)


class ContextParallel:
    """One rank of a context-parallel group, applied to a Llama (or a pipeline stage of one)."""

    def __init__(self, model: Llama, group: dist.ProcessGroup, regather: bool = False, ring: bool = False):
        self.model, self.group, self.regather, self.ring = model, group, regather, ring
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._masks: dict[tuple, torch.Tensor] = {}  # shared by every layer: made once, held once

    def apply(self, blocks: nn.ModuleDict) -> None:
        self.model.document_masking = ContextParallelDocumentMasking(self.rank, self.size)
        for block in blocks.values():
            attention: Any = block.attention
            attention.attend = ContextParallelAttention(
                attention.attend, self.group, self.rank, self.size, self._masks, self.regather, self.ring
            )
        for mixture in mixtures_of(self.model):  # a mixture's balancing loss sums over whole sequences
            mixture.sequence_sums = ContextParallelSequenceSums(self.group)


def apply_context_parallel(
    model: Llama, group: dist.ProcessGroup, regather: bool = False, ring: bool = False
) -> ContextParallel:
    """Hook every block of `model` (whole or pruned to its pipeline stages) for context parallelism over `group`;
    the inputs and targets must then be each rank's part of every sequence (split_for_rank), and document ids,
    where given, those of the whole sequences. `regather`: each block keeps only its own part of the keys and values
    for the backward, which gathers them again and recomputes the attention (one more all-gather and attention
    forward per block; the memory of every block's gathered keys and values saved). `ring`: the keys and values are
    passed around the group instead of gathered (project.parallel.ring_attention)."""
    parallel = ContextParallel(model, group, regather, ring)
    parallel.apply(model.layers)
    return parallel

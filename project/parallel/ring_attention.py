"""Ring attention: context parallelism whose ranks pass the keys and values around, never holding the whole sequence's
(`strategy.context_parallel_kv=ring`; project.parallel.context_parallel gathers them instead).

Each rank of a context group of cp keeps two chunks of every sequence (the zig-zag split of context_parallel, which
gives every rank as much causal work). Attention of its queries runs over cp steps: at step s the rank holds the
keys and values of rank r - s, sends them on to rank r + 1 and receives those of rank r - s - 1 while it computes
(`batch_isend_irecv`, overlapped with the block in hand), so it holds two ranks' parts at a time: O(sequence / cp).
Each pair of a query chunk and a key chunk is attended where the keys come before the queries (whole), or are the
same positions (causal); chunks after the queries are skipped. Softmax is merged across steps online (a running
maximum and sum per query, as FlashAttention does), in float32.

The backward pass runs the ring again: each rank's keys and values travel with the gradients they collect from
every rank's queries, and after cp steps the gradients reach the rank that owns those keys and values.

With documents the mask the model made for the rank's rows against the whole sequence (a dense one: the CPU's)
gives each block its part. FlexAttention's block masks (GPUs) are not split by this ring: there the gather serves.

The math is written out (scores, softmax, their gradients) rather than calling torch's fused kernels, which return
no log-sum-exp through a public API: one query chunk x key chunk block of scores exists at a time.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from project.model.document_mask import BlockMask
from project.runtime.errors import ConfigError


@functools.lru_cache(maxsize=16)
def causal_bias(size: int, device: torch.device) -> torch.Tensor:
    """[size, size] float32: 0 where a query may see a key of the same chunk (at or before it), -inf after."""
    return torch.full((size, size), float("-inf"), device=device).triu(1)


class Ring:
    """One rank of a context group, for ring attention: its neighbours, and the pairs of chunks it computes."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        ranks = dist.get_process_group_ranks(group)
        self.next, self.previous = ranks[(rank + 1) % size], ranks[(rank - 1) % size]

    def shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
        """Send `tensors` to the next rank and receive the previous rank's alike; the caller waits on the requests."""
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.previous, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)

    def pairs(self, part: int, chunk: int):
        """(query rows, key columns, the keys' chunk index, whether it is the queries' own chunk) of each pair of this
        rank's query chunks and rank `part`'s key chunks that attention needs: keys at or before the queries."""
        mine, theirs = (self.rank, 2 * self.size - 1 - self.rank), (part, 2 * self.size - 1 - part)
        for a, query_chunk in enumerate(mine):
            for b, key_chunk in enumerate(theirs):
                if key_chunk <= query_chunk:
                    rows, cols = slice(a * chunk, (a + 1) * chunk), slice(b * chunk, (b + 1) * chunk)
                    yield rows, cols, key_chunk, key_chunk == query_chunk

    def scores(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        mask: torch.Tensor | None,
        rows: slice,
        key_chunk: int,
        own: bool,
    ) -> torch.Tensor:
        """q k^T / sqrt(d) of one block, masked: by the documents' mask (its rows, the keys of `key_chunk`), else
        causally within the queries' own chunk, else not at all."""
        scores = queries @ keys.transpose(-1, -2) * (1 / math.sqrt(queries.shape[-1]))
        chunk = keys.shape[2]
        if mask is not None:
            allowed = mask[:, :, rows, key_chunk * chunk : (key_chunk + 1) * chunk]
            return scores.masked_fill(~allowed, float("-inf"))
        return scores + causal_bias(chunk, queries.device) if own else scores


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Keys or values [B, H_kv, S, D] as float32 for every query head [B, H_kv x groups, S, D]."""
    return x.float().repeat_interleave(groups, dim=1) if groups > 1 else x.float()


def _per_kv_head(x: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient [B, H, S, D] of repeated keys or values summed back onto their [B, H / groups, S, D] heads."""
    if groups == 1:
        return x
    batch, heads, length, dim = x.shape
    return x.view(batch, heads // groups, groups, length, dim).sum(2)


def ring_forward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Attention output [B, H, T / cp, D] and log-sum-exp [B, H, T / cp] of this rank's queries, in float32."""
    batch, heads, length, dim = q.shape
    groups, chunk = heads // k.shape[1], length // 2
    qf = q.float()
    top = torch.full((batch, heads, length), float("-inf"), device=q.device)
    total = torch.zeros(batch, heads, length, device=q.device)
    out = torch.zeros(batch, heads, length, dim, device=q.device)
    held = [k, v]
    for step in range(ring.size):
        part = (ring.rank - step) % ring.size
        incoming, requests = ring.shift(held) if step < ring.size - 1 else (held, [])
        keys, values = _heads(held[0], groups), _heads(held[1], groups)
        for rows, cols, key_chunk, own in ring.pairs(part, chunk):
            scores = ring.scores(qf[:, :, rows], keys[:, :, cols], mask, rows, key_chunk, own)
            before = top[:, :, rows]
            now = torch.maximum(before, scores.amax(-1))
            safe = torch.where(torch.isinf(now), torch.zeros_like(now), now)  # a row with no key yet
            weights = torch.exp(scores - safe[..., None])
            kept = torch.exp(before - safe)
            total[:, :, rows] = total[:, :, rows] * kept + weights.sum(-1)
            out[:, :, rows] = out[:, :, rows] * kept[..., None] + weights @ values[:, :, cols]
            top[:, :, rows] = now
        for request in requests:
            request.wait()
        held = incoming
    return out / total[..., None], top + total.log()


def ring_backward(ring: Ring, q, k, v, mask, out, lse, grad):
    """The gradients of q, k and v (float32) from the output's gradient `grad`."""
    batch, heads, length, dim = q.shape
    groups, chunk, scale = heads // k.shape[1], length // 2, 1 / math.sqrt(dim)
    qf, grad = q.float(), grad.float()
    row_dot = (grad * out.float()).sum(-1)  # softmax's backward: each row's sum of output gradient x output
    dq = torch.zeros_like(qf)
    held = [k, v]
    collected = [torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)]
    for step in range(ring.size):
        part = (ring.rank - step) % ring.size
        incoming, requests = ring.shift(held) if step < ring.size - 1 else (held, [])
        keys, values = _heads(held[0], groups), _heads(held[1], groups)
        for rows, cols, key_chunk, own in ring.pairs(part, chunk):
            scores = ring.scores(qf[:, :, rows], keys[:, :, cols], mask, rows, key_chunk, own)
            weights = torch.exp(scores - lse[:, :, rows, None])
            collected[1][:, :, cols] += _per_kv_head(weights.transpose(-1, -2) @ grad[:, :, rows], groups)
            d_scores = weights * (grad[:, :, rows] @ values[:, :, cols].transpose(-1, -2) - row_dot[:, :, rows, None])
            dq[:, :, rows] += d_scores @ keys[:, :, cols] * scale
            collected[0][:, :, cols] += _per_kv_head(d_scores.transpose(-1, -2) @ qf[:, :, rows] * scale, groups)
        # The gradients collected for rank `part`'s keys and values travel on with them, and reach it after the last.
        collected, sent = ring.shift(collected)
        for request in [*requests, *sent]:
            request.wait()
        held = incoming
    return dq, collected[0], collected[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, ring: Ring) -> torch.Tensor:
        with torch.autocast(q.device.type, enabled=False):  # float32 throughout; the inputs' dtype goes around
            out, lse = ring_forward(ring, q, k, v, mask)
        out = out.to(v.dtype)  # kept as returned (the output projection keeps it too), as FlashAttention keeps it
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.ring = mask, ring
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = ring_backward(ctx.ring, q, k, v, ctx.mask, out, lse, grad)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None, ring: Ring
) -> torch.Tensor:
    """Attention of this rank's queries q [B, H, T / cp, D] over the whole sequence, whose keys and values k, v
    [B, H_kv, T / cp, D] are split over the ring's ranks as the queries are; `mask`: None (causal) or the documents'
    dense mask of this rank's rows [B, 1, T / cp, T]. Differentiable."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ConfigError(
            "strategy.context_parallel_kv=ring does not split FlexAttention's block masks (document_mask=true, or a "
            "model's chunked attention, on GPUs): set strategy.context_parallel_kv=gather."
        )
    return _RingAttention.apply(q, k, v, mask, ring)

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
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from project.model.document_mask import BlockMask
from project.parallel.mesh import RING_TILE
from project.runtime.errors import ConfigError

# Query and key positions a block of scores spans at most: one block of TILE x TILE scores per query head exists at a
# time (and three in the backward), whatever the sequence.
TILE = RING_TILE


@functools.lru_cache(maxsize=16)
def causal_bias(size: int, device: torch.device) -> torch.Tensor:
    """[size, size] float32: 0 where a query may see a key of the same tile (at or before it), -inf after."""
    return torch.full((size, size), float("-inf"), device=device).triu(1)


class InFlight(NamedTuple):
    """A shift's requests, and what it sends (a contiguous copy where a tensor was not), held until they are done."""

    requests: list[Any]
    sent: list[torch.Tensor]

    def wait(self) -> None:
        for request in self.requests:
            request.wait()


def _tiles(length: int) -> list[slice]:
    return [slice(start, min(start + TILE, length)) for start in range(0, length, TILE)]


class Ring:
    """One rank of a context group, for ring attention: its neighbours, and the blocks of scores it computes."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        ranks = dist.get_process_group_ranks(group)
        self.next, self.previous = ranks[(rank + 1) % size], ranks[(rank - 1) % size]

    def shift(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], InFlight]:
        """Send `tensors` to the next rank and receive the previous rank's alike, as the caller computes; it waits
        for them (InFlight.wait) before it reads what was received. A ring of one rank holds everything already."""
        if self.size == 1:
            return list(tensors), InFlight([], [])
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.previous, self.group) for r in received]
        return received, InFlight(dist.batch_isend_irecv(ops), sent)

    def blocks(self, part: int, chunk: int):
        """(query rows, key columns, the keys' first position in the sequence, whether causal within the block) of
        each block of scores of this rank's queries against rank `part`'s keys that attention needs: keys at or
        before the queries, in tiles of at most TILE positions."""
        mine, theirs = (self.rank, 2 * self.size - 1 - self.rank), (part, 2 * self.size - 1 - part)
        for a, query_chunk in enumerate(mine):
            for b, key_chunk in enumerate(theirs):
                if key_chunk > query_chunk:
                    continue
                for t, rows in enumerate(_tiles(chunk)):
                    for u, cols in enumerate(_tiles(chunk)):
                        if key_chunk == query_chunk and u > t:
                            break
                        yield (
                            slice(a * chunk + rows.start, a * chunk + rows.stop),
                            slice(b * chunk + cols.start, b * chunk + cols.stop),
                            key_chunk * chunk + cols.start,
                            key_chunk == query_chunk and u == t,
                        )

    def scores(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        mask: torch.Tensor | None,
        rows: slice,
        first_key: int,
        causal: bool,
    ) -> torch.Tensor:
        """q k^T / sqrt(d) of one block [B, H_kv, groups, rows, keys], masked: by the documents' mask (its rows,
        the block's keys), else causally within a block on the diagonal, else not at all."""
        scores = queries @ keys.transpose(-1, -2) * (1 / math.sqrt(queries.shape[-1]))
        if mask is not None:
            allowed = mask[:, :, None, rows, first_key : first_key + keys.shape[-2]]
            return scores.masked_fill(~allowed, float("-inf"))
        return scores + causal_bias(keys.shape[-2], queries.device) if causal else scores


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Queries [B, H, T, D] as float32 [B, H_kv, H / H_kv, T, D]: each key/value head's query heads together, so
    that a block's product reads each key once for them all (no repeated copies of the keys and values)."""
    batch, heads, length, dim = x.shape
    return x.float().reshape(batch, kv_heads, heads // kv_heads, length, dim)


def ring_forward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Attention output [B, H, T / cp, D] and log-sum-exp [B, H_kv, groups, T / cp] of this rank's queries, in
    float32."""
    batch, heads, length, dim = q.shape
    chunk, qg = length // 2, _grouped(q, k.shape[1])
    top = torch.full(qg.shape[:-1], float("-inf"), device=q.device)
    total = torch.zeros(qg.shape[:-1], device=q.device)
    out = torch.zeros_like(qg)
    held = [k, v]
    for step in range(ring.size):
        part = (ring.rank - step) % ring.size
        incoming, flight = ring.shift(held) if step < ring.size - 1 else (held, None)
        keys, values = held[0].float()[:, :, None], held[1].float()[:, :, None]  # broadcast over the groups
        for rows, cols, first_key, causal in ring.blocks(part, chunk):
            scores = ring.scores(qg[..., rows, :], keys[..., cols, :], mask, rows, first_key, causal)
            before = top[..., rows]
            now = torch.maximum(before, scores.amax(-1))
            safe = torch.where(torch.isinf(now), torch.zeros_like(now), now)  # a row with no key yet
            weights = torch.exp(scores - safe[..., None])
            kept = torch.exp(before - safe)
            total[..., rows] = total[..., rows] * kept + weights.sum(-1)
            out[..., rows, :] = out[..., rows, :] * kept[..., None] + weights @ values[..., cols, :]
            top[..., rows] = now
        if flight is not None:
            flight.wait()
        held = incoming
    out = out / total[..., None]
    return out.reshape(batch, heads, length, dim), top + total.log()


def ring_backward(ring: Ring, q, k, v, mask, out, lse, grad):
    """The gradients of q, k and v (float32) from the output's gradient `grad`."""
    batch, heads, length, dim = q.shape
    kv_heads, chunk, scale = k.shape[1], length // 2, 1 / math.sqrt(dim)
    qg, grad = _grouped(q, kv_heads), _grouped(grad, kv_heads)
    row_dot = (grad * _grouped(out, kv_heads)).sum(-1)  # softmax's backward: each row's output gradient . output
    dq = torch.zeros_like(qg)
    held = [k, v]
    collected = [torch.zeros(k.shape, device=q.device), torch.zeros(v.shape, device=q.device)]
    for step in range(ring.size):
        part = (ring.rank - step) % ring.size
        incoming, flight = ring.shift(held) if step < ring.size - 1 else (held, None)
        keys, values = held[0].float()[:, :, None], held[1].float()[:, :, None]
        for rows, cols, first_key, causal in ring.blocks(part, chunk):
            scores = ring.scores(qg[..., rows, :], keys[..., cols, :], mask, rows, first_key, causal)
            weights = torch.exp(scores - lse[..., rows, None])
            collected[1][:, :, cols] += (weights.transpose(-1, -2) @ grad[..., rows, :]).sum(2)
            d_scores = weights * (
                grad[..., rows, :] @ values[..., cols, :].transpose(-1, -2) - row_dot[..., rows, None]
            )
            dq[..., rows, :] += d_scores @ keys[..., cols, :] * scale
            collected[0][:, :, cols] += (d_scores.transpose(-1, -2) @ qg[..., rows, :]).sum(2) * scale
        # The gradients collected for rank `part`'s keys and values travel on with them, and reach it after the last.
        collected, passed = ring.shift(collected)
        for pending in (flight, passed):
            if pending is not None:
                pending.wait()
        held = incoming
    return dq.reshape(batch, heads, length, dim), collected[0], collected[1]


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

"""Weighted mixtures of corpora: which corpus each position of the global stream reads.

Each corpus keeps its own endless `BlockOrder` (its own epochs); the mixture only decides, for
global stream position p, the corpus and how many of that corpus's blocks came before. Positions are
assigned in a fixed pattern of PERIOD positions, repeated: corpus i holds `counts[i]` of them (the
weights apportioned to PERIOD seats by largest remainders), placed greedily where corpus i lags
furthest behind its share (Megatron-LM's blended datasets choose the same way). Every prefix of the
stream is then within one sequence of the weights for each corpus, so even a small global batch
holds the mixture, and position p maps to (corpus, local index) in O(1) from the pattern alone:
layout-independent and resumable from the one counter, like a single corpus.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from project.data.sampler import BlockOrder

# Weights are honoured to 1/PERIOD; the pattern costs two int arrays of this length.
PERIOD = 10_000


def apportion(weights: Sequence[float], seats: int) -> list[int]:
    """Integer counts summing to `seats`, proportional to `weights` (largest remainders), none zero."""
    total = float(sum(weights))
    quotas = [w / total * seats for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[: seats - sum(counts)]:
        counts[i] += 1
    return [max(c, 1) for c in counts]


def interleave(counts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(corpus of each position, its index among that corpus's positions) over one period.

    Greedy in integers: position p goes to the corpus with the largest lag counts[i]*(p+1) - taken[i]*period,
    ties to the lower index; after the period every corpus has exactly counts[i] positions.
    """
    period = sum(counts)
    want = np.asarray(counts, dtype=np.int64)
    taken = np.zeros(len(counts), dtype=np.int64)
    corpus = np.empty(period, dtype=np.int64)
    rank = np.empty(period, dtype=np.int64)
    for p in range(period):
        i = int(np.argmax(want * (p + 1) - taken * period))
        corpus[p], rank[p] = i, taken[i]
        taken[i] += 1
    return corpus, rank


class MixtureOrder:
    """The stream of a mixture's block indices: corpus i's blocks are numbered after those of corpora 0..i-1."""

    def __init__(self, orders: Sequence[BlockOrder], weights: Sequence[float], period: int = PERIOD):
        if len(orders) != len(weights) or not orders:
            raise ValueError("one weight per corpus")
        self.orders = list(orders)
        self.counts = apportion(weights, period)
        self.period = sum(self.counts)
        self.corpus, self.rank = interleave(self.counts)
        sizes = [order.num_blocks for order in self.orders]
        self.offsets = np.cumsum(sizes) - sizes
        self.num_blocks = int(sum(sizes))

    def take(self, start: int, count: int) -> list[int]:
        positions = np.arange(start, start + count, dtype=np.int64)
        cycle, within = np.divmod(positions, self.period)
        corpus = self.corpus[within]
        local = cycle * np.asarray(self.counts, dtype=np.int64)[corpus] + self.rank[within]
        out = np.empty(count, dtype=np.int64)
        for i, order in enumerate(self.orders):
            mine = corpus == i
            if mine.any():
                # A corpus's positions in a slice of the stream are consecutive in its own stream.
                first = int(local[mine][0])
                out[mine] = np.asarray(order.take(first, int(mine.sum())), dtype=np.int64) + self.offsets[i]
        return out.tolist()

    def corpus_of(self, index: int) -> int:
        return int(np.searchsorted(self.offsets, index, side="right")) - 1

"""The order in which training sequences are read: one global stream, cut per replica.

litdata's own shuffling assigns chunks to ranks, so the order depends on the world size. We fix
the order globally instead: the stream is an endless concatenation of seeded epochs of all blocks
(`BlockOrder`); optimizer step s takes stream[s*G : (s+1)*G] for a global batch G, and data-parallel
replica r reads its contiguous share of that slice in micro batches. The same step therefore sees
the same sequences on 1 or N replicas, and a resumed run continues from a single number, the count
of sequences consumed.

Why windows of chunks, and not a permutation of all blocks: a permutation of every block costs
memory and time in proportion to the corpus (for a trillion tokens, 250M blocks: 2 GB and 40 s per
rank before the first batch), and its reads jump between all chunks, which object storage answers
with a whole-chunk download per block. Each epoch here is a seeded permutation of the chunks, cut
into windows of `window_chunks` consecutive chunks; the blocks of one window are shuffled among
themselves. Memory is O(chunks + blocks in a window), and a replica's consecutive reads stay inside
one window (two at a boundary), so litdata's chunk cache serves them.

What the shuffle gives up, stated: within an epoch every block is read exactly once, each chunk's
place is uniformly random, and blocks in one window are in uniformly random order; but two blocks
of different windows never swap sides of a window boundary, so blocks of one chunk (neighbouring
text, often one document) are read within one window's span of each other. A batch therefore mixes
`window_chunks` regions of the corpus, not all of it. When the split has no more chunks than the
window (small corpora, such as the default one), an epoch is a uniform permutation of all blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
from torch.utils.data import Sampler

DEFAULT_WINDOW_CHUNKS = 8


def _rng(*key: int) -> np.random.Generator:
    # SeedSequence mixes every key into the state, so (seed, epoch) and (seed + 1, epoch - 1) differ.
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([k & (2**63 - 1) for k in key])))


class BlockOrder:
    """The endless stream of a split's block indices: seeded epochs, each shuffled in windows of chunks.

    `chunk_blocks[i]` is the number of blocks of chunk i; the blocks of chunk i have the global indices
    sum(chunk_blocks[:i]) ... sum(chunk_blocks[:i + 1]) - 1, as litdata's TokensLoader numbers them.
    `stream` tells apart orders drawn from one seed (the corpora of a mixture).
    """

    def __init__(
        self,
        chunk_blocks: Sequence[int] | np.ndarray,
        seed: int,
        window_chunks: int = DEFAULT_WINDOW_CHUNKS,
        stream: int = 0,
    ):
        sizes = np.asarray(chunk_blocks, dtype=np.int64)
        if sizes.ndim != 1 or (sizes < 0).any():
            raise ValueError("chunk_blocks must be a list of block counts")
        if window_chunks < 1:
            raise ValueError(f"data.shuffle_window={window_chunks} must be at least 1 chunk")
        self.sizes, self.seed, self.window_chunks, self.stream = sizes, seed, window_chunks, stream
        self.starts = np.cumsum(sizes) - sizes  # global index of each chunk's first block
        self.num_blocks = int(sizes.sum())
        if self.num_blocks < 1:
            raise ValueError("the training split holds no complete block")
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    @classmethod
    def single_chunk(cls, num_blocks: int, seed: int) -> BlockOrder:
        """Every epoch a uniform permutation of `num_blocks` blocks (one window holds them all)."""
        return cls([num_blocks], seed)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(chunk order, first stream offset of each window within the epoch, with the epoch's end last)."""
        if epoch not in self._epochs:
            chunks = _rng(self.seed, self.stream, epoch).permutation(len(self.sizes))
            ends = np.cumsum(self.sizes[chunks])[self.window_chunks - 1 :: self.window_chunks]
            if len(chunks) % self.window_chunks:
                ends = np.append(ends, self.num_blocks)
            self._epochs[epoch] = (chunks, np.concatenate([[0], ends]))
            if len(self._epochs) > 2:  # a step crosses at most one epoch boundary
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def _window(self, epoch: int, window: int) -> np.ndarray:
        """The block indices of one window, in their shuffled order."""
        key = (epoch, window)
        if key not in self._windows:
            chunks, _ = self._epoch(epoch)
            members = chunks[window * self.window_chunks : (window + 1) * self.window_chunks]
            blocks = np.concatenate([np.arange(self.starts[c], self.starts[c] + self.sizes[c]) for c in members])
            self._windows[key] = _rng(self.seed, self.stream, epoch, window + 1).permutation(blocks)
            if len(self._windows) > 2:
                self._windows.popitem(last=False)
        return self._windows[key]

    def take(self, start: int, count: int) -> list[int]:
        """Block indices stream[start : start + count], crossing window and epoch boundaries as needed."""
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(start + len(out), self.num_blocks)
            _, window_starts = self._epoch(epoch)
            window = int(np.searchsorted(window_starts, offset, side="right")) - 1
            inside = offset - int(window_starts[window])
            blocks = self._window(epoch, window)
            out.extend(blocks[inside : inside + count - len(out)].tolist())
        return out

    def chunk_of(self, block: int) -> int:
        """The chunk a block index lies in (for measuring how often reads change chunk)."""
        return int(np.searchsorted(self.starts, block, side="right")) - 1


class OrderOfBlocks(Protocol):
    """A global order of block indices: a BlockOrder, or a mixture of them (project.data.mixture)."""

    def take(self, start: int, count: int) -> list[int]: ...


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this replica's micro batches of `order`'s indices, forever (training stops at max_steps).

    `order` is anything with `take(start, count) -> list[int]`: a `BlockOrder`, or a mixture of them.
    """

    def __init__(
        self,
        order: OrderOfBlocks,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        start_sample: int = 0,
    ):
        per_replica = global_batch_size // dp_size
        if per_replica * dp_size != global_batch_size or per_replica % micro_batch_size:
            raise ValueError("global batch must split evenly into data-parallel shares and micro batches")
        self.order = order
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.per_replica = dp_rank, per_replica
        self.start_sample = start_sample

    def __iter__(self) -> Iterator[list[int]]:
        step_start = self.start_sample
        while True:
            share = self.order.take(step_start + self.dp_rank * self.per_replica, self.per_replica)
            for i in range(0, self.per_replica, self.micro_batch_size):
                yield share[i : i + self.micro_batch_size]
            step_start += self.global_batch_size


class ValidationSampler(Sampler[list[int]]):
    """The same `count` validation blocks for any layout, split over replicas, in micro batches.

    The blocks are spread evenly over the split (every k-th block) rather than taken from its start,
    so a small count still samples every validation document. Replicas take contiguous shares that
    differ by at most one block; the last micro batch of a share may be short: the loader pads it
    (collate_blocks), and the module's sequence-weighted mean counts its real rows only.
    """

    def __init__(self, num_samples: int, count: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        count = min(count, num_samples)
        stride = num_samples // count
        chosen = list(range(0, stride * count, stride))
        share = chosen[dp_rank * count // dp_size : (dp_rank + 1) * count // dp_size]
        self.batches = [share[i : i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

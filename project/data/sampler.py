"""The order in which training sequences are read: one global stream, cut per replica.

litdata's own shuffling assigns chunks to ranks, so the order depends on the world size. We fix
the order globally instead: the stream is an endless concatenation of seeded per-epoch
permutations of all blocks; optimizer step s takes stream[s*G : (s+1)*G] for a global batch G,
and data-parallel replica r reads its contiguous share of that slice in micro batches. The same
step therefore sees the same sequences on 1 or N replicas, and a resumed run continues from a
single number, the count of sequences consumed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this replica's micro batches of block indices, forever (training stops at max_steps)."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        start_sample: int = 0,
    ):
        per_replica = global_batch_size // dp_size
        if per_replica * dp_size != global_batch_size or per_replica % micro_batch_size:
            raise ValueError("global batch must split evenly into data-parallel shares and micro batches")
        if num_samples < 1:
            raise ValueError("the training split holds no complete block")
        self.num_samples, self.seed = num_samples, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.per_replica = dp_rank, per_replica
        self.start_sample = start_sample
        self._cached: tuple[int, torch.Tensor] | None = None  # one epoch's permutation, reused across steps

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_permutation(self.num_samples, self.seed, epoch))
        return self._cached[1]

    def _stream(self, start: int, count: int) -> list[int]:
        """Indices stream[start : start + count], crossing epoch boundaries as needed."""
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(start + len(out), self.num_samples)
            perm = self._permutation(epoch)
            out.extend(perm[offset : offset + count - len(out)].tolist())
        return out

    def __iter__(self) -> Iterator[list[int]]:
        step_start = self.start_sample
        while True:
            share = self._stream(step_start + self.dp_rank * self.per_replica, self.per_replica)
            for i in range(0, self.per_replica, self.micro_batch_size):
                yield share[i : i + self.micro_batch_size]
            step_start += self.global_batch_size


class ValidationSampler(Sampler[list[int]]):
    """The same `count` validation blocks for any layout, split over replicas, in micro batches.

    The blocks are spread evenly over the split (every k-th block) rather than taken from its start,
    so a small count still samples every validation document. Replicas take contiguous shares that
    differ by at most one block; the last micro batch of a share may be short, which the
    sequence-weighted mean in the module accounts for.
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

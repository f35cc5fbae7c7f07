"""What a loader worker process runs: token blocks read by index, and their collation into batches.

Kept apart from the data module and free of Lightning, so that the process loader workers start from
imports only this (project.data.loader_workers): a worker is then ready in a fraction of a second.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from litdata import StreamingDataset, TokensLoader
from torch.utils.data import Dataset

from project.data.storage import ChunkCache, cache_folder, is_remote
from project.model.loss import IGNORED
from project.runtime.arguments import parse_size


def collate_blocks(blocks: list[torch.Tensor], rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of seq_len + 1 tokens -> inputs and next-token targets, each [B, seq_len]; with `rows`, a batch of
    fewer blocks padded to that many rows, of token 0 with IGNORED targets (validation's last micro batch: every
    batch then has the shape a compiled model was built for, and none compiles it again)."""
    batch = torch.stack([torch.as_tensor(b) for b in blocks]).long()
    if len(blocks) >= rows:
        return batch[:, :-1], batch[:, 1:]
    # Views of [rows, seq_len + 1] tensors, as a full batch's are: a compiled model guards on strides too.
    padding = rows - len(blocks), batch.shape[1]
    inputs, targets = torch.cat([batch, batch.new_zeros(padding)]), torch.cat([batch, batch.new_full(padding, IGNORED)])
    return inputs[:, :-1], targets[:, 1:]


class TokenBlocks(Dataset):
    """Random access to the token blocks of one split, read through litdata's chunked reader.

    litdata's StreamingDataset is an IterableDataset; wrapping it map-style lets our sampler, not
    litdata's rank-dependent shuffle, decide the order (see project.data.sampler).
    """

    def __init__(
        self,
        split_dir: str,
        block_size: int,
        num_blocks: int,
        cache_dir: str | None = None,
        cache_size: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ):
        self.chunks: ChunkCache | None = None
        local: str | Path = split_dir
        if is_remote(split_dir):  # read as a local dataset whose chunks are fetched on first use
            local = cache_folder(cache_dir, "chunks", split_dir)
            self.chunks = ChunkCache(
                split_dir, local, parse_size(cache_size or "50GB", "data.cache_size"), storage_options
            )
        self.blocks = StreamingDataset(str(local), item_loader=TokensLoader(block_size=block_size))
        self.num_blocks = num_blocks
        # TokensLoader numbers the blocks chunk after chunk, each chunk holding dim // block_size of them.
        index = json.loads((Path(local) / "index.json").read_bytes())
        self.chunk_blocks = [int(chunk["dim"]) // block_size for chunk in index["chunks"]]
        self.chunk_starts = list(itertools.accumulate(self.chunk_blocks, initial=0))

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.chunks is not None:
            self.chunks.ensure(bisect.bisect_right(self.chunk_starts, index) - 1)
        return self.blocks[index]


class MixedBlocks(Dataset):
    """The blocks of several corpora as one index space: corpus i's after those of corpora 0..i-1."""

    def __init__(self, parts: list[TokenBlocks]):
        self.parts = parts
        self.offsets = [sum(len(p) for p in parts[:i]) for i in range(len(parts))]

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __getitem__(self, index: int) -> torch.Tensor:
        i = bisect.bisect_right(self.offsets, index) - 1
        return self.parts[i][index - self.offsets[i]]

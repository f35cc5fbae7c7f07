"""TokenShardDataModule: batches of (input, target) token blocks from litdata shards."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from litdata import StreamingDataset, TokensLoader
from torch.utils.data import DataLoader, Dataset

from project.checks import check_block_size, check_shards, read_manifest
from project.data.sampler import GlobalBatchSampler, ValidationSampler
from project.data.tokenizer import load_tokenizer
from project.errors import ConfigError


def data_parallel_coords(trainer: Any) -> tuple[int, int]:
    """(rank, size) along the data-parallel dimension.

    Strategies with a device mesh (Lightning's ModelParallelStrategy) name a `data_parallel`
    dimension; ranks sharing a coordinate on it hold one replica and must read the same batch.
    Without a mesh every rank is its own replica.
    """
    mesh = getattr(trainer.strategy, "device_mesh", None)
    if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
        dp = mesh["data_parallel"]
        return dp.get_local_rank(), dp.size()
    return trainer.global_rank, trainer.world_size


def collate_blocks(blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of seq_len + 1 tokens -> inputs and next-token targets, each [B, seq_len]."""
    batch = torch.stack([torch.as_tensor(b) for b in blocks]).long()
    return batch[:, :-1], batch[:, 1:]


class TokenBlocks(Dataset):
    """Random access to the token blocks of one split, read through litdata's chunked reader.

    litdata's StreamingDataset is an IterableDataset; wrapping it map-style lets our sampler, not
    litdata's rank-dependent shuffle, decide the order (see project.data.sampler).
    """

    def __init__(self, split_dir: Path, block_size: int, num_blocks: int):
        self.blocks = StreamingDataset(str(split_dir), item_loader=TokensLoader(block_size=block_size))
        self.num_blocks = num_blocks

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.blocks[index]


class TokenShardDataModule(LightningDataModule):
    """Streams prepared token shards; one global sequence order whatever the number of replicas.

    A global batch larger than the training split is refused unless `allow_repeats`.
    `dp_rank`/`dp_size` say which data-parallel replica this process feeds. Left as None they are
    read from the trainer when it sets the module up (the mesh's data-parallel dimension, else the
    global rank), so ranks of one tensor- or pipeline-parallel replica read identical batches.
    """

    def __init__(
        self,
        data_dir: str,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        seed: int = 1234,
        num_workers: int = 1,
        val_sequences: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        allow_repeats: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.manifest = read_manifest(data_dir)
        check_block_size(data_dir, self.manifest, seq_len)
        check_shards(data_dir)
        train_blocks = int(self.manifest["splits"]["train"]["blocks"])
        if global_batch_size > train_blocks:
            if not allow_repeats:
                raise ConfigError(
                    f"global_batch_size={global_batch_size} is more than the {train_blocks} training blocks in {data_dir}: "
                    f"every step would read some blocks twice. Lower global_batch_size to {train_blocks} or less, add "
                    "text (or lower data.seq_len and re-prepare), or set data.allow_repeats=true to train this way."
                )
            rank_zero_warn(
                f"each step reads {global_batch_size} sequences from {train_blocks} training blocks (data.allow_repeats=true): "
                f"every block is read about {global_batch_size / train_blocks:.1f} times per step."
            )
        self._start_sample = 0  # sequences consumed before this run (resume)
        self._start_step = 0

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    @cached_property
    def tokenizer_identity(self) -> dict[str, Any]:
        """What the token ids of these shards mean, for a checkpoint to record and a resumed run to compare
        (project.lit_module): the tokenizer's kind, size, end-of-text id and a digest of its vocabulary."""
        info = self.manifest["tokenizer"]
        identity = {"kind": info.get("kind"), "vocab_size": int(info["vocab_size"]), "eos_id": int(info["eos_id"])}
        path = Path(self.hparams.data_dir) / str(info.get("file", ""))
        if info.get("file") and path.is_file():
            identity["vocabulary_sha256"] = load_tokenizer(path).vocabulary_digest()
        return identity

    def _split(self, name: str) -> TokenBlocks:
        # The manifest's count, not len(StreamingDataset): litdata reports a per-rank length under DDP.
        num_blocks = int(self.manifest["splits"][name]["blocks"])
        return TokenBlocks(Path(self.hparams.data_dir) / name, self.hparams.seq_len + 1, num_blocks)

    def setup(self, stage: str | None = None) -> None:
        if self.hparams.dp_rank is not None:
            self.dp_rank, self.dp_size = self.hparams.dp_rank, self.hparams.dp_size
        elif self.trainer is not None:
            self.dp_rank, self.dp_size = data_parallel_coords(self.trainer)
        else:
            self.dp_rank, self.dp_size = 0, 1
        self.train_set = self._split("train")
        self.val_set = self._split("val")

    def _loader(self, dataset: TokenBlocks, batch_sampler: Any) -> DataLoader:
        workers = self.hparams.num_workers
        return DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=collate_blocks,
            num_workers=workers,
            persistent_workers=workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        # Lightning restores global_step before it asks for loaders, so this is the resumed step.
        self._start_step = self.trainer.global_step if self.trainer is not None else 0
        sampler = GlobalBatchSampler(
            len(self.train_set),
            self.hparams.global_batch_size,
            self.hparams.micro_batch_size,
            self.dp_rank,
            self.dp_size,
            self.hparams.seed,
            start_sample=self._start_sample,
        )
        return self._loader(self.train_set, sampler)

    def val_dataloader(self) -> DataLoader:
        if len(self.val_set) == 0:
            raise ConfigError(
                f"the validation split in {self.hparams.data_dir} holds no complete block of {self.hparams.seq_len + 1} "
                "tokens: its documents are too few or too short. Raise data.val_fraction (or lower data.seq_len) and re-prepare."
            )
        count = min(len(self.val_set), self.hparams.val_sequences or len(self.val_set))
        if count < self.dp_size:
            raise ConfigError(
                f"val_sequences={count} (validation split: {len(self.val_set)} blocks) is fewer than the {self.dp_size} "
                "data-parallel replicas: raise val_sequences, or data.val_fraction and re-prepare."
            )
        sampler = ValidationSampler(len(self.val_set), count, self.hparams.micro_batch_size, self.dp_rank, self.dp_size)
        return self._loader(self.val_set, sampler)

    # The data position is one number: sequences consumed, advanced by the global batch at each
    # optimizer step. It is exact whatever Lightning does or does not restore of the loader itself,
    # and it survives a change of the number of replicas (or of the global batch) on resume.
    @property
    def samples_consumed(self) -> int:
        """Training sequences read so far, all replicas together, previous runs of a resumed one included."""
        steps = self.trainer.global_step - self._start_step if self.trainer is not None else 0
        return self._start_sample + steps * self.hparams.global_batch_size

    def state_dict(self) -> dict[str, Any]:
        return {
            "samples_consumed": self.samples_consumed,
            "seed": self.hparams.seed,
            "num_train_blocks": int(self.manifest["splits"]["train"]["blocks"]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.hparams.seed:
            raise ConfigError(
                f"the checkpoint was trained with data.seed={state.get('seed')}, this run has data.seed={self.hparams.seed}: "
                "resuming would read a different sequence order; set data.seed to the checkpoint's value."
            )
        if state.get("num_train_blocks") != self.manifest["splits"]["train"]["blocks"]:
            rank_zero_warn(
                f"the checkpoint was trained on {state.get('num_train_blocks')} training blocks, {self.hparams.data_dir} "
                f"holds {self.manifest['splits']['train']['blocks']}: the run continues, in a different order."
            )
        self._start_sample = int(state["samples_consumed"])

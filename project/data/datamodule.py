"""TokenShardDataModule: batches of (input, target) token blocks from litdata shards."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from project.data.blocks import MixedBlocks, TokenBlocks, collate_blocks
from project.data.heldout import HeldOutSet, check_prepared, check_same_tokenizer, check_split, held_out_sets
from project.data.loader_workers import loader_options
from project.data.mixture import MixtureOrder
from project.data.sampler import DEFAULT_WINDOW_CHUNKS, BlockOrder, GlobalBatchSampler, ValidationSampler
from project.data.shards import read_manifest
from project.data.storage import check_prepared_shards, join
from project.data.tasks import Task, encode_requests, load_task, request_rows
from project.data.tokenizer import Tokenizer, load_tokenizer
from project.parallel.contract import contract_of
from project.runtime.errors import ConfigError
from project.runtime.secrets import without_secrets


def data_parallel_coords(trainer: Any) -> tuple[int, int]:
    """(rank, size) along the data-parallel dimension, as the strategy says (project.parallel.contract): ranks
    of one model replica (a tensor-parallel group, a pipeline) must read the same batch."""
    return contract_of(trainer.strategy).data_parallel_coords(trainer)


@dataclass(frozen=True)
class Corpus:
    """One prepared shard folder of a training mixture, and its share of every global batch."""

    name: str
    dir: str
    weight: float = 1.0


def corpora_from(mix: Sequence[Mapping[str, Any]]) -> list[Corpus]:
    """`data.mix` ([{dir, weight, name?}, ...]) as Corpus entries, refused with a clear error when malformed."""
    corpora = []
    for i, entry in enumerate(mix):
        if not isinstance(entry, Mapping) or "dir" not in entry:
            raise ConfigError(
                f"data.mix[{i}]={entry!r} needs a `dir` (prepared shards) and a `weight`, e.g. "
                f"{{dir: data/web, weight: 0.7}}."
            )
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(
                f"data.mix[{i}].weight={weight!r} must be a positive number (weights are normalized to sum to 1)."
            )
        corpora.append(Corpus(str(entry.get("name") or Path(str(entry["dir"])).name), str(entry["dir"]), float(weight)))
    names = [c.name for c in corpora]
    if not corpora or len(set(names)) != len(names):
        raise ConfigError(
            f"data.mix needs at least one corpus, each with its own name (got {names}): set `name:` on each entry."
        )
    total = sum(c.weight for c in corpora)
    return [Corpus(c.name, c.dir, c.weight / total) for c in corpora]


def tokenizer_identity(data_dir: str | Path) -> dict[str, Any]:
    """What the token ids of the shards prepared in `data_dir` (a local folder or view) mean: the tokenizer's
    kind, size, end-of-text id and a digest of its vocabulary, for a checkpoint to record and a resume to compare."""
    info = read_manifest(data_dir)["tokenizer"]
    identity = {"kind": info.get("kind"), "vocab_size": int(info["vocab_size"]), "eos_id": int(info["eos_id"])}
    path = Path(data_dir) / str(info.get("file", ""))
    if info.get("file") and path.is_file():
        identity["vocabulary_sha256"] = load_tokenizer(path).vocabulary_digest()
    return identity


class TokenShardDataModule(LightningDataModule):
    """Streams prepared token shards; one global sequence order whatever the number of replicas.

    `data_dir` names one corpus; `mix` ([{dir, weight, name}]) several, each step drawing from them by
    weight (project.data.mixture); then validation reads every corpus and reports each.
    A global batch larger than the training split is refused unless `allow_repeats`.
    `dp_rank`/`dp_size` say which data-parallel replica this process feeds. Left as None they are
    read from the trainer when it sets the module up (the mesh's data-parallel dimension, else the
    global rank), so ranks of one tensor- or pipeline-parallel replica read identical batches.
    `shuffle_window` is the number of chunks whose blocks are shuffled together (project.data.sampler).
    """

    hparams: Any  # Lightning's AttributeDict of the arguments above (typed by Lightning as a plain mapping)

    def __init__(
        self,
        data_dir: str | None,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        seed: int = 1234,
        num_workers: int = 1,
        val_sequences: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        allow_repeats: bool = False,
        mix: Sequence[Mapping[str, Any]] | None = None,
        shuffle_window: int = DEFAULT_WINDOW_CHUNKS,
        cache_dir: str | None = None,
        cache_size: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        continue_from_sample: int | None = None,
        eval_sets: Mapping[str, Any] | None = None,
        eval_tasks: Sequence[str] | None = None,
        eval_task_limit: int | None = None,
    ):
        """`continue_from_sample`: the data position to read on from, whatever a checkpoint says (a run rolled
        back past a loss spike's batches: project.training.stability); None: the checkpoint's, or the start.
        `eval_sets`: held-out sets evaluated inside training (project.data.heldout; `eval_loaders`); `eval_tasks`:
        downstream tasks' YAML files (project.data.tasks; `task_batches`), the first `eval_task_limit` documents of
        each."""
        super().__init__()
        # Lightning logs the hyperparameters to every logger and keeps them in checkpoints: they hold no credential
        # given in storage_options (nor in an entry of mix), while reading still uses the options as given.
        self.storage_options = dict(storage_options) if storage_options else None
        self.save_hyperparameters(ignore=["storage_options", "mix", "continue_from_sample"])
        self.save_hyperparameters(without_secrets({"storage_options": storage_options, "mix": mix}))
        self.corpora = (
            corpora_from(mix) if mix else [Corpus(str(data_dir).rstrip("/").rsplit("/", 1)[-1], str(data_dir))]
        )
        # Each corpus's folder of manifest, tokenizer and indexes: itself, or a local view of remote shards.
        checked = [check_prepared_shards(c.dir, seq_len, cache_dir, storage_options) for c in self.corpora]
        self.views = {c.dir: view for c, (view, _) in zip(self.corpora, checked)}
        self.manifests = [manifest for _, manifest in checked]
        self.manifest = self.manifests[0]
        if len(self.corpora) > 1:
            self._check_one_tokenizer()
        train_blocks = sum(int(m["splits"]["train"]["blocks"]) for m in self.manifests)
        where = self.corpora[0].dir if len(self.corpora) == 1 else "the corpora of data.mix"
        if global_batch_size > train_blocks:
            if not allow_repeats:
                raise ConfigError(
                    f"global_batch_size={global_batch_size} is more than the {train_blocks} training blocks in "
                    f"{where}: every step would read some blocks twice. Lower global_batch_size to {train_blocks} or "
                    "less, add text (or lower data.seq_len and re-prepare), or set data.allow_repeats=true to train "
                    "this way."
                )
            rank_zero_warn(
                f"each step reads {global_batch_size} sequences from {train_blocks} training blocks "
                f"(data.allow_repeats=true): every block is read about {global_batch_size / train_blocks:.1f} times "
                "per step."
            )
        self._continue_from = continue_from_sample
        self._start_sample = continue_from_sample or 0  # sequences consumed before this run (resume)
        self._start_step = 0
        self.held_out = self._check_held_out(held_out_sets(eval_sets), seq_len, cache_dir, storage_options)
        self.tasks = self._load_tasks(eval_tasks or [], eval_task_limit)

    def _load_tasks(self, paths: Sequence[str], limit: int | None) -> list[tuple[Task, list[tuple[list[int], int]]]]:
        """Each downstream task with its requests' tokens, read and encoded before anything trains."""
        if isinstance(paths, str):
            paths = [paths]
        if not isinstance(paths, Sequence) or not all(isinstance(path, str) for path in paths):
            raise ConfigError(f"eval.tasks={paths!r} must be a list of task files: eval.tasks=[path/to/task.yaml].")
        if paths and self.tokenizer is None:
            raise ConfigError(
                f"eval.tasks: the shards of {self.corpora[0].dir} keep no tokenizer file to encode the tasks' text "
                "with: prepare them again (project.prepare keeps it)."
            )
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"eval.task_limit={limit!r} must be a positive number of documents, or null for all.")
        loaded = []
        for i, path in enumerate(paths):
            task = load_task(path, f"eval.tasks[{i}]", limit)
            assert self.tokenizer is not None
            encoded = encode_requests(
                task, self.tokenizer.encode, self.eos_id, self.hparams.seq_len, f"eval.tasks[{i}]"
            )
            loaded.append((task, encoded))
        names = [task.name for task, _ in loaded]
        if len(set(names)) != len(names):
            raise ConfigError(f"eval.tasks: two tasks are named alike ({names}); their metrics would mix.")
        return loaded

    def task_batches(self) -> list[tuple[Task, Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]]:
        """Each downstream task and this replica's share of its requests, in micro batches of (the requests'
        indices, -1 for a padding row; inputs; targets), made as they are read: every replica gets as many rows, the
        ranks of a replica the same ones."""
        return [(task, self._task_rows(encoded)) for task, encoded in self.tasks]

    def _task_rows(
        self, encoded: list[tuple[list[int], int]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        rows, count = self.hparams.micro_batch_size, -(-len(encoded) // self.dp_size)
        own = [i if i < len(encoded) else -1 for i in range(self.dp_rank, count * self.dp_size, self.dp_size)]
        for start in range(0, count, rows):
            indices = own[start : start + rows]
            requests = [encoded[i] if i >= 0 else ([], 1) for i in indices]
            yield (torch.tensor(indices), *request_rows(requests, self.hparams.seq_len, self.eos_id))

    def _check_held_out(
        self, sets: list[HeldOutSet], seq_len: int, cache_dir: str | None, storage_options: Mapping[str, Any] | None
    ) -> dict[str, tuple[HeldOutSet, Path, int]]:
        """Each held-out set with the local folder of its manifest and its split's blocks, checked before anything
        trains: prepared for blocks of this seq_len, with the training data's tokenizer, holding the split."""
        checked = {}
        ours = self.tokenizer_identity if sets else {}
        for held_out in sets:
            check_prepared(held_out)
            try:
                view, manifest = check_prepared_shards(held_out.dir, seq_len, cache_dir, storage_options)
            except ConfigError as error:  # its words are data.dir's: say which setting names the folder
                raise ConfigError(f"eval.sets.{held_out.name}.dir: {error}") from None
            check_same_tokenizer(held_out, tokenizer_identity(view), ours)
            checked[held_out.name] = (held_out, view, check_split(held_out, manifest))
        return checked

    def eval_loaders(self) -> dict[str, DataLoader]:
        """This replica's share of each held-out set, in micro batches (a short last one padded, as validation's),
        made at setup."""
        return self._eval_loaders

    def _held_out_loader(self, name: str, held_out: HeldOutSet, blocks: int) -> DataLoader:
        hp = self.hparams
        split_dir = join(held_out.dir, held_out.split)
        data = TokenBlocks(split_dir, hp.seq_len + 1, blocks, hp.cache_dir, hp.cache_size, self.storage_options)
        count = min(blocks, held_out.sequences or blocks)
        if count < self.dp_size:
            raise ConfigError(
                f"eval.sets.{name}.sequences={count} ({held_out.split} split of {held_out.dir}: {blocks} blocks) "
                f"is fewer than the {self.dp_size} data-parallel replicas: raise it, or evaluate a larger split."
            )
        sampler = ValidationSampler(blocks, count, hp.micro_batch_size, self.dp_rank, self.dp_size)
        # Read in the main process, with a generator of its own (a loader's iterator draws a seed for its workers even
        # where it has none): an evaluation draws nothing from the random state training goes on with.
        return self._loader(data, sampler, rows=hp.micro_batch_size, main_process=True)

    @cached_property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer the shards were prepared with; None where they keep no tokenizer file."""
        info = self.manifest["tokenizer"]
        path = self.views[self.corpora[0].dir] / str(info.get("file", ""))
        return load_tokenizer(path) if info.get("file") and path.is_file() else None

    @cached_property
    def token_bytes(self) -> list[int] | None:
        """The bytes of text each token id stands for (bits per byte: project.data.tokenizer); None where the shards
        keep no tokenizer file."""
        return self.tokenizer.token_bytes() if self.tokenizer is not None else None

    def _check_one_tokenizer(self) -> None:
        first = self.corpora[0]
        for corpus in self.corpora[1:]:
            theirs, ours = tokenizer_identity(self.views[corpus.dir]), tokenizer_identity(self.views[first.dir])
            if theirs != ours:
                differ = ", ".join(
                    f"{k} {str(ours.get(k))[:12]} vs {str(theirs.get(k))[:12]}"
                    for k in ours
                    if ours.get(k) != theirs.get(k)
                )
                raise ConfigError(
                    f"data.mix: corpus {corpus.name!r} ({corpus.dir}) was prepared with another tokenizer than "
                    f"{first.name!r} ({first.dir}): {differ}. Every corpus of a mixture must share one: prepare "
                    f"{corpus.dir} again with data.tokenizer="
                    f"{Path(first.dir) / str(self.manifests[0]['tokenizer'].get('file', 'tokenizer.json'))}."
                )

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["tokenizer"]["eos_id"])

    @cached_property
    def tokenizer_identity(self) -> dict[str, Any]:
        """What the token ids of these shards mean, for a checkpoint to record and a resumed run to compare
        (project.training.lit_module): the tokenizer's kind, size, end-of-text id and a digest of its vocabulary."""
        return tokenizer_identity(self.views[self.corpora[0].dir])

    @property
    def validation_corpora(self) -> list[tuple[str, float]]:
        """(name, weight) of each validation loader, in order: the module reports val/loss per corpus."""
        return [(c.name, c.weight) for c in self.corpora]

    def _split(self, corpus: int, name: str) -> TokenBlocks:
        # The manifest's count, not len(StreamingDataset): litdata reports a per-rank length under DDP.
        num_blocks = int(self.manifests[corpus]["splits"][name]["blocks"])
        hp, split_dir = self.hparams, join(self.corpora[corpus].dir, name)
        return TokenBlocks(split_dir, hp.seq_len + 1, num_blocks, hp.cache_dir, hp.cache_size, self.storage_options)

    def setup(self, stage: str | None = None) -> None:
        if self.hparams.dp_rank is not None:
            self.dp_rank, self.dp_size = self.hparams.dp_rank, self.hparams.dp_size
        elif self.trainer is not None:
            self.dp_rank, self.dp_size = data_parallel_coords(self.trainer)
        else:
            self.dp_rank, self.dp_size = 0, 1
        train = [self._split(i, "train") for i in range(len(self.corpora))]
        self.val_sets = [self._split(i, "val") for i in range(len(self.corpora))]
        self._eval_loaders = {
            name: self._held_out_loader(name, held_out, blocks) for name, (held_out, _, blocks) in self.held_out.items()
        }
        orders = [
            BlockOrder(part.chunk_blocks, self.hparams.seed, self.hparams.shuffle_window, stream=i)
            for i, part in enumerate(train)
        ]
        self.train_set: TokenBlocks | MixedBlocks
        self.train_order: BlockOrder | MixtureOrder
        if len(train) == 1:
            self.train_set, self.train_order = train[0], orders[0]
        else:
            self.train_set = MixedBlocks(train)
            self.train_order = MixtureOrder(orders, [c.weight for c in self.corpora])

    def _loader(self, dataset: Dataset, batch_sampler: Any, rows: int = 0, main_process: bool = False) -> DataLoader:
        collate = partial(collate_blocks, rows=rows) if rows else collate_blocks
        if main_process:
            options: dict[str, Any] = {**loader_options(0), "generator": torch.Generator()}
        else:
            options = loader_options(self.hparams.num_workers)
        return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate, **options)

    def train_dataloader(self) -> DataLoader:
        # Lightning restores global_step before it asks for loaders, so this is the resumed step.
        self._start_step = self.trainer.global_step if self.trainer is not None else 0
        sampler = GlobalBatchSampler(
            self.train_order,
            self.hparams.global_batch_size,
            self.hparams.micro_batch_size,
            self.dp_rank,
            self.dp_size,
            start_sample=self._start_sample,
        )
        return self._loader(self.train_set, sampler)

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        loaders = [self._val_loader(corpus, val_set) for corpus, val_set in zip(self.corpora, self.val_sets)]
        return loaders[0] if len(loaders) == 1 else loaders

    def _val_loader(self, corpus: Corpus, val_set: TokenBlocks) -> DataLoader:
        if len(val_set) == 0:
            raise ConfigError(
                f"the validation split in {corpus.dir} holds no complete block of {self.hparams.seq_len + 1} "
                "tokens: its documents are too few or too short. Raise data.val_fraction (or lower data.seq_len) and "
                "re-prepare."
            )
        count = min(len(val_set), self.hparams.val_sequences or len(val_set))
        if count < self.dp_size:
            raise ConfigError(
                f"val_sequences={count} (validation split of {corpus.dir}: {len(val_set)} blocks) is fewer than the "
                f"{self.dp_size} data-parallel replicas: raise val_sequences, or data.val_fraction and re-prepare."
            )
        sampler = ValidationSampler(len(val_set), count, self.hparams.micro_batch_size, self.dp_rank, self.dp_size)
        # A share's last micro batch may be short: padded to the micro batch (rows the loss leaves out).
        return self._loader(val_set, sampler, rows=self.hparams.micro_batch_size)

    # The data position is one number: sequences consumed, advanced by the global batch at each
    # optimizer step. It is exact whatever Lightning does or does not restore of the loader itself,
    # and it survives a change of the number of replicas (or of the global batch) on resume.
    @property
    def samples_consumed(self) -> int:
        """Training sequences read so far, all replicas together, previous runs of a resumed one included."""
        steps = self.trainer.global_step - self._start_step if self.trainer is not None else 0
        return self._start_sample + steps * self.hparams.global_batch_size

    def _train_blocks(self) -> int | list[int]:
        blocks = [int(m["splits"]["train"]["blocks"]) for m in self.manifests]
        return blocks[0] if len(blocks) == 1 else blocks

    def state_dict(self) -> dict[str, Any]:
        state = {
            "samples_consumed": self.samples_consumed,
            "seed": self.hparams.seed,
            "num_train_blocks": self._train_blocks(),
        }
        if len(self.corpora) > 1:
            state["mix"] = {c.name: c.weight for c in self.corpora}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.hparams.seed:
            raise ConfigError(
                f"the checkpoint was trained with data.seed={state.get('seed')}, this run has "
                f"data.seed={self.hparams.seed}: resuming would read a different sequence order; set data.seed to the "
                "checkpoint's value."
            )
        mix = {c.name: c.weight for c in self.corpora} if len(self.corpora) > 1 else None
        if state.get("mix") != mix:
            rank_zero_warn(
                f"the checkpoint was trained on the mixture {state.get('mix') or 'of one corpus'}, this run reads "
                f"{mix or 'one corpus'}: the run continues from its data position with the new mixture."
            )
        elif state.get("num_train_blocks") != self._train_blocks():
            rank_zero_warn(
                f"the checkpoint was trained on {state.get('num_train_blocks')} training blocks, this run's data holds "
                f"{self._train_blocks()}: the run continues, in a different order."
            )
        self._start_sample = int(state["samples_consumed"]) if self._continue_from is None else self._continue_from

"""LlamaLitModule: next-token loss, AdamW with warmup + cosine, clipping, metrics."""

from __future__ import annotations

import contextlib
import functools
import io
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any, Callable, Mapping, cast

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.distributed.tensor import DTensor
from torchmetrics import MeanMetric

from project.checkpoint.files import rebase_batch_progress, refuse_older_format
from project.checkpoint.reshard import read_whole
from project.config.optim import OptimConfig
from project.config.stability import StabilityConfig
from project.data.datamodule import TokenShardDataModule
from project.data.tokenizer import CHECKPOINT_TOKENIZER, tokenizer_record
from project.hf.published import load_published_weights
from project.model.config import LlamaConfig
from project.model.families import build_model, model_config
from project.model.loss import IGNORED, target_scores
from project.model.spec import own_name
from project.parallel.contract import LlamaStrategy, contract_of
from project.runtime.errors import ConfigError
from project.training.callbacks.steps import logs_at
from project.training.nonfinite import NonFiniteGuard, takes_the_flag_on_the_device
from project.training.schedule import lr_at, schedule_record
from project.training.stability import Rollback, RollbackRequested, SpikeDetector

__all__ = ["LlamaLitModule", "OptimConfig", "document_ids", "lr_at"]  # lr_at: the schedule, where tests look


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Index of the document each token belongs to; an EOS closes its own document."""
    is_eos = (tokens == eos_id).long()
    return is_eos.cumsum(dim=1) - is_eos


def _plain(loss: torch.Tensor) -> torch.Tensor:
    # Logits split over the vocabulary (tensor parallel with loss_parallel) give a replicated DTensor;
    # logging and accumulation want a plain tensor. The conversion is differentiable.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _weight_shapes(model: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # shapes only: no memory, whatever the model's size
        return {name: tuple(t.shape) for name, t in build_model(model).state_dict().items()}


def check_resumable(
    checkpoint: Mapping[str, Any],
    model: Mapping[str, Any],
    tokenizer: Mapping[str, Any] | None,
    source: Any,
    data_dir: Any = None,
) -> None:
    """Refuse to resume from a checkpoint of another model shape, or one trained on the token ids of another
    tokenizer than `tokenizer` (that of the shards in `data_dir`), naming the settings that differ, or one written
    before the format this version reads (refuse_older_format). A fit that read no token shards records no tokenizer:
    there is nothing to compare."""
    refuse_older_format(checkpoint, source)
    recorded = checkpoint.get("tokenizer")
    given: Mapping[str, Any] = tokenizer or {}
    differ = [k for k in given if isinstance(recorded, Mapping) and k in recorded and recorded[k] != given[k]]
    if differ:
        assert isinstance(recorded, Mapping)
        said = ", ".join(f"{k} {str(recorded[k])[:12]} there, {str(given[k])[:12]} here" for k in differ)
        raise ConfigError(
            f"ckpt_path={source} was trained on the token ids of another tokenizer than the shards in "
            f"data.dir={data_dir} ({said}): its embeddings would stand for other tokens. Resume with data.dir set to "
            "shards prepared with the checkpoint's tokenizer (data.tokenizer=PATH when preparing), or start a new run "
            "without ckpt_path."
        )
    saved = (checkpoint.get("hyper_parameters") or {}).get("model")
    if not isinstance(saved, Mapping):
        return  # not written by this module: load_state_dict has the last word
    try:
        theirs = _weight_shapes(saved)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"ckpt_path={source}: its hyper_parameters['model'] is not a model config this platform builds ({error})."
        ) from None
    ours = _weight_shapes(model)
    if theirs != ours:
        name = next(n for n in sorted(theirs.keys() | ours.keys()) if theirs.get(n) != ours.get(n))
        keys = [key for key in model if saved.get(key) != model[key]]
        raise ConfigError(
            f"ckpt_path={source} holds a model of another shape ({name}: {list(theirs.get(name, []))} there, "
            f"{list(ours.get(name, []))} here): it was trained with {_settings(saved, keys)}, this run has "
            f"{_settings(model, keys)}. Resume with the checkpoint's model settings, or start a new run without "
            "ckpt_path."
        )


def _settings(model: Mapping[str, Any], keys: list[str]) -> str:
    """`model.dim=64 model.n_kv_heads=null`, as the command line takes them."""
    return " ".join(f"model.{key}={'null' if model.get(key) is None else model.get(key)}" for key in keys)


class LlamaLitModule(LightningModule):
    """Trains a `Llama` built from `model` (a LlamaConfig or its fields as a dict).

    Everything is kept as hyperparameters, so `LlamaLitModule.load_from_checkpoint(path).model`
    rebuilds the model with no other input.
    """

    hparams: Any  # Lightning's AttributeDict of the arguments (typed by Lightning as a plain mapping)

    def __init__(
        self,
        model: LlamaConfig | dict,
        optim: OptimConfig | dict | None = None,
        document_mask: bool = False,
        eos_id: int | None = None,
        init_on_meta: bool = False,
        weights_from_checkpoint: bool = False,
        init_from: str | None = None,
        init_seed: int = 0,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        stability: StabilityConfig | dict | None = None,
        rollbacks: list[Rollback | dict] | None = None,
    ):
        """`optimizer`: builds the optimizer from the parameter groups (conf/train.yaml's module.optimizer, a
        partial of torch.optim.AdamW with optim.lr, betas and eps, fused); None: that AdamW. The groups carry the weight
        decay (optim.weight_decay on matrices, none on norms).

        `init_on_meta`: build the model without memory, for a strategy that shards it in `configure_model` and
        initializes the shards (LlamaParallelStrategy), so that no rank ever holds the whole model; with
        `weights_from_checkpoint` (a resumed run) the shards are only allocated, and the checkpoint fills them.
        `init_from`: a published Hugging Face folder whose weights fill the model in `configure_model` instead of
        random ones (a new run). None is a hyperparameter: a checkpoint loads either way. `init_seed`: the random
        initial weights are a function of it and each parameter's name only (the run's `seed`).

        `stability`: what a loss spike does (project.training.stability); `rollbacks`: those the run made before
        this module was built (it restarts with a new one), kept in its checkpoints."""
        super().__init__()
        model_cfg = model_config(model)
        optim_cfg = optim if isinstance(optim, OptimConfig) else OptimConfig(**(optim or {}))
        stability_cfg = stability if isinstance(stability, StabilityConfig) else StabilityConfig(**(stability or {}))
        if document_mask and eos_id is None:
            raise ValueError("document_mask needs the tokenizer's eos_id")
        self.save_hyperparameters(
            {
                "model": asdict(model_cfg),  # `family` among the fields: model_config builds it again
                "optim": asdict(optim_cfg),
                "stability": asdict(stability_cfg),
                "document_mask": document_mask,
                "eos_id": eos_id,
                "init_seed": init_seed,
            }
        )
        self.optim = optim_cfg
        self._optimizer = optimizer or functools.partial(
            torch.optim.AdamW,
            lr=optim_cfg.lr,
            betas=(optim_cfg.betas[0], optim_cfg.betas[1]),
            eps=optim_cfg.eps,
            fused=True,  # one kernel per group, and it skips a non-finite step on the device (training.nonfinite)
        )
        # A model whose every value is about to be read from a file is built without memory, on any strategy.
        self._init_from = None if weights_from_checkpoint else init_from
        with torch.device("meta") if init_on_meta or self._init_from else contextlib.nullcontext():
            self.model = build_model(model_cfg, init_seed)
        self.val_losses = nn.ModuleList([MeanMetric()])  # one per validation loader: per corpus of a mixture (setup)
        self._loss_sum: float | torch.Tensor = 0.0  # micro-batch losses since the last optimizer step
        self._loss_count = 0
        self._guard = NonFiniteGuard(optim_cfg.max_skipped_steps)  # updates withheld for a non-finite gradient norm
        self.stability = stability_cfg
        self._spikes = SpikeDetector(stability_cfg, rollbacks, lr_warmup_steps=optim_cfg.warmup_steps)
        self._step_loss: torch.Tensor | None = None  # this rank's mean loss of the step being taken
        self._checkpoint_steps: set[int] = set()  # of the checkpoints this fit loaded or wrote (a rollback's choice)
        self._parallelized = False
        self._weights_from_checkpoint = weights_from_checkpoint
        self._tokenizer_file: dict[str, Any] | None = None  # the training tokenizer, for checkpoints (setup)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path | IO, *args: Any, **kwargs: Any) -> "LlamaLitModule":
        """Lightning's `load_from_checkpoint`, for every checkpoint the platform writes: a single file,
        or a sharded folder (fsdp, fsdp2, tp, tp_fsdp, pipeline), read whole on this one process.
        `.model` of the result is the plain `Llama`."""
        if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_dir():
            # Lightning reads files only: hand it the folder's consolidated checkpoint as one, in memory.
            buffer = io.BytesIO()
            torch.save(read_whole(checkpoint_path), buffer)
            buffer.seek(0)
            checkpoint_path = buffer
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def attached_trainer(self) -> Trainer | None:
        """The Trainer fitting this module, or None where there is none (load_from_checkpoint, a test)."""
        try:
            return self.trainer
        except RuntimeError:  # Lightning's word for "not attached to a Trainer"
            return None

    def strategy(self) -> LlamaStrategy:
        """The run's strategy, as the contract (project.parallel.contract) speaks of it; with no trainer (as
        load_from_checkpoint builds the module), or one of Lightning's own strategies, the contract's defaults."""
        trainer = self.attached_trainer()
        return contract_of(trainer.strategy if trainer is not None else None)

    def configure_model(self) -> None:
        # Strategies that split the model itself (tensor parallel, FSDP2) do so here, on their mesh.
        # load_from_checkpoint calls this too, with no trainer: the plain model is what it wants.
        if self._parallelized:
            return
        self.strategy().parallelize(self.model, initialize=not (self._weights_from_checkpoint or self._init_from))
        if self._init_from:
            if any(p.is_meta for p in self.model.parameters()):  # a strategy that wraps or moves the whole model later
                self.model.to_empty(device="cpu")
            load_published_weights(self.model, self._init_from)
        self._parallelized = True

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        refuse_older_format(checkpoint, "the checkpoint")  # load_from_checkpoint too
        self._guard = NonFiniteGuard(self.optim.max_skipped_steps, checkpoint.get("skipped_steps", 0))
        self._spikes.load_state_dict(checkpoint.get("stability", {}))
        self._checkpoint_steps.add(int(checkpoint.get("global_step", 0)))
        if (trainer := self.attached_trainer()) is not None:  # resuming a fit, not load_from_checkpoint
            rebase_batch_progress(checkpoint, trainer.accumulate_grad_batches)

    def _training_data(self) -> TokenShardDataModule | None:
        """The TokenShardDataModule this module trains on, where it is one (it knows the tokenizer)."""
        trainer = self.attached_trainer()
        datamodule = trainer.datamodule if trainer is not None else None  # type: ignore[attr-defined]
        return datamodule if isinstance(datamodule, TokenShardDataModule) else None

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's inputs besides the tokens: the documents, with document masking."""
        return {"document_ids": document_ids(inputs, self.hparams.eos_id)} if self.hparams.document_mask else {}

    def criterion(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the output head's logits of `hidden` [B, T, dim] (the final norm's
        output: a pipeline's last stage) against targets [B, T], computed without whole logits (Llama.head_loss)."""
        return _plain(self.model.head_loss(hidden, targets))

    @torch.no_grad()
    def target_scores(
        self, inputs: torch.Tensor, targets: torch.Tensor, model_kwargs: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Each row's sum of its targets' log-probabilities, its targets and those ranked first ([B, 3]), the model
        run whole as for `loss`."""
        kwargs = self.model_kwargs(inputs) if model_kwargs is None else model_kwargs
        return target_scores(_plain(self.model(inputs, targets=targets, score_targets=True, **kwargs)), targets)

    @torch.no_grad()
    def head_scores(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`target_scores` of the final hidden states (a pipeline's last stage), as `criterion` takes them."""
        return target_scores(_plain(self.model.head_log_probs(hidden, targets)), targets)

    def loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, model_kwargs: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The batch's mean loss, as the strategy's `step_loss` computes it unless it runs the model itself
        (a pipeline: model and criterion split over stages). `model_kwargs`: the model's other inputs where the
        strategy computed them (context parallelism: those of the whole sequences), else from `inputs`."""
        kwargs = self.model_kwargs(inputs) if model_kwargs is None else model_kwargs
        loss = _plain(self.model(inputs, targets=targets, **kwargs))
        return loss if self.model.hooks is None else self.model.hooks.with_auxiliary_losses(loss)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.strategy().step_loss(self, *batch, train=True)
        self._loss_sum = self._loss_sum + loss.detach()
        self._loss_count += 1
        return loss

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        # Lightning zeroes the gradients between the training step and its backward. A strategy whose step
        # computed them (a pipeline schedule) zeroed them before it instead.
        if not self.strategy().gradients_in_step:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def _logs_now(self) -> bool:
        """Whether this optimizer step's metrics reach the loggers (callbacks.steps.logs_at): only then are its
        values read off the device."""
        trainer = self.attached_trainer()
        return trainer is None or logs_at(trainer, trainer.global_step)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Every micro batch holds the same number of tokens, so the mean of micro-batch means over
        # accumulation steps and ranks is the mean over the whole global batch.
        if self._logs_now():
            # Not prog_bar: Lightning would read it off the device after every batch (StepProgressBar shows it).
            self.log("train/loss", self._loss_sum / self._loss_count, sync_dist=True)
            self.log("train/lr", optimizer.param_groups[0]["lr"])
        self._step_loss = torch.as_tensor(self._loss_sum / self._loss_count)
        self._loss_sum, self._loss_count = 0.0, 0

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        # Lightning calls this every step after gradients are reduced (and unscaled), clipping or not.
        # Sharding strategies know how to take the norm over all shards; whole gradients need no help.
        trainer = self.attached_trainer()
        # 16-mixed's GradScaler, which sets the optimizer's flag itself (none under other precisions).
        scaler = getattr(trainer.precision_plugin, "scaler", None) if trainer is not None else None
        if scaler is not None and all(group.get("fused") for group in optimizer.param_groups):
            # Lightning leaves a fused optimizer's gradients scaled (its step would unscale them); the norm and the
            # clipping need them as they are, so unscale them here, as torch's GradScaler documents for clipping.
            scaler.unscale_(optimizer)
        norm = self.strategy().clip_grad_norm(self, self.optim.grad_clip or float("inf"))
        step = trainer.global_step if trainer is not None else 0
        # The same global norm and mean loss on every rank: they all decide alike, on the device
        # (project.training.nonfinite, project.training.stability).
        spike = self._spikes.observe(self._global_loss(), norm, step)
        on_device = takes_the_flag_on_the_device(optimizer, scaled=scaler is not None)
        # A spike's update is withheld on the device under rollback too, until the host reads the flag and rolls back.
        withhold = spike if self.stability.action in ("skip", "rollback") else None
        withheld = self._guard.before_update(norm, optimizer, step, on_device, withhold)
        # What the model gathered over the step (a mixture of experts' loads: its routing biases move on them, unless
        # the step's update is withheld).
        if self.model.hooks is not None:
            sums = self.strategy().sum_over_ranks
            if statistics := self.model.hooks.step_statistics(sums, report=self._logs_now(), applied=~withheld):
                self.log_dict(statistics)
        if self._logs_now():
            self._read_on_the_host()  # the step's values are read now anyway: roll back, warn of skipped steps, or stop
            self.log("train/grad_norm", norm)
            self.log_dict(self._spikes.metrics())
            if self.stability.action == "rollback":
                self.log("stability/rollbacks", float(len(self._spikes.rollbacks)))
            if self.optim.max_skipped_steps:
                self.log("train/skipped_steps", float(self._guard.skipped))

    def _global_loss(self) -> torch.Tensor:
        """The step's loss averaged over every rank (each holds its replica's, or its part's, mean over equally
        many tokens): the global batch's mean, as train/loss logs it."""
        loss = self._step_loss if self._step_loss is not None else torch.zeros(())
        return self.strategy().mean_over_ranks(loss.detach().float().clone())

    def _read_on_the_host(self) -> None:
        """Where the host waits for the device anyway (a logging step, before a checkpoint is written or a validation
        runs, when training ends): under rollback, a spike found since the last read restarts the run (`_roll_back`);
        otherwise warn of skipped steps or stop (the non-finite guard), and record the spikes."""
        events = self._spikes.read_events()
        if self.stability.action == "rollback":
            spike = next((event for event in events if event["acted"]), None)
            if spike is not None:
                self._roll_back(spike)
        self._guard.check()
        self._spikes.report(self.stability.action, events)

    def _roll_back(self, event: dict[str, float]) -> None:
        """Every rank alike: the spike recorded, the run asked to restart from its last checkpoint (or stopped past
        stability.max_rollbacks). Raised where the host first reads the spike: at the step's own logging, or up to
        trainer.log_every_n_steps - 1 steps later, and always before a checkpoint is written. Its update was withheld
        on the device; the steps after it are dropped with those since the checkpoint, which no save can have replaced
        since the spike (each save reads first), so the restart is the one an immediate read would have made."""
        event = dict(event)
        for kept_on_the_device_only in ("shift", "acted"):
            event.pop(kept_on_the_device_only)
        data, trainer = self._training_data(), self.attached_trainer()
        position, batch = (data.samples_consumed, data.hparams.global_batch_size) if data is not None else (0, 0)
        if trainer is not None:  # the data position of the spike's step: the sequences read before it
            position -= (trainer.global_step - int(event["step"])) * batch
        raise RollbackRequested(event, position, batch, self._checkpoint_steps, self._spikes)

    def on_train_start(self) -> None:
        self._cool_down_from_the_start()
        # A checkpoint of a run trained with ~module.optimizer.fused restores its groups as they were (fused=None):
        # fuse them again, their step counts on the parameters' device as fused AdamW keeps them, so the guard stays
        # on it.
        if not getattr(self._optimizer, "keywords", {}).get("fused"):
            return
        trainer = self.attached_trainer()
        for optimizer in trainer.optimizers if trainer is not None else []:
            for group in optimizer.param_groups:
                if group.get("fused") is None and "fused" in group:
                    group["fused"] = True
                    for p in group["params"]:
                        state = optimizer.state.get(p, {})
                        if "step" in state:
                            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    def on_train_end(self) -> None:
        self._read_on_the_host()  # a step past the budget, or a spike, since the last logging step acts now

    def on_validation_start(self) -> None:
        if self.stability.action == "rollback":  # a validation waits anyway: none of a trajectory a rollback drops
            self._read_on_the_host()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # Never a checkpoint of a run that should have stopped or rolled back: it does so here, before writing.
        self._read_on_the_host()
        checkpoint["skipped_steps"] = self._guard.skipped
        if (trainer := self.attached_trainer()) is not None:  # what a resume compares its schedule with
            checkpoint["schedule"] = schedule_record(self.optim, trainer.max_steps)
        checkpoint["stability"] = self._spikes.state_dict()
        self._checkpoint_steps.add(int(checkpoint.get("global_step", 0)))
        if (data := self._training_data()) is not None:  # what the embedding rows mean, checked on resume
            checkpoint["tokenizer"] = data.tokenizer_identity
            if (record := self._tokenizer_record(data)) is not None:  # the tokenizer itself: export and generate's
                checkpoint[CHECKPOINT_TOKENIZER] = record

    def _tokenizer_record(self, data: TokenShardDataModule) -> dict[str, Any] | None:
        """The training tokenizer's file as checkpoints carry it (project.data.tokenizer.tokenizer_record), read once,
        at setup: shards prepared into data.dir again while this run trains do not change what its checkpoints say."""
        if self._tokenizer_file is None and data.tokenizer is not None:
            self._tokenizer_file = tokenizer_record(data.tokenizer)
        return self._tokenizer_file

    def _validation_corpora(self) -> list[tuple[str, float]]:
        """(name, weight) per validation loader: the corpora of a mixture, else one unnamed."""
        data = self._training_data()
        return data.validation_corpora if data is not None else [("", 1.0)]

    def setup(self, stage: str) -> None:
        while len(self.val_losses) < len(self._validation_corpora()):
            self.val_losses.append(MeanMetric())
        if (data := self._training_data()) is not None:  # the tokenizer the run starts with, as its checkpoints say
            data.tokenizer_identity  # noqa: B018  # a cached property, computed now
            self._tokenizer_record(data)
        trainer = self.attached_trainer()
        if trainer is not None and trainer.is_global_zero:  # the record of spikes, beside metrics.csv
            self._spikes.record_dir = Path(trainer.default_root_dir)

    def validation_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        inputs, targets = batch
        # The loss is the mean over every row's tokens, a padding row's (IGNORED targets) counting for nothing: its
        # real rows' mean is that times rows / real rows, and it weighs as its real rows. A tensor: nothing waits.
        real = (targets[:, 0] != IGNORED).sum()
        loss = self.strategy().step_loss(self, inputs, targets, train=False) * inputs.shape[0] / real
        metric: MeanMetric = self.val_losses[dataloader_idx]  # type: ignore[assignment]  # ModuleList indexes as Module
        metric.update(loss, weight=real)

    def on_validation_epoch_end(self) -> None:
        corpora = self._validation_corpora()
        metrics = cast(list[MeanMetric], list(self.val_losses))
        losses = [metric.compute() for metric in metrics[: len(corpora)]]  # sequence-weighted means, synced over ranks
        for metric in metrics:
            metric.reset()
        if len(corpora) > 1:
            for (name, _), corpus_loss in zip(corpora, losses):
                self.log(f"val/loss/{name}", corpus_loss, sync_dist=True)
        # A mixture's loss is its corpora's losses weighted as training draws them: comparable with train/loss.
        loss = torch.stack([weight * corpus_loss for (_, weight), corpus_loss in zip(corpora, losses)]).sum()
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)  # equal on every rank: the mean of equal values
        self.log("val/ppl", torch.exp(loss), sync_dist=True)

    def lr_of_step(self, step: int) -> float:
        """The learning rate of optimizer step `step`: the schedule's (lr_at), scaled during a rollback's cooldown
        (project.training.stability)."""
        total = self.optim.decay_steps or self.trainer.max_steps
        return lr_at(step, self.optim, total) * self._spikes.lr_scale(step)

    def _cool_down_from_the_start(self) -> None:
        """A run restarted after a spike resumes its optimizer's rates as the checkpoint saved them, unscaled; the
        scheduler sets the next step's only after this one: the cooldown's first step is set here."""
        trainer = self.attached_trainer()
        if not self._spikes.rollbacks or trainer is None or self._spikes.lr_scale(trainer.global_step) == 1.0:
            return
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = self.lr_of_step(trainer.global_step)

    def decay_groups(self) -> list[tuple[float, list[tuple[str, nn.Parameter]]]]:
        """(weight decay, [(name, parameter)]) per AdamW group: those the family's tensors say decay (weight
        matrices, the embedding), then the others (norm gains). Chosen by name, as the family's spec says, not
        by p.ndim. Names are relative to this module, as in checkpoints."""
        decays = self._decays()
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        return [
            (self.optim.weight_decay, [(f"model.{n}", p) for n, p in named if decays[own_name(n)]]),
            (0.0, [(f"model.{n}", p) for n, p in named if not decays[own_name(n)]]),
        ]

    def _decays(self) -> dict[str, bool]:
        return {t.name: t.decay for t in model_config(self.hparams.model).tensors()}

    def optimizer_order(self) -> list[str]:
        """The whole model's parameter names as torch.optim numbers them (group after group of `decay_groups`),
        whatever part of it this rank holds: from the model built again on the meta device (no memory). A tied
        output matrix is the embedding, named once."""
        with torch.device("meta"):
            names = [name for name, _ in build_model(self.hparams.model).named_parameters()]
        decays = self._decays()
        return [f"model.{n}" for n in names if decays[n]] + [f"model.{n}" for n in names if not decays[n]]

    def configure_optimizers(self):
        groups = [{"params": [p for _, p in group], "weight_decay": decay} for decay, group in self.decay_groups()]
        try:
            optimizer = self._optimizer(groups)
        except TypeError as error:
            if "fused" not in str(error):
                raise
            raise ConfigError(
                f"module.optimizer takes no `fused` argument ({error}): an optimizer other than torch's AdamW needs "
                "~module.optimizer.fused on the command line (its non-finite guard then reads the norm every step)."
            ) from None
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.lr_of_step(step) / self.optim.lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

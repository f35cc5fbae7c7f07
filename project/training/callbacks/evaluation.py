"""Evaluation inside training (conf/eval): every `eval.every_n_steps` optimizer steps (0: none before the last), and
after the last, the loss
of each held-out set (`eval.sets`, project.data.heldout) on the model as it trains, logged as `eval/<name>/loss` and
`eval/<name>/bits_per_byte`, each downstream task's metrics (`eval.tasks`, project.data.tasks) as
`eval/<task>/<metric>`, with `eval/seconds` (the whole evaluation's wall time).

The model is evaluated as it is sharded, by the strategy's own forward (`step_loss` without training, as validation
runs it): the data-parallel replicas split each set's sequences, the ranks of a replica (tensor, context, pipeline)
read the same ones, and the sums of every rank make the figures, so they are the same in every layout. A task's
requests are scored one row each (`step_scores`: the sum of the continuation's log-probabilities, and whether the
model would have written it), each row by the ranks of one replica. Bits per byte divide the summed loss (nats) by
ln 2 and by the bytes of text the predicted tokens stand for (the tokenizer's `token_bytes`), so that models with
other tokenizers compare.

What training goes on with is untouched: the sets are read in the main process (no random draw for workers), under
no_grad (nothing is counted by the model's statistics or the numerics monitor), between two steps (not in the step's
time). An evaluation a stop interrupts is run again when the run resumes at that step (`evaluated_step`, kept in the
checkpoint).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from project.data.tasks import Task
from project.model.loss import IGNORED
from project.parallel.contract import LlamaStrategy, TrainingModule, contract_of
from project.training.callbacks.steps import OptimizerSteps


class HeldOutEvaluation(Callback):
    def __init__(self, every_n_steps: int = 0):
        self.every_n_steps = every_n_steps
        self.evaluated_step = -1  # the optimizer step after which the last evaluation ended
        self.last_metrics: dict[str, float] = {}  # its figures, for the run's closing line
        self._steps = OptimizerSteps()

    def _due(self, step: int) -> bool:
        return self.every_n_steps > 0 and step > 0 and step % self.every_n_steps == 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.start(trainer)
        if self._due(trainer.global_step) and self.evaluated_step != trainer.global_step:
            self.evaluate(trainer, pl_module)  # the one a stop interrupted before this checkpoint's run ended

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._steps.just_ended(trainer) and self._due(trainer.global_step):
            self.evaluate(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        finished = trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps  # not stopped by a signal
        if finished and self.evaluated_step != trainer.global_step:  # with every_n_steps=0 too: sets or tasks given
            # are scored at least once
            self.evaluate(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"evaluated_step": self.evaluated_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.evaluated_step = int(state_dict.get("evaluated_step", -1))

    @torch.no_grad()
    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """Every held-out set's figures on the model as it is now, logged in the row of the step just ended."""
        data: Any = trainer.datamodule  # type: ignore[attr-defined]  # set by Trainer.fit, untyped
        loaders, tasks = data.eval_loaders(), data.task_batches()
        if not loaders and not tasks:
            return {}
        start = time.perf_counter()
        contract = contract_of(trainer.strategy)
        token_bytes = data.token_bytes
        byte_table = torch.tensor(token_bytes, device=pl_module.device) if token_bytes is not None else None
        was_training = pl_module.training
        pl_module.eval()

        def evaluation() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            sums = [self._sums(contract, pl_module, loader, byte_table) for loader in loaders.values()]
            return sums, [self._scores(contract, pl_module, task, batches) for task, batches in tasks]

        sums, scores = contract.between_steps(cast(TrainingModule, pl_module), evaluation)
        pl_module.train(was_training)
        metrics: dict[str, float] = {}
        if sums:  # every rank of a replica holds the same sums: over every rank, numerator and denominator alike
            summed = contract.sum_over_ranks(torch.stack(sums)).tolist()
            for name, (nats, tokens, text_bytes) in zip(loaders, summed):
                metrics[f"eval/{name}/loss"] = nats / tokens
                if byte_table is not None and text_bytes > 0:
                    metrics[f"eval/{name}/bits_per_byte"] = nats / math.log(2) / text_bytes
        for (task, _), rows in zip(tasks, scores):
            # Each request's row was filled by every rank of one replica, which the last column counts.
            whole = contract.sum_over_ranks(rows)
            task_scores = task.scores((whole[:, :3] / whole[:, 3:]).tolist())
            metrics.update({f"eval/{task.name}/{metric}": value for metric, value in task_scores.items()})
        metrics["eval/seconds"] = time.perf_counter() - start
        if trainer.is_global_zero:  # at once, in the step's own row: the step need not be a logging step
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step - 1)
        self.evaluated_step = trainer.global_step
        self.last_metrics = metrics
        return metrics

    @staticmethod
    def _scores(
        contract: LlamaStrategy,
        pl_module: LightningModule,
        task: Task,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """[requests, 4] of one task on this rank: its rows' scores (log-likelihood, targets, targets ranked first)
        where they are this replica's, and 1 in the last column there."""
        rows = torch.zeros(len(task.requests), 4, device=pl_module.device, dtype=torch.float64)
        for indices, inputs, targets in batches:
            module = cast(TrainingModule, pl_module)
            scores = contract.step_scores(module, inputs.to(pl_module.device), targets.to(pl_module.device))
            own = indices >= 0
            rows[indices[own], :3] = scores[own.to(scores.device)].to(rows.dtype)
            rows[indices[own], 3] = 1
        return rows

    @staticmethod
    def _sums(contract: Any, pl_module: LightningModule, loader: Any, byte_table: torch.Tensor | None) -> torch.Tensor:
        """[nats, tokens, bytes] of one set's batches on this rank."""
        total = torch.zeros(3, device=pl_module.device, dtype=torch.float64)
        for inputs, targets in loader:
            inputs, targets = inputs.to(pl_module.device), targets.to(pl_module.device)
            real = targets != IGNORED
            # The mean over every row's tokens, a padding row's counting for nothing (as validation_step): the real
            # rows' mean is that times rows / real rows.
            loss = contract.step_loss(pl_module, inputs, targets, train=False).double()
            tokens = real.sum()
            total[0] += loss * inputs.shape[0] / real[:, 0].sum() * tokens
            total[1] += tokens
            if byte_table is not None:
                total[2] += byte_table[targets[real]].sum()
        return total

"""The run's layout, logged as metrics once training starts: reports and sweeps compare runs by it."""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer


class LayoutFacts(Callback):
    """Writes `facts` (project.config.layout.Layout.facts: world size, degrees, micro batch, accumulation)
    to every logger at the step training starts from: a column each in metrics.csv, a series in wandb."""

    def __init__(self, facts: dict[str, int]):
        self.facts = facts

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({name: float(value) for name, value in self.facts.items()}, step=trainer.global_step)

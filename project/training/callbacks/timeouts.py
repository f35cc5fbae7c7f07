"""Two collective timeouts: a long one while a run starts, a short one once it trains."""

from __future__ import annotations

from datetime import timedelta

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from project.parallel.groups import set_timeouts
from project.parallel.strategies.timeout import collective_timeout, startup_timeout
from project.training.callbacks.steps import OptimizerSteps


class CollectiveTimeouts(Callback):
    """Until the end of a fit's first optimizer step, a collective may wait `startup_minutes`
    (`strategy.startup_timeout_minutes`): the ranks meet, load a checkpoint, compile and read their first batch at
    different speeds, and on a large job the slowest can take many minutes. From then on `steady_minutes`
    (`strategy.collective_timeout_minutes`): a rank that stops answering mid-run ends the job within that time
    instead of holding the nodes for the start-up's bound. Every group of the run takes it (project.parallel.groups:
    the default group, the meshes', the side groups); the strategies make the groups with the start-up timeout
    (project.parallel.strategies.timeout). A rollback's new fit starts again under the start-up timeout.

    Added to every run by project.training.trainer (the start-up bound would otherwise stay for good). Nothing to do
    without a torch.distributed process group (one device, Horovod: its own stall timeout), nor where
    collective_timeout_minutes is null (torch's default throughout)."""

    def __init__(self, startup_minutes: float | None = None, steady_minutes: float | None = None):
        self.steady = collective_timeout(steady_minutes)
        self.startup = startup_timeout(startup_minutes, steady_minutes)  # what the strategies made the groups with
        self._steps = OptimizerSteps()
        self._steady_now = False

    def _set(self, timeout: timedelta | None) -> None:
        if timeout is None:
            return
        refused = set(set_timeouts(timeout))
        if refused:
            rank_zero_warn(
                f"the process groups of backend {', '.join(sorted(refused))} cannot change their timeout: they keep "
                "the one they were made with (strategy.startup_timeout_minutes) for the whole run"
            )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._steady_now = False
        self._set(self.startup)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.start(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if not self._steady_now and self._steps.just_ended(trainer):
            self._set(self.steady)
            self._steady_now = True

"""The run's layout, logged as metrics once training starts: reports and sweeps compare runs by it."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

# Each start's layout name, one JSON object a line ({"step": N, "layout": NAME}), in the run directory: a run
# resumed under another layout is reported under every layout it ran in (tools.report), and the
# strategy is a name, which metrics cannot hold.
LAYOUTS_FILE = "layouts.jsonl"


class LayoutFacts(Callback):
    """Writes `facts` (project.config.layout.Layout.facts: world size, degrees, micro batch, accumulation)
    to every logger at the step training starts from: a column each in metrics.csv, a series in wandb; and the
    layout's `name` (Layout.name) to the run directory's layouts.jsonl."""

    def __init__(self, facts: dict[str, int], name: str | None = None):
        self.facts = facts
        self.name = name

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({name: float(value) for name, value in self.facts.items()}, step=trainer.global_step)
            if self.name is not None:
                with open(Path(trainer.default_root_dir) / LAYOUTS_FILE, "a") as file:
                    file.write(json.dumps({"step": trainer.global_step, "layout": self.name}) + "\n")

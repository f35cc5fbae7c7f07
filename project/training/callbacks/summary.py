"""The model summary printed when training starts."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch.distributed.tensor import DTensor

from project.model.families import family_of, model_config
from project.model.flops import count_parameters, training_flops_per_token


class LlamaModelSummary(ModelSummary):
    """The whole model's size and training cost, and this rank's share of the parameters.

    Lightning's summary counts the parameters this rank holds, a fraction of the model under sharding
    and pipeline or tensor parallelism, and prints "FLOPs 0" unless the module has an example input,
    whose forward pass at that point would run collectives on rank 0 alone. Here the size and FLOPs
    come from the config (project.model.flops), the share from the parameters on rank 0.

    `max_depth` 0 prints nothing, 1 (the default) this summary alone, more adds Lightning's table of the modules to
    that depth (callbacks=layer_summary), which counts what each rank holds.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.max_depth and trainer.is_global_zero:
            self.say(trainer, pl_module)
        if self.max_depth > 1:  # the table is gathered on every rank, printed by the first
            super().on_fit_start(trainer, pl_module)

    @staticmethod
    def say(trainer: Trainer, pl_module: LightningModule) -> None:
        config = model_config(pl_module.hparams["model"])
        data: Any = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector, undeclared
        seq_len = data.hparams.seq_len
        tokens_per_step = data.hparams.global_batch_size * seq_len
        flops_per_token = training_flops_per_token(config, seq_len)
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in pl_module.parameters())
        total, active = count_parameters(config), count_parameters(config, active=True)
        of_them = "" if active == total else f", {get_human_readable_count(active)} of them active per token"
        share = "" if held == total else f" (rank 0 holds {get_human_readable_count(held)})"
        rank_zero_info(
            f"model: {family_of(config).label}, {get_human_readable_count(total)} parameters{of_them}{share}, "
            f"{config.n_layers} layers of width "
            f"{config.dim}; {get_human_readable_count(int(flops_per_token))} training FLOPs per token, "
            f"{get_human_readable_count(int(flops_per_token * tokens_per_step))} per optimizer step of "
            f"{tokens_per_step} tokens"
        )

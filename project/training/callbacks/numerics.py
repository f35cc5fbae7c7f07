"""Per-layer numerics every `stability.numerics_every_n_steps` steps: for the embedding, each transformer block and
the head (final norm and output layer), the gradient norm, the parameter norm, the update-to-parameter ratio of the
step and the RMS of the layer's output activation (the head's: the final norm's output, its input), logged as
`numerics/<layer>/<stat>` (e.g. `numerics/block3/update_ratio`) and drawn by `project.report` as heat maps. A layer
that stacks parts along dim 0 (a mixture's experts: the model's `stacked_parameters`) also gets each part's gradient
norm, parameter norm and update ratio, `numerics/<layer>/expert<e>/<stat>`.

Every figure is over the whole model, whatever the layout: the norms sum the squares of every shard and stage
(the strategy's `sum_of_squares`, as its clipping sums them), the RMS every rank's activations (each rank's sum of
squares and count, summed: replicated copies weigh equally on both). A numerics step costs a copy of this rank's
parameters (for the update), a few collectives, and a wait for the device (its figures are written at once, in the
step's own row, as a logging step's are); other steps cost nothing.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.tensor import DTensor

from project.model.llama import Llama
from project.parallel.contract import contract_of
from project.training.callbacks.steps import OptimizerSteps


def layers_of(model: Any) -> dict[str, list[Any]]:
    """{layer name: [modules]} of a Llama, whole or pruned to pipeline stages (absent modules are None or gone):
    `embedding`, `block0` .. `block<n-1>`, `head`. The first module of each is the one whose output is watched."""
    held = model.layers
    blocks = {f"block{i}": [held[str(i)]] if str(i) in held else [] for i in range(model.config.n_layers)}
    head = [m for m in (model.norm, model.output) if m is not None]
    return {"embedding": [model.tok_embeddings] if model.tok_embeddings is not None else [], **blocks, "head": head}


def parameters_of(layers: dict[str, list[Any]]) -> dict[str, list[torch.nn.Parameter]]:
    """Each layer's parameters, each once (a tied output weight counts as the embedding's)."""
    seen: set[int] = set()
    out: dict[str, list[torch.nn.Parameter]] = {}
    for name, modules in layers.items():
        params = [p for m in modules for p in m.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        out[name] = params
    return out


def _model(pl_module: LightningModule) -> Llama:
    return cast(Llama, pl_module.model)


def _stacked(pl_module: LightningModule) -> dict[str, tuple[int, list[torch.nn.Parameter]]]:
    """The model's parameters that stack parts along dim 0 (FamilyHooks.stacked_parameters); none where its family
    has none."""
    hooks = _model(pl_module).hooks
    return {} if hooks is None else hooks.stacked_parameters()


class NumericsMonitor(Callback):
    def __init__(self, every_n_steps: int = 0):
        self.every_n_steps = every_n_steps
        self._steps = OptimizerSteps()
        self._hooks: list[Any] = []
        self._squares: dict[str, torch.Tensor] = {}  # per layer: the sum of its outputs' squares on this rank
        self._counts: dict[str, int] = {}  # and how many values they held
        self._before: dict[int, torch.Tensor] | None = None  # this rank's parameters before the update, by id
        self._figures: dict[str, torch.Tensor] = {}
        self._part_figures: dict[str, dict[str, torch.Tensor]] = {}  # per stacked layer: {stat: [parts]}
        self._warned = False

    def _due(self, step: int) -> bool:
        return self.every_n_steps > 0 and (step + 1) % self.every_n_steps == 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._steps.start(trainer)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._hooks or not self._due(trainer.global_step):
            return
        layers = layers_of(pl_module.model)
        device = pl_module.device
        self._squares = {name: torch.zeros((), device=device, dtype=torch.float64) for name in layers}
        self._counts = dict.fromkeys(layers, 0)
        for name, modules in layers.items():
            if modules:
                self._hooks.append(modules[0].register_forward_hook(self._watch(name)))

    def _watch(self, name: str):
        def hook(module: Any, args: Any, output: torch.Tensor) -> None:
            if not torch.is_grad_enabled():  # a forward that trains nothing (a pipeline's probe of its shapes)
                return
            local = (output.to_local() if isinstance(output, DTensor) else output).detach()
            # Under activation checkpointing the backward runs the forward again: the same values twice, the same RMS.
            self._squares[name] += local.double().square().sum()
            self._counts[name] += local.numel()

        return hook

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if not self._hooks:
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        params = parameters_of(layers_of(pl_module.model))
        sums = contract_of(trainer.strategy).sum_of_squares
        device = pl_module.device
        grads = sums([[p.grad for p in ps if p.grad is not None] for ps in params.values()], device)
        norms = sums([list(ps) for ps in params.values()], device)
        counts = torch.tensor(list(self._counts.values()), dtype=torch.float64).to(device)
        squares = torch.stack([torch.stack(list(self._squares.values())), counts])
        activations = contract_of(trainer.strategy).sum_over_ranks(squares)
        self._figures = {"grad_norm": grads.sqrt(), "param_norm": norms.sqrt()}
        self._figures["output_rms"] = (activations[0] / activations[1].clamp(min=1)).sqrt().float()
        self._part_figures = self._parts(trainer, pl_module)
        self._before = {id(p): p.detach().clone() for ps in params.values() for p in ps}

    def _parts(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, dict[str, torch.Tensor]]:
        """Each stacked layer's per-part gradient and parameter norms, where the strategy can tell its rows apart."""
        rows = contract_of(trainer.strategy).row_sums_of_squares
        figures = {}
        for name, (parts, params) in _stacked(pl_module).items():
            grads = rows([p.grad for p in params if p.grad is not None], parts, pl_module.device)
            norms = rows(params, parts, pl_module.device)
            if grads is None or norms is None:
                if not self._warned:
                    rank_zero_warn(
                        f"stability.numerics_every_n_steps: no figures per expert under strategy "
                        f"{type(trainer.strategy).__name__}: its ranks hold flat pieces of the stacked experts."
                    )
                self._warned = True
                return {}
            figures[name] = {"grad_norm": grads.sqrt(), "param_norm": norms.sqrt()}
        return figures

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._steps.just_ended(trainer) or self._before is None:
            return
        params = parameters_of(layers_of(pl_module.model))
        before = self._before
        updates = [[p.detach() - before[id(p)] for p in ps] for ps in params.values()]
        self._before = None
        contract = contract_of(trainer.strategy)
        tiny = torch.finfo(torch.float32).tiny
        moved = contract.sum_of_squares(updates, pl_module.device).sqrt()
        self._figures["update_ratio"] = moved / self._figures["param_norm"].clamp(min=tiny)
        names = list(params)
        metrics = {
            f"numerics/{name}/{stat}": float(value)
            for stat, values in self._figures.items()
            for name, value in zip(names, values.tolist())
        }
        for name, (parts, stacked) in _stacked(pl_module).items():
            figures = self._part_figures.get(name)
            if figures is None:
                continue
            steps = [p.detach() - before[id(p)] for p in stacked]
            changed = contract.row_sums_of_squares(steps, parts, pl_module.device)
            assert changed is not None  # the strategy told the rows apart before the update
            figures["update_ratio"] = changed.sqrt() / figures["param_norm"].clamp(min=tiny)
            for stat, values in figures.items():
                metrics.update({f"numerics/{name}/expert{e}/{stat}": float(v) for e, v in enumerate(values.tolist())})
        if trainer.is_global_zero:  # at once, in the step's own row: the step need not be a logging step
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step - 1)

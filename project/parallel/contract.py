"""What a strategy of ours may change in training, all in one place: the contract between the strategies
(project.parallel.*) and the training module and run (project.training.lit_module, project.training.run).

Lightning's own Strategy hooks (setup, backward, optimizer step, checkpoints) stay Lightning's. A Llama run
needs a few more: how the model is built and sharded, the gradient norm over every shard (and sums of squares of
any group of parameters, for per-layer numerics), how many processes share a node, which ranks read the same
batch, the batch plan, the loss of a step when the strategy runs the model itself (the pipeline), and checkpoints
written in the background. Every
strategy of ours inherits `LlamaStrategy` beside its Lightning base and overrides what it does differently; the
module, the run and the callbacks call these methods and never look for others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch
import torch.distributed as dist

from project.runtime.errors import ConfigError

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

    from project.model.llama import Llama
    from project.parallel.batch import BatchPlan


T = TypeVar("T")


class TrainingModule(Protocol):
    """The module's side of the contract: what a strategy may call on the LightningModule it trains
    (project.training.lit_module.LlamaLitModule, which this package must not import)."""

    def loss(
        self, inputs: torch.Tensor, targets: torch.Tensor, model_kwargs: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The batch's mean loss, the model run whole. `model_kwargs`: the model's other inputs where the strategy
        computed them (context parallelism: the whole sequences' documents beside a part of their tokens);
        by default `model_kwargs(inputs)`."""
        ...

    def model_kwargs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's inputs besides the tokens (the documents, with document masking)."""
        ...

    def criterion(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean loss of the final hidden states [B, T, dim] (the final norm's output) against targets, through
        the output head, never holding whole logits (a pipeline's last stage computes it)."""
        ...

    def target_scores(
        self, inputs: torch.Tensor, targets: torch.Tensor, model_kwargs: dict[str, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """[B, 3] float64 without gradients, the model run whole: each row's sum of its targets' log-probabilities,
        its targets, and those of them the model ranks first (project.model.loss.target_scores); `model_kwargs` as
        for `loss`."""
        ...

    def head_scores(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`target_scores` of the final hidden states [B, T, dim], as `criterion` takes them."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def optimizer_order(self) -> list[str]:
        """The whole model's parameter names (`model.<name>`, as checkpoints hold them) in the order the optimizer
        numbers them, whatever part of the model this rank holds: a checkpoint of one device or DDP keys AdamW's
        state by that position (project.checkpoint.reshard)."""
        ...


@dataclass(frozen=True)
class Replica:
    """A parameter's part that other ranks hold an identical copy of: its name, this rank's copy, and the group of
    the ranks that hold the same copy (this one included). Reductions summed in another order on one rank (atomic
    GPU kernels) would make the copies drift apart unseen: project.training.callbacks.ReplicaCheck compares them."""

    name: str
    local: torch.Tensor
    group: dist.ProcessGroup


class LlamaStrategy:
    """The defaults, which suit a strategy that keeps the whole model on each rank (single, ddp, horovod)."""

    #: The module builds the model on the meta device (no memory), and `parallelize` gives it memory.
    model_on_meta: ClassVar[bool] = False
    #: `step_loss` computes the gradients too (a pipeline schedule runs every backward inside the step), so
    #: the module must not let Lightning zero them between the step and its backward.
    gradients_in_step: ClassVar[bool] = False

    def parallelize(self, model: Llama, initialize: bool = True) -> None:
        """Shard or transform `model` in place before the optimizer is built (LightningModule.configure_model).
        With `model_on_meta`, also give it memory and, unless a checkpoint or published weights are about to
        fill it (`initialize=False`), the initial values one device would have."""

    def plan_batches(self, plan: BatchPlan) -> None:
        """The run's batch plan, given before the Trainer is built (the devices are known by then)."""

    def processes_per_node(self, trainer: Trainer) -> int:
        """The processes of this run on this machine, which share its CPU cores."""
        return trainer.num_devices

    def data_parallel_coords(self, trainer: Trainer) -> tuple[int, int]:
        """(rank, size) along data parallelism: the ranks of one model replica must read the same batch."""
        return trainer.global_rank, trainer.world_size

    def clip_grad_norm(self, module: LightningModule, max_norm: float) -> torch.Tensor:
        """The global gradient norm (before clipping) over every shard of `module`, whose gradients are then
        clipped to `max_norm`. Computed on every rank alike, so that every rank skips a bad step alike."""
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)

    def step_loss(
        self, module: TrainingModule, inputs: torch.Tensor, targets: torch.Tensor, train: bool
    ) -> torch.Tensor:
        """The mean loss of a training (`train`) or validation batch, as the module computes it."""
        return module.loss(inputs, targets)

    def step_scores(self, module: TrainingModule, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[B, 3] float64: each row's sum of its targets' log-probabilities, its targets, and those the model ranks
        first (downstream tasks: project.training.callbacks.evaluation), by the strategy's own forward without
        gradients, the same on every rank of a replica. Run inside `loss_context`."""
        return module.target_scores(inputs, targets)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What `step_loss` and `step_scores` must run inside, where Lightning's own steps do not put it. Nothing
        here."""
        return contextlib.nullcontext()

    def between_steps(self, module: TrainingModule, evaluation: Callable[[], T]) -> T:
        """`evaluation()`: forwards of the model without gradients between two training steps, outside Lightning's
        own steps (project.training.callbacks.evaluation), run where `step_loss` and `step_scores` work as in a step:
        here, inside `loss_context`."""
        with self.loss_context():
            return evaluation()

    def blocks_run_alone(self) -> bool:
        """Whether a transformer block's forward runs no collective on this strategy, so that its time is the rank's
        own (straggler detection); collectives inside blocks make every rank wait for the slowest."""
        return True

    def replicas(self, module: LightningModule) -> list[Replica]:
        """Every part of a parameter this rank holds that other ranks hold identical copies of (Replica). Here: the
        whole model on every rank, so every parameter over every rank (none on one process)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return []
        world = dist.group.WORLD
        assert world is not None
        return [Replica(name, p.detach(), world) for name, p in module.named_parameters()]

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over every rank, in place, the same on every rank: one all-reduce on the device, which
        the host does not wait for (Lightning's `Strategy.reduce` puts a barrier before it, which makes the host
        wait for the device on a GPU)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(tensor)
        return tensor

    def mean_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`'s mean over every rank (sum_over_ranks, then divided by their number)."""
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return self.sum_over_ranks(tensor) / ranks

    def sum_of_squares(self, groups: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
        """[len(groups)]: for each group of tensors (parameters, their gradients or updates, as this rank holds
        them; a group may be empty on this rank), the sum of the squares of the whole tensors' elements, over every
        shard and pipeline stage, the same on every rank (per-layer numerics). Here: each rank holds whole tensors,
        the same on every rank."""
        return torch.stack([_local_sum_of_squares(group, device) for group in groups])

    def row_sums_of_squares(
        self, tensors: Sequence[torch.Tensor], rows: int, device: torch.device
    ) -> torch.Tensor | None:
        """[rows]: for each index of dim 0 of `tensors` (a mixture's stacked experts, as this rank holds them; none
        on a rank that holds no part of them), the sum of the squares of its elements in all of them, over every
        shard and pipeline stage, the same on every rank (per-expert numerics); None where the strategy's ranks hold
        pieces that are not rows. Here: whole tensors, the same on every rank."""
        total = torch.zeros(rows, device=device, dtype=torch.float32)
        for t in tensors:
            total += t.detach().float().square().flatten(1).sum(dim=1)
        return total

    # -- checkpoints written in the background (ckpt_async) ----------------------------------------------------

    def save_in_background(self, enabled: bool) -> None:
        """From now on, `save_checkpoint` only copies the state to host memory and a thread writes it (`enabled`),
        or writes it before it returns (the default). A strategy that cannot write in the background refuses."""
        if enabled:
            raise ConfigError(
                f"ckpt_async=true: this strategy ({type(self).__name__}) writes its checkpoints while training waits. "
                "The platform's own write in the background (single, ddp, fsdp, fsdp2, tp, tp_fsdp, pipeline and "
                "horovod); or set ckpt_async=false."
            )

    def checkpoint_written(self) -> Future | None:
        """The write of the last checkpoint saved, while it may be in flight: a future that every rank holds alike
        (done where the rank writes nothing of it); None when saves are written before `save_checkpoint` returns."""
        return None

    def finish_checkpoint_writes(self) -> None:
        """Wait for the write in flight, if any; one that failed on any rank ends the run on every rank, naming it.
        Every rank calls it at the same point (a save, the end of training)."""


def _local_sum_of_squares(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), device=device, dtype=torch.float32)
    for t in tensors:
        total = total + t.detach().float().square().sum()
    return total


# What the module and the run call when the Trainer's strategy is Lightning's own whole-model one (in a test).
LIGHTNING_DEFAULTS = LlamaStrategy()


def contract_of(strategy: Any) -> LlamaStrategy:
    """The contract of the run's strategy: the strategy itself when it is one of ours (or a user's that inherits
    LlamaStrategy), the whole-model defaults for Lightning's own strategies that keep the whole model on every rank
    (single device, DDP). Any other strategy is refused: its ranks might hold shards of the parameters, and the
    defaults would then clip and report one shard's gradient norm as the model's."""
    if isinstance(strategy, LlamaStrategy):
        return strategy
    if strategy is None:  # a module without a trainer (load_from_checkpoint): one process, the whole model
        return LIGHTNING_DEFAULTS
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    if isinstance(strategy, SingleDeviceStrategy | DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy):
        return LIGHTNING_DEFAULTS
    name = f"{type(strategy).__module__}.{type(strategy).__qualname__}"
    raise ConfigError(
        f"strategy._target_={name} is not one of this platform's strategies, and its ranks may hold shards of the "
        "model, which the whole-model defaults would get wrong (the gradient norm and its clipping would see one "
        "shard). Choose one of conf/strategy (strategy=fsdp2, strategy=tp, ...); or, for a strategy of your own, "
        "inherit project.parallel.contract.LlamaStrategy beside its Lightning base and override what it does "
        "differently (its defaults suit a strategy that keeps the whole model on every rank)."
    )

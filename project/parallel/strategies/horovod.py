"""Data parallelism through Horovod, for clusters that launch with horovodrun (or mpirun).

Horovod's launcher starts one process per device, not Lightning:
`horovodrun -np 4 -H node1:2,node2:2 python -m project.train strategy=horovod hydra.run.dir=DIR`.
Lightning 2 dropped its Horovod strategy; this one behaves like our DDP for checkpoints, logging and data
(each process is one data-parallel replica), and reduces gradients with Horovod's DistributedOptimizer:
averaged (default) or summed, once per optimizer step, after the last micro batch of an accumulation.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from torch.distributed import ReduceOp
from torchmetrics import Metric

from project.parallel.contract import LlamaStrategy, Replica
from project.parallel.strategies.loading import WholeModelLoading
from project.parallel.strategies.saving import BackgroundSaving
from project.parallel.strategies.timeout import collective_timeout
from project.runtime.errors import ConfigError

INSTALL = "`make install-horovod` builds it against this torch and installs it (about 3 minutes, once per machine)"


def start_horovod(hierarchical_allreduce: bool = False, collective_timeout_minutes: float | None = None) -> Any:
    """`horovod.torch`, initialized (once per process); a ConfigError saying how to install it where it is missing.

    The settings are Horovod's environment variables, which hvd.init() reads, and only it. A rank that stops
    answering makes Horovod end the job after `collective_timeout_minutes` (its stall shutdown; it would wait
    forever by default), as the timeout does for torch.distributed's strategies; a rank that dies ends it at once.
    """
    try:
        import horovod.torch as hvd
    except ImportError as error:
        raise ConfigError(
            f"strategy=horovod needs Horovod built with PyTorch, and this environment has none ({error}): {INSTALL}."
        ) from error
    if not hvd.is_initialized():
        if hierarchical_allreduce:
            os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
        if collective_timeout_minutes is not None:
            os.environ.setdefault(
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(max(1, round(collective_timeout_minutes * 60)))
            )
        hvd.init()
    return hvd


class HorovodEnvironment(ClusterEnvironment):
    """Ranks as Horovod's launcher gave them: Horovod, not torch.distributed, connects the processes."""

    def __init__(self, hvd: Any) -> None:
        self._hvd = hvd

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT", 0))

    @staticmethod
    def detect() -> bool:
        return "HOROVOD_RANK" in os.environ

    def world_size(self) -> int:
        return self._hvd.size()

    def set_world_size(self, size: int) -> None:
        pass  # the launcher's -np decides

    def global_rank(self) -> int:
        return self._hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._hvd.local_rank()

    def node_rank(self) -> int:
        return self._hvd.cross_rank()


class HorovodStrategy(BackgroundSaving, WholeModelLoading, LlamaStrategy, ParallelStrategy):
    """One process per device; Horovod's DistributedOptimizer reduces the gradients before each step.

    The module's optimizer is wrapped once built; its learning-rate schedule keeps working through the
    parameter groups the two share. Gradients are not scaled with the number of processes, nor the
    learning rate (Horovod's examples do): the global batch is set as such (global_batch_size), as for DDP.
    """

    strategy_name = "horovod"

    def __init__(
        self,
        op: Any,
        compression: Any,
        hierarchical_allreduce: bool = False,
        collective_timeout_minutes: float | None = None,
    ) -> None:
        self.hvd = start_horovod(hierarchical_allreduce, collective_timeout_minutes)
        super().__init__(cluster_environment=HorovodEnvironment(self.hvd))
        self._op, self._compression = op, compression
        self._accumulating = False
        self._built: list[torch.optim.Optimizer] = []
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning keeps the rank on the function
        if hierarchical_allreduce and not self.hvd.nccl_built():
            rank_zero_warn(
                "strategy.hierarchical_allreduce=true has no effect here: Horovod reduces within and then across nodes "
                "only in builds with NCCL (GPU clusters, several nodes); this one reduces every gradient in one "
                "allreduce."
            )

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None  # the accelerator connector sets them
        device = self.parallel_devices[0]  # trainer.devices=1: this process's device
        # The GPU of this process's local rank, among those it sees (all of the node's, or only its own).
        return torch.device("cuda", self.local_rank % torch.cuda.device_count()) if device.type == "cuda" else device

    @property
    def is_distributed(self) -> bool:  # Lightning's cue to reduce what the module logs with sync_dist=True
        return True

    def processes_per_node(self, trainer: Any) -> int:
        return self.hvd.local_size()  # horovodrun started them, not the trainer

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def model_to_device(self) -> None:
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        assert self.model is not None  # connected before the trainer sets up
        self.model.to(self.root_device)

    def setup_environment(self) -> None:
        if self.root_device.type == "cuda" and not self.hvd.cuda_built():
            raise ConfigError(
                "strategy=horovod on GPUs needs a Horovod built with CUDA and NCCL, and this one has neither (a CPU "
                "build): rebuild it where nvcc and NCCL are found, with a CUDA build of torch installed (make "
                "install-horovod)."
            )
        super().setup_environment()

    def setup(self, trainer) -> None:
        super().setup(trainer)
        assert self.model is not None and self.lightning_module is not None  # connected before the trainer sets up
        # Rank 0's weights (fresh, or restored by now) for all: a process seeded or resumed otherwise does not drift
        # apart.
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        # torchmetrics syncs its states over torch.distributed only; the validation loss is a MeanMetric whose
        # ranks may hold shares of different sizes, so it is gathered over Horovod instead.
        for metric in self.lightning_module.modules():
            if isinstance(metric, Metric):
                metric.distributed_available_fn, metric.dist_sync_fn = (lambda: True), self._gather_metric_state

    def _gather_metric_state(self, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        """Each rank's copy of a metric state of the same shape on every rank (MeanMetric's sums), as torchmetrics
        wants."""
        return list(self.hvd.allgather(tensor.unsqueeze(0)).unbind(0))

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)  # called when fitting only
        self._built = self.optimizers  # the module's, which its learning-rate schedule holds
        self.optimizers = [self._distributed(optimizer, trainer.accumulate_grad_batches) for optimizer in self._built]

    def _distributed(self, optimizer: torch.optim.Optimizer, backward_passes: int) -> torch.optim.Optimizer:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        module = self.lightning_module
        assert module is not None  # optimizers are built for a connected module
        distributed = self.hvd.DistributedOptimizer(
            optimizer,
            named_parameters=[(n, p) for n, p in module.named_parameters() if id(p) in owned],
            compression=self._compression,
            op=self._op,
            backward_passes_per_step=backward_passes,
        )
        # Horovod's optimizer is a new one over the same parameter groups: the schedule, which holds the
        # module's, sets the learning rates it steps with. Torch's check that the optimizer steps before its
        # schedule watches the module's, so it is told that it does.
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return distributed

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        for built, distributed in zip(self._built, self.optimizers):
            built.param_groups = distributed.param_groups  # loading made new groups: share them again
            # Rank 0's state for all, as for the weights. Not for an empty state (fresh, or every step so far
            # skipped): Horovod would create one with a step on zero gradients, which moves AdamW's weights (decay).
            if distributed.state:
                self.hvd.broadcast_optimizer_state(distributed, root_rank=0)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # post_backward has synchronized the gradients already; the step must not reduce them again.
        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        # Lightning's sign that more micro batches of this accumulation follow. Horovod's optimizer counts
        # backward passes itself (backward_passes_per_step) and starts the allreduce after the last.
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if not self._accumulating:  # the gradients are reduced before the module clips them and the step
            for optimizer in self.optimizers:
                optimizer.synchronize()  # type: ignore[attr-defined]  # Horovod's, since setup_optimizers

    def replicas(self, module: LightningModule) -> list[Replica]:
        """None compared: Horovod's processes have no torch process group to compare them over."""
        return []

    def sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        """Horovod's all-reduce (its processes have no torch process group); it returns when the sum is there."""
        return tensor.copy_(self.hvd.allreduce(tensor, op=self.hvd.Sum))

    def mean_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.copy_(self.hvd.allreduce(tensor, op=self.hvd.Average))

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is not None:
            raise ValueError(
                "strategy=horovod reduces over all processes only: Horovod has no torch.distributed groups."
            )
        return self.hvd.allreduce(tensor, op=self._horovod_op(reduce_op))

    def _horovod_op(self, reduce_op: Any) -> Any:
        name = reduce_op.name.lower() if isinstance(reduce_op, ReduceOp.RedOpType) else str(reduce_op or "mean").lower()
        ops = {
            "mean": self.hvd.Average,
            "avg": self.hvd.Average,
            "sum": self.hvd.Sum,
            "max": self.hvd.Max,
            "min": self.hvd.Min,
        }
        if name not in ops:
            raise ValueError(f"strategy=horovod cannot reduce with {reduce_op!r}: use one of {sorted(ops)}.")
        return ops[name]

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return self.hvd.allgather(tensor.unsqueeze(0))  # [processes, *shape], as under DDP

    def barrier(self, name: str | None = None) -> None:
        self.hvd.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.hvd.broadcast_object(obj, root_rank=src)


def horovod_strategy(
    grad_reduction: str = "mean",
    compression: str = "none",
    hierarchical_allreduce: bool = False,
    collective_timeout_minutes: float = 10,
) -> HorovodStrategy:
    """Horovod with averaged gradients (the default) or summed ones (N times the average, as under DDP's
    strategy.grad_reduction=sum), sent as they are or cast to fp16 for the allreduce (compression=fp16)."""
    collective_timeout(collective_timeout_minutes)  # the same check as the other strategies'
    hvd = start_horovod(hierarchical_allreduce, collective_timeout_minutes)
    ops = {"mean": hvd.Average, "sum": hvd.Sum}
    compressions = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
    if grad_reduction not in ops:
        raise ConfigError(f"strategy.grad_reduction={grad_reduction!r}: choose 'mean' (default) or 'sum'.")
    if compression not in compressions:
        raise ConfigError(
            f"strategy.compression={compression!r}: choose 'none' (default) or 'fp16' (half the bytes on the wire)."
        )
    return HorovodStrategy(
        ops[grad_reduction], compressions[compression], hierarchical_allreduce, collective_timeout_minutes
    )


def horovod_world(strategy_cfg: dict[str, Any]) -> int:
    """The number of processes Horovod's launcher started (1 for a process started on its own)."""
    hvd = start_horovod(
        bool(strategy_cfg.get("hierarchical_allreduce", False)), strategy_cfg.get("collective_timeout_minutes")
    )
    return hvd.size()

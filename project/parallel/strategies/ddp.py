"""Data parallelism through Lightning's DDPStrategy: gloo on CPU, NCCL on GPU."""

# No `from __future__ import annotations` here: torch checks the comm hook's annotations at runtime.
from functools import partial
from typing import Any, Callable, Literal, cast

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from project.parallel.contract import LlamaStrategy
from project.parallel.strategies.loading import WholeModelLoading
from project.parallel.strategies.saving import BackgroundSaving
from project.parallel.strategies.timeout import startup_timeout
from project.parallel.whole_model import WholeModelTransforms
from project.runtime.errors import ConfigError


def _allreduce_sum(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that sums gradients instead of averaging them."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class GlooFriendlyDDPStrategy(BackgroundSaving, WholeModelLoading, LlamaStrategy, DDPStrategy):
    """DDPStrategy whose `ddp_comm_hook` holds on CPU (gloo) too.

    Lightning registers `ddp_comm_hook` only when the root device is CUDA and silently drops it
    otherwise; torch's DDP supports comm hooks on gloo, so the same config behaves alike on both.
    """

    def __init__(
        self, *, ddp_comm_state: object | None = None, ddp_comm_hook: Callable | None = None, **kwargs: Any
    ) -> None:
        super().__init__(ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook, **kwargs)
        self.comm_state, self.comm_hook = ddp_comm_state, ddp_comm_hook

    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the model, and registers the hook on CUDA
        if self.comm_hook is not None and self.root_device.type != "cuda":
            cast(DistributedDataParallel, self.model).register_comm_hook(state=self.comm_state, hook=self.comm_hook)


class TransformedDDPStrategy(WholeModelTransforms, GlooFriendlyDDPStrategy):
    """DDP over a model whose blocks are in float8 (strategy.float8) or compiled (strategy.compile=true); DDP wraps
    them as they are."""


def ddp_strategy(
    grad_reduction: Literal["mean", "sum"] = "mean",
    process_group_backend: str | None = None,
    find_unused_parameters: bool = False,
    static_graph: bool = False,
    collective_timeout_minutes: float = 10,
    startup_timeout_minutes: float = 30,
    compile: bool = False,
    float8: str | None = None,
) -> DDPStrategy:
    """DDP with averaged gradients (the default), or summed ones.

    Summation makes each gradient N times the single-replica one: with SGD that multiplies the
    effective learning rate by N; AdamW normalizes the scale away except through `eps` and
    gradient clipping, which then see N times larger gradients.
    """
    if grad_reduction not in ("mean", "sum"):
        raise ConfigError(f"strategy.grad_reduction={grad_reduction!r}: choose 'mean' (default) or 'sum'.")
    transformed = compile or float8
    strategy = (
        partial(TransformedDDPStrategy, compile=compile, float8=float8) if transformed else GlooFriendlyDDPStrategy
    )
    return strategy(
        process_group_backend=process_group_backend,  # None: Lightning picks gloo on CPU, NCCL on GPU
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        ddp_comm_hook=_allreduce_sum if grad_reduction == "sum" else None,
        timeout=startup_timeout(startup_timeout_minutes, collective_timeout_minutes),
    )

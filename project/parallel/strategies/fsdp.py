"""Sharded data parallelism with FSDP1, through Lightning's FSDPStrategy, on GPUs and on CPU (gloo)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, cast, get_args

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.strategies.fsdp import _setup_activation_checkpointing
from torch import nn

from project.model.llama import Block, Llama
from project.parallel.compiled import compile_blocks
from project.parallel.contract import LlamaStrategy, Replica, T, TrainingModule
from project.parallel.groups import shared_mesh
from project.parallel.strategies.loading import ShardedLoading
from project.parallel.strategies.timeout import startup_timeout
from project.runtime.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel

ShardingStrategy = Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]


class CPUCapableFSDPStrategy(ShardedLoading, LlamaStrategy, FSDPStrategy):
    """FSDPStrategy that also runs on CPU with gloo.

    Lightning refuses FSDP on CPU by checking `type(strategy) is FSDPStrategy` (a subclass passes);
    torch's FSDP itself runs on CPU when given `device_id=torch.device("cpu")` rather than the device
    index Lightning passes (None on CPU). HYBRID_SHARD's (replicate, shard) mesh is built here, once
    the world size is known, on the trainer's device type (Lightning's would always be CUDA).
    """

    def __init__(self, hybrid_shard_size: int | None = None, compile: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.hybrid_shard_size = hybrid_shard_size
        self.compile = compile

    def setup_environment(self) -> None:
        if self.cpu_offload.offload_params and self.root_device.type == "cpu":
            raise ConfigError(
                "strategy.cpu_offload=true moves parameters from GPU memory to the CPU between uses; "
                "this run is already on the CPU: set strategy.cpu_offload=false."
            )
        super().setup_environment()
        if self.sharding_strategy.name == "HYBRID_SHARD":
            size = self.hybrid_shard_size or self.num_processes  # default: shard within a node
            if size == 1:  # torch's FSDP then reduces each rank's gradients within its group of one: never averaged
                raise ConfigError(
                    "strategy.sharding_strategy=HYBRID_SHARD over groups of one rank (one device per node, or "
                    "strategy.hybrid_shard_size=1) would leave each rank's gradients unreduced. Use "
                    "sharding_strategy=NO_SHARD for a whole copy on every rank, or FULL_SHARD."
                )
            if self.world_size % size:
                raise ConfigError(
                    f"strategy.hybrid_shard_size={size} does not divide the {self.world_size} ranks: "
                    "pick a divisor (usually the devices per node)."
                )
            shape = (self.world_size // size, size)
            self.kwargs["device_mesh"] = shared_mesh(self.root_device.type, shape, ("replicate", "shard"))

    def between_steps(self, module: TrainingModule, evaluation: Callable[[], T]) -> T:
        # FSDP1 gathers its root unit's parameters (the embedding, the final norm, the head) only inside the wrapper's
        # forward: the evaluation runs there, as Lightning runs its own steps (its forward redirection).
        def inside() -> T:
            return super(CPUCapableFSDPStrategy, self).between_steps(module, evaluation)

        if self.model is None or self.lightning_module is None or self.model is self.lightning_module:
            return inside()
        return cast(T, self._forward_redirection(self.model, self.lightning_module, "run_inside_forward", inside))

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if self.compile:  # in place, before FSDP wraps each block
            compile_blocks(cast(Llama, model.model))  # the LightningModule's Llama
        if self.root_device.type != "cpu":
            return super()._setup_model(model)
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(
            module=model,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        )
        _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
        return model

    def clip_grad_norm(self, module: LightningModule, max_norm: float) -> torch.Tensor:
        """Global gradient norm over all shards (before clipping), gradients clipped to max_norm."""
        return cast("FullyShardedDataParallel", self.model).clip_grad_norm_(max_norm)  # wrapped in _setup_model

    def blocks_run_alone(self) -> bool:
        return False  # each block is an FSDP unit whose forward gathers its parameters

    def replicas(self, module: LightningModule) -> list[Replica]:
        """None compared: each rank holds flat pieces of its units (HYBRID_SHARD's copies across shard groups are
        not checked; strategy=fsdp2 with data_parallel_shard_size is)."""
        return []

    def sum_of_squares(self, groups: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
        """FSDP's parameters (use_orig_params) are each rank's pieces of the flat shards: their sums over every
        rank, divided by the copies of each piece (HYBRID_SHARD's groups; NO_SHARD's every rank)."""
        sums = super().sum_of_squares(groups, device)
        dist.all_reduce(sums)
        name, world = self.sharding_strategy.name, self.world_size
        hybrid = world // (self.hybrid_shard_size or self.num_processes)  # the shard groups, each a whole copy
        return sums / {"NO_SHARD": world, "HYBRID_SHARD": hybrid}.get(name, 1)

    def row_sums_of_squares(
        self, tensors: Sequence[torch.Tensor], rows: int, device: torch.device
    ) -> torch.Tensor | None:
        """None: each rank holds pieces of a block's flat parameter, whose rows it cannot tell apart."""
        return None


def fsdp_strategy(
    sharding_strategy: ShardingStrategy = "FULL_SHARD",
    hybrid_shard_size: int | None = None,
    activation_checkpointing: bool = False,
    cpu_offload: bool = False,
    state_dict_type: Literal["full", "sharded"] = "sharded",
    process_group_backend: str | None = None,
    collective_timeout_minutes: float = 10,
    startup_timeout_minutes: float = 30,
    compile: bool = False,
) -> CPUCapableFSDPStrategy:
    """Each transformer Block is its own FSDP unit; mixed precision follows trainer.precision.

    HYBRID_SHARD shards within groups of `hybrid_shard_size` ranks (default: the devices of one
    node) and replicates across groups, so only the gradient all-reduce crosses nodes.
    """
    if sharding_strategy not in get_args(ShardingStrategy):
        raise ConfigError(
            f"strategy.sharding_strategy={sharding_strategy!r}: choose one of {list(get_args(ShardingStrategy))}."
        )
    return CPUCapableFSDPStrategy(
        hybrid_shard_size=hybrid_shard_size,
        compile=compile,
        auto_wrap_policy={Block},
        activation_checkpointing_policy={Block} if activation_checkpointing else None,
        sharding_strategy=sharding_strategy,
        cpu_offload=cpu_offload,
        state_dict_type=state_dict_type,
        process_group_backend=process_group_backend,
        timeout=startup_timeout(startup_timeout_minutes, collective_timeout_minutes),
    )

"""Lightning's ModelParallelStrategy with our parallelization: tensor parallel, then FSDP2, on a 2-D mesh."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from project.model.config import DTYPE_NAMES
from project.model.llama import Llama
from project.parallel.compiled import compile_blocks
from project.parallel.context_parallel import apply_context_parallel, split_for_rank
from project.parallel.contract import LlamaStrategy, Replica, TrainingModule
from project.parallel.expert_parallel import split_experts
from project.parallel.float8 import apply_float8, scales_before_each_forward
from project.parallel.fsdp2 import apply_fsdp2
from project.parallel.groups import shared_mesh
from project.parallel.init import materialize
from project.parallel.mesh import MeshShape, check_context_parallel_kv, mesh_shape
from project.parallel.recompute import recompute_blocks
from project.parallel.strategies.loading import ShardedLoading
from project.parallel.strategies.saving import ShardedBackgroundSaving
from project.parallel.strategies.timeout import collective_timeout, startup_timeout
from project.parallel.tensor_parallel import apply_tensor_parallel
from project.runtime.errors import ConfigError

# Lightning's ModelParallelStrategy takes bf16-mixed as its only mixed precision (bf16-true stores bfloat16 already).
MIXED_PRECISION_GATHER = {"bf16-mixed": "bfloat16"}


class LlamaParallelStrategy(ShardedBackgroundSaving, ShardedLoading, LlamaStrategy, ModelParallelStrategy):
    """Lightning's mesh is (data_parallel, tensor_parallel), a view of the run's MeshShape (`set_up_meshes`);
    `parallelize` runs in configure_model.

    Order, as in torchtitan: float8 layers (`float8`, project.parallel.float8), the tensor-parallel plan on the
    `tensor_parallel` dimension, activation
    checkpointing of blocks, torch.compile per block, then FSDP2 over `data_parallel`; a model built
    on the meta device is only then given memory and initialized, shard by shard. With
    `loss_parallel` (the default) the training and validation steps and the backward pass run
    inside torch's loss_parallel context, so the loss works on vocabulary-split logits.

    With `context_parallel_size` = cp > 1 the ranks of a context group read the same sequences and each computes
    its part of every sequence (project.parallel.context_parallel). Lightning's mesh then has data x context ranks
    on its `data_parallel` dimension: FSDP2 shards the model over both, as torchtitan does, and averages the
    gradients of every part of every sequence. The view (data, context, tensor) of the same ranks gives the context
    groups and the data-parallel coordinates (which ranks read which batch). With `expert_parallel_size` = ep > 1
    the view (expert_data, expert, tensor) gives the groups a mixture's experts are split over and those FSDP2
    shards them over (project.parallel.expert_parallel).
    `regather_kv`: each block keeps only its rank's part of the keys and values for the backward, which gathers
    them again (long sequences, where every block's gathered keys and values would not fit).
    `reshard_after_forward=False`: each block's gathered parameters are kept from its forward to its backward, one
    gather per micro batch instead of two, every block's at once at the end of the forward (ZeRO-2's trade; FSDP1's
    SHARD_GRAD_OP). `cpu_offload`: each rank's shards, their gradients and the optimizer's states in host memory
    (FSDP2's CPUOffloadPolicy; GPUs only). `state_dict_type=full`: a checkpoint is one file, gathered on rank 0.
    """

    model_on_meta = True  # no rank ever holds the whole model
    # The mesh dimensions outside data parallelism, outermost first: a pipeline's stages. The groups that split the
    # data-parallel ranks (context, experts) keep them outermost too, so that a group's ranks hold one stage.
    outer_dims: tuple[str, ...] = ()
    # FSDP2 frees each block's gathered parameters after its forward (and gathers them again for the backward), unless
    # `reshard_after_forward=False` asks to keep them until the backward; a pipeline stage keeps them through the
    # step's microbatches.
    reshard_after_forward = True

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = "auto",
        sequence_parallel: bool = False,
        loss_parallel: bool = True,
        activation_checkpointing: bool = False,
        compile: bool = False,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        process_group_backend: str | None = None,
        collective_timeout_minutes: float = 10,
        startup_timeout_minutes: float = 30,
        context_parallel_size: int = 1,
        regather_kv: bool = False,
        float8: str | None = None,
        expert_parallel_size: int = 1,
        data_parallel_shard_size: int | Literal["node"] | None = None,
        gradient_sync: str = "every_micro_batch",
        context_parallel_kv: str = "gather",
        reshard_after_forward: bool | None = None,
        cpu_offload: bool = False,
        state_dict_type: str = "sharded",
    ):
        if state_dict_type not in ("sharded", "full"):
            raise ConfigError(f"strategy.state_dict_type={state_dict_type!r}: choose sharded or full.")
        if cpu_offload:  # offloaded gradients are host tensors: their norm's collectives need a CPU backend too
            process_group_backend = with_cpu_backend(process_group_backend)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=state_dict_type == "sharded",
            process_group_backend=process_group_backend,
            timeout=startup_timeout(startup_timeout_minutes, collective_timeout_minutes),
        )
        self.one_file = state_dict_type == "full"
        self.cpu_offload = cpu_offload
        self.writer_timeout = collective_timeout(collective_timeout_minutes)
        for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and dtype not in DTYPE_NAMES:
                raise ConfigError(f"strategy.{name}={dtype!r}: choose one of {list(DTYPE_NAMES)} or null.")
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.context_parallel_size = context_parallel_size
        self.regather_kv = regather_kv
        check_context_parallel_kv(context_parallel_kv, regather_kv)
        self.context_parallel_kv = context_parallel_kv
        self.float8 = float8
        self.expert_parallel_size = expert_parallel_size
        self.data_parallel_shard_size = data_parallel_shard_size
        self.gradient_sync = gradient_sync
        if reshard_after_forward is not None:  # else the class's: a pipeline stage keeps its gathered parameters
            self.reshard_after_forward = reshard_after_forward
        self._fsdp_roots: list[FSDPModule] = []
        # As asked ("auto" included): the degrees themselves are known once the world size is (set_up_meshes).
        self._asked_data_parallel_size, self._asked_tensor_parallel_size = data_parallel_size, tensor_parallel_size
        self._context_group: dist.ProcessGroup | None = None
        self._context_coords = (0, 1)
        self._replica_coords: tuple[int, int] | None = None
        self._experts_mesh: DeviceMesh | None = None
        self._hybrid_mesh: DeviceMesh | None = None

    def asked_degrees(self) -> dict[str, Any]:
        """The degrees the strategy config asks for (mesh_shape's settings)."""
        return {
            "data_parallel_size": self._asked_data_parallel_size,
            "tensor_parallel_size": self._asked_tensor_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
            "data_parallel_shard_size": self.data_parallel_shard_size,
            "gradient_sync": self.gradient_sync,
        }

    def setup_environment(self) -> None:
        # "auto" fills the mesh: Lightning's own default (data_parallel = number of nodes) would
        # not, with several devices per node and a fixed tensor-parallel size.
        shape = mesh_shape(self.asked_degrees(), self.num_nodes * self.num_processes, self.num_processes)
        ParallelStrategy.setup_environment(self)  # the device
        if self.cpu_offload and self.root_device.type == "cpu":
            raise ConfigError(
                "strategy.cpu_offload=true moves parameters, gradients and optimizer states from GPU memory to the "
                "CPU between uses; this run is already on the CPU: set strategy.cpu_offload=false."
            )
        self._setup_distributed()
        # Our module has no configure_model to read its device_mesh: the strategy shards the model from outside.
        self.set_up_meshes(shape, self.root_device.type)

    def set_up_meshes(self, shape: MeshShape, device_type: str) -> None:
        """The process meshes of the run, each a view of `shape` and shared by every fit of the process
        (parallel/groups.py): Lightning's (data x context as its `data_parallel`, FSDP2's ranks), the context
        groups', the expert groups' and HSDP's. Needs the default process group (a dry run's is fake)."""
        outer = self.outer_dims
        # Lightning's ModelParallelStrategy names its dimensions data_parallel and tensor_parallel.
        sizes = shape.sizes((*outer, "data_parallel", "tensor"))
        self._device_mesh = shared_mesh(device_type, sizes, (*outer, "data_parallel", "tensor_parallel"))
        self._context_group, self._replica_coords, self._experts_mesh, self._hybrid_mesh = None, None, None, None
        if shape.context_parallel > 1:  # the ranks of a context group read the same sequences
            names = (*outer, "data", "context", "tensor")
            mesh = shared_mesh(device_type, shape.sizes(names), names)
            # Kept: slicing the mesh later would read its rank tensor on the host each time.
            self._context_group = mesh["context"].get_group()
            self._context_coords = (mesh["context"].get_local_rank(), shape.context_parallel)
            self._replica_coords = (mesh["data"].get_local_rank(), shape.data_parallel)
        if shape.expert_parallel > 1:  # neighbours of data x context split the experts; FSDP2 shards over the rest
            names = (*outer, "expert_data", "expert", "tensor")
            # Its tensor dimension named as Lightning's mesh names it: `replicas` tells a tensor-parallel split (the
            # experts' hidden units) by that name.
            mesh_names = (*outer, "expert_data", "expert", "tensor_parallel")
            self._experts_mesh = shared_mesh(device_type, shape.sizes(names), mesh_names)
        if shape.hybrid:  # FSDP2 on a 2-D mesh: replicated across its first dimension, sharded along its second
            names = (*outer, "data_replicate", "data_shard", "tensor")
            self._hybrid_mesh = shared_mesh(device_type, shape.sizes(names), names)["data_replicate", "data_shard"]

    def parallelize(self, model: Llama, initialize: bool = True) -> None:
        """Shard `model` in place; one built on the meta device then gets memory, and, unless a
        checkpoint is about to fill it (`initialize=False`), its single-device initial values."""
        self.shard(model)
        if any(p.is_meta for p in model.parameters()):  # built without memory (LlamaLitModule(init_on_meta=True))
            # Offloaded shards live in host memory; FSDP2 copies them to the device to gather them.
            materialize(model, torch.device("cpu") if self.cpu_offload else self.root_device, initialize)
        if self.cpu_offload:  # buffers (a mixture's routing biases) stay where the model computes
            for module in model.modules():
                for name, buffer in list(module.named_buffers(recurse=False)):
                    setattr(module, name, buffer.to(self.root_device))

    def shard(self, model: Llama) -> None:
        """What `parallelize` does before any memory is given: this rank's part of the model, as
        DTensors on a model that may stay on the meta device (project.planning.dry_run stops here)."""
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        fsdp_mesh = dp_mesh if self._hybrid_mesh is None else self._hybrid_mesh
        # Kept: slicing the mesh in a step would read its rank tensor on the host each time.
        self._sharded_logits = self.loss_parallel and tp_mesh.size() > 1
        roots = self._sharded_roots(model)
        # FSDP2 gathers float8 weights already cast (tensorwise), where it gathers over several ranks.
        float8_gathers = self.float8 == "tensorwise" and dp_mesh.size() > 1 and bool(roots)
        if self.float8:  # before the plans below, which take float8 layers as they are
            # The mesh's device, not root_device: a dry run shards on a fake process group with no device of its own.
            device = torch.device(self.device_mesh.device_type)
            apply_float8(model, self.float8, device, self.compile, float8_gathers, tp_mesh.size())
        if tp_mesh.size() > 1:
            # gloo has no float8 collectives: on a CPU, sequence parallelism's gathers stay in the run's precision.
            gathers_float8 = not self.sequence_parallel or self.device_mesh.device_type == "cuda"
            float8 = self.float8 if gathers_float8 else None
            apply_tensor_parallel(model, tp_mesh, self.sequence_parallel, self.loss_parallel, float8)
        if self.activation_checkpointing:
            recompute_blocks(model)
        if self._context_group is not None:  # hooks on attention, inside any compiled block
            apply_context_parallel(model, self._context_group, self.regather_kv, self.context_parallel_kv == "ring")
        # A mixture's experts split over their expert group, each one's hidden units over the tensor-parallel group.
        experts_mesh = None
        if self._experts_mesh is not None:
            split = ("expert", "tensor_parallel") if tp_mesh.size() > 1 else ("expert",)
            split_experts(model, self._experts_mesh[split], ("experts", "hidden")[: len(split)])
            experts_mesh = self._experts_mesh["expert_data"]
        elif tp_mesh.size() > 1:
            split_experts(model, tp_mesh, ("hidden",))
        if self.compile:
            compile_blocks(model)
        self._fsdp_roots = []
        for root in roots:
            apply_fsdp2(
                root,
                fsdp_mesh,
                self.gather_dtype(),
                self.reduce_dtype,
                self.reshard_after_forward,
                experts_mesh,
                self.cpu_offload,
            )
            self._fsdp_roots.append(cast(FSDPModule, root))
            if float8_gathers:
                scales_before_each_forward(root)

    def gather_dtype(self) -> str | None:
        """The dtype FSDP2 gathers parameters in and computes with: `strategy.param_dtype` where set, else the
        trainer's mixed precision's (bf16-mixed: bfloat16, as torchtitan does, half the bytes of every gather; the
        gradients are still reduced in `reduce_dtype`, float32 by default), else None (the parameters' own)."""
        if self.param_dtype is not None:
            return self.param_dtype
        return MIXED_PRECISION_GATHER.get(str(self.precision_plugin.precision))

    def data_parallel_coords(self, trainer: Any) -> tuple[int, int]:
        if self._replica_coords is not None:  # a context group reads one batch: its ranks share the coordinate
            return self._replica_coords
        dp = self.device_mesh["data_parallel"]  # the ranks of one replica share a coordinate on it
        return dp.get_local_rank(), dp.size()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rank, size = self.data_parallel_coords(None)  # the replicas, as the data module reads them
        return {"num_replicas": size, "rank": rank}

    def step_loss(
        self, module: TrainingModule, inputs: torch.Tensor, targets: torch.Tensor, train: bool
    ) -> torch.Tensor:
        """The batch's mean loss. Under context parallelism, the mean over this rank's part of every sequence, which
        FSDP2's average over data x context makes the batch's mean (every part holds equally many tokens); the
        model's other inputs (the documents) are those of the whole sequences."""
        whole = module.model_kwargs(inputs)
        inputs, targets = self._own_parts(inputs, targets)
        return module.loss(inputs, targets, whole)

    def step_scores(self, module: TrainingModule, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each row's target scores; under context parallelism, those of this rank's parts summed over the context
        group (a row's targets may all lie in one part)."""
        whole = module.model_kwargs(inputs)
        parts, part_targets = self._own_parts(inputs, targets)
        return self._sum_over_context(module.target_scores(parts, part_targets, whole))

    def _sum_over_context(self, scores: torch.Tensor) -> torch.Tensor:
        if self._context_group is not None:
            dist.all_reduce(scores, group=self._context_group)
        return scores

    def _own_parts(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of every sequence of the inputs and targets [B, T] under context parallelism (all of
        them otherwise)."""
        if self._context_group is None:
            return inputs, targets
        rank, size = self._context_coords
        return split_for_rank(inputs, rank, size), split_for_rank(targets, rank, size)

    def replicas(self, module: LightningModule) -> list[Replica]:
        """Each parameter's local part over every mesh dimension its DTensor is replicated on (HSDP's
        data_replicate, sequence parallelism's norms over tensor_parallel), and over the tensor-parallel group where
        tensor parallelism leaves it whole (norms without sequence parallelism, a mixture's router)."""
        tp = self.device_mesh["tensor_parallel"]
        found = []
        for name, p in module.named_parameters():
            local, dims = (p.to_local(), p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else (p, ())
            if isinstance(p, DTensor):
                for dim, placement in enumerate(p.placements):
                    if placement.is_replicate() and p.device_mesh.size(dim) > 1:
                        found.append(Replica(name, local.detach(), p.device_mesh.get_group(dim)))
            if tp.size() > 1 and "tensor_parallel" not in dims:
                found.append(Replica(name, local.detach(), tp.get_group()))
        return found

    def _sharded_roots(self, model: Llama) -> list[nn.Module]:
        # The modules FSDP2 shards as a whole (each with its blocks); the pipeline shards each stage.
        return [model]

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's sign that more micro batches of this step follow (gradient accumulation): with
        `gradient_sync` other than every_micro_batch, FSDP2 holds back what it would reduce until the last one."""
        hold = {
            "replicas_at_last": FSDPModule.set_requires_all_reduce,  # HSDP: within the shard group still
            "at_last": FSDPModule.set_requires_gradient_sync,  # unsharded gradients kept through the step
        }.get(self.gradient_sync)
        if hold is None:
            yield
            return
        for root in self._fsdp_roots:
            hold(root, False)
        try:
            yield
        finally:
            for root in self._fsdp_roots:
                hold(root, True)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Vocabulary-split logits need torch's loss_parallel around the loss and its backward."""
        return loss_parallel() if self._sharded_logits else contextlib.nullcontext()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context():
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context():
            return super().test_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.loss_context():
            return super().backward(closure_loss, *args, **kwargs)

    def _sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        # One model replica on the ranks of this mesh: nothing to add. A pipeline adds its stages.
        return value

    def blocks_run_alone(self) -> bool:
        """FSDP2 gathers in hooks outside the block's own forward; tensor and context parallelism reduce inside it,
        expert parallelism sends tokens inside it."""
        alone = self.device_mesh["tensor_parallel"].size() == 1 and self._context_group is None
        return alone and self.expert_parallel_size == 1

    def sum_of_squares(self, groups: Sequence[Sequence[torch.Tensor]], device: torch.device) -> torch.Tensor:
        """Each group's DTensors reduced to a full sum per mesh (as clip_grad_norm's norms), then the stages'."""
        sums = []
        for group in groups:
            by_mesh: dict[object, list[torch.Tensor]] = {}
            for t in group:
                by_mesh.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
            total = torch.zeros((), device=device, dtype=torch.float32)
            for tensors in by_mesh.values():
                part: Any = sum(t.detach().float().square().sum() for t in tensors)
                total = total + (part.full_tensor() if isinstance(part, DTensor) else part).to(device)
            sums.append(total)
        return self._sum_over_stages(torch.stack(sums))

    def row_sums_of_squares(
        self, tensors: Sequence[torch.Tensor], rows: int, device: torch.device
    ) -> torch.Tensor | None:
        """Each DTensor's rows summed where they lie (DTensor's own reduction: an all-gather of the row sums where
        dim 0 is split, an all-reduce where another dimension is), then the stages'."""
        total = torch.zeros(rows, device=device, dtype=torch.float32)
        for t in tensors:
            squares: Any = t.detach().float().square().sum(dim=tuple(range(1, t.dim())))
            summed = squares.full_tensor() if isinstance(squares, DTensor) else squares
            total += summed.to(device)  # offloaded shards sum on the host
        return self._sum_over_stages(total)

    def clip_grad_norm(self, module: LightningModule, max_norm: float) -> torch.Tensor:
        """Global gradient norm over all shards and tensor-parallel slices (before clipping).

        Without sequence parallelism the norms' weights live on the data-parallel mesh only, the
        tensor-parallel weights on the 2-D mesh; torch cannot combine norms across meshes, so each
        mesh's gradients are reduced to a full norm separately and the results combined.
        """
        by_mesh: dict[object, list[nn.Parameter]] = {}
        for p in module.parameters():
            if p.grad is not None:
                by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        norms = []
        for params in by_mesh.values():
            norm = nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])  # all of them
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = self._sum_over_stages(torch.stack(norms).square().sum()).sqrt()
        for params in by_mesh.values():
            nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total


def with_cpu_backend(backend: str | None) -> str:
    """`backend` with gloo for CPU tensors beside it (torch's `device:backend` list): NCCL on the GPUs by default."""
    if backend is None:
        return "cuda:nccl,cpu:gloo"
    if "cpu:" in backend:
        return backend
    return f"{backend},cpu:gloo" if ":" in backend else f"cuda:{backend},cpu:gloo"

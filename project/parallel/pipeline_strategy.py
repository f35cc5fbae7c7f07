"""Pipeline parallelism as a Lightning strategy, on a (pipeline, data_parallel, tensor_parallel) mesh.

Lightning's loop stays as it is: one `training_step` per optimizer step, then backward, clipping
and the optimizer. A pipeline schedule runs forward and backward of all microbatches at once, so
this strategy runs the schedule inside the module's own training step (the module's `loss` goes
through the schedule for its duration) and makes the backward that Lightning asks for afterwards a
no-op. Inside each stage, tensor parallelism, activation checkpointing, compile and FSDP2 over the
data-parallel replicas are applied as in LlamaParallelStrategy.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from project.model.llama import Llama
from project.parallel.mesh import MeshShape, mesh_shape
from project.parallel.model_parallel import LlamaParallelStrategy
from project.parallel.pipeline import build_schedule, chunk_ranks, default_virtual_stages, split_into_stages

MESH_DIMS = ("pipeline", "data_parallel", "tensor_parallel")


class LlamaPipelineStrategy(LlamaParallelStrategy):
    """`pipeline_parallel_size` stages (x `virtual_stages` chunks each) run by one of torch's schedules.

    `n_microbatches` and `micro_batch_size` come from the run's batch plan (project.train sets them):
    each training step's batch is one data-parallel replica's share of the global batch, which the
    schedule cuts into `n_microbatches` microbatches of `micro_batch_size` sequences.
    """

    def __init__(
        self,
        pipeline_parallel_size: int | str = "auto",
        data_parallel_size: int | str = 1,
        tensor_parallel_size: int | str = 1,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        n_microbatches: int | None = None,
        stage_layers: list[int] | None = None,
        **stage_settings: Any,
    ):
        """`stage_settings`: LlamaParallelStrategy's (sequence/loss parallel, activation checkpointing,
        compile, dtypes, backend), applied inside each stage."""
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **stage_settings)
        self._pipeline_parallel_size = pipeline_parallel_size
        self.schedule = schedule
        self.virtual_stages = virtual_stages or default_virtual_stages(schedule)
        self.n_microbatches = n_microbatches
        self.micro_batch_size: int | None = None
        self.stage_layers = stage_layers

    @property
    def shape(self) -> MeshShape:
        degrees = {
            "pipeline_parallel_size": self._pipeline_parallel_size,
            "data_parallel_size": self._data_parallel_size,
            "tensor_parallel_size": self._tensor_parallel_size,
        }
        return mesh_shape(degrees, self.num_nodes * self.num_processes, self.num_processes)

    def setup_environment(self) -> None:
        shape = self.shape
        self._pipeline_parallel_size, self._data_parallel_size, self._tensor_parallel_size = shape
        self._setup_distributed()  # the process group; ModelParallelStrategy's own mesh is 2-D
        self._device_mesh = init_device_mesh(self.root_device.type, tuple(shape), mesh_dim_names=MESH_DIMS)
        self.lightning_module._device_mesh = self._device_mesh

    # -- building the stages ------------------------------------------------------------------------

    def parallelize(self, model: Llama, initialize: bool = True) -> None:
        """Keep this rank's chunks of `model`, parallelize and initialize them, and build the schedule."""
        if self.n_microbatches is None or self.micro_batch_size is None:
            raise RuntimeError("LlamaPipelineStrategy needs n_microbatches and micro_batch_size before configure_model")
        pipeline = self.device_mesh["pipeline"]
        # The whole model's parameter order, for checkpoints that list every stage's parameters.
        self._parameter_order = {f"model.{name}": i for i, (name, _) in enumerate(model.named_parameters())}
        self._chunks = split_into_stages(
            model, pipeline.get_local_rank(), pipeline.size(), self.schedule, self.virtual_stages, self.stage_layers
        )
        super().parallelize(model, initialize)  # tensor parallel, checkpointing, compile, FSDP2 per chunk, init
        n_chunks = pipeline.size() * self.virtual_stages
        self._last_stage_rank = dist.get_global_rank(pipeline.get_group(), chunk_ranks(self.schedule, pipeline.size(), n_chunks)[-1])
        self._pipeline = build_schedule(
            self._chunks, n_chunks, pipeline.get_group(), self.root_device, self.schedule, self.n_microbatches, self.lightning_module.criterion
        )

    def _sharded_roots(self, model: Llama) -> list[nn.Module]:
        return list(self._chunks.values())

    @property
    def _has_first_stage(self) -> bool:
        return 0 in self._chunks

    @property
    def _has_last_stage(self) -> bool:
        return self.pipeline_size * self.virtual_stages - 1 in self._chunks

    @property
    def pipeline_size(self) -> int:
        return self.device_mesh["pipeline"].size()

    # -- one training or validation step through the schedule --------------------------------------

    def _run_schedule(self, train: bool, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss, on every rank of the pipeline (computed by the last stage).

        Training runs forward and backward of every microbatch. Evaluation runs forward only; a
        short batch (the last of a validation share) is padded to the training batch's shape, which
        the schedule's buffers have, with targets of -100 that the loss leaves out.
        """
        module, real = self.lightning_module, inputs.shape[0]
        full = self.n_microbatches * self.micro_batch_size
        if not train and real < full:
            pad = full - real
            inputs = torch.cat([inputs, inputs[:1].expand(pad, -1)])
            targets = torch.cat([targets, targets.new_full((pad, targets.shape[1]), -100)])
        kwargs = {"seq_len": inputs.shape[1], "return_outputs": False, **module.model_kwargs(inputs)}
        args = (inputs,) if self._has_first_stage else ()
        target = targets if self._has_last_stage else None
        losses: list[torch.Tensor] = []
        if train:
            module.zero_grad(set_to_none=True)  # Lightning zeroes gradients after the step, not before
            self._pipeline.step(*args, target=target, losses=losses, **kwargs)
            self._gradients = [(p, p.grad) for p in module.parameters()]
        else:
            self._pipeline.eval(*args, target=target, losses=losses, **kwargs)
        loss = torch.zeros((), device=self.root_device)
        if losses:
            # Each microbatch's loss is its mean over its real sequences, which all have seq_len tokens.
            real_rows = [min(max(real - i * self.micro_batch_size, 0), self.micro_batch_size) for i in range(len(losses))]
            loss = sum(l.detach().float() * n for l, n in zip(losses, real_rows) if n) / real
        dist.broadcast(loss, src=self._last_stage_rank, group=self.device_mesh["pipeline"].get_group())
        return loss

    @contextlib.contextmanager
    def _loss_through_schedule(self, train: bool) -> Iterator[None]:
        # The module's training and validation steps stay the same for every strategy; only its
        # `loss` is replaced, for this step, by the schedule's.
        module = self.lightning_module
        module.loss = functools.partial(self._run_schedule, train)
        try:
            yield
        finally:
            del module.loss

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_through_schedule(train=True):
            return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_through_schedule(train=False):
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_through_schedule(train=False):
            return super().test_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The schedule ran every microbatch's backward in the training step. Lightning has zeroed
        # the gradients since (it does so between the step and backward): put them back.
        for param, grad in self._gradients:
            param.grad = grad
        self._gradients = []
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    def _sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.device_mesh["pipeline"].get_group())
        return value

    # -- checkpoints -------------------------------------------------------------------------------

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's optimizer state keyed by parameter name, with param_groups naming every
        stage's parameters: a distributed checkpoint keeps one copy of such non-tensor entries, which
        must then be right for the whole model (and any layout that resumes from it)."""
        state = super().optimizer_state(optimizer)
        names = [[group["params"] for group in state["param_groups"]]]
        gathered: list[Any] = [None] * self.pipeline_size
        dist.all_gather_object(gathered, names[0], group=self.device_mesh["pipeline"].get_group())
        for i, group in enumerate(state["param_groups"]):
            every_stage = {name for stage in gathered for name in stage[i]}
            group["params"] = sorted(every_stage, key=self._parameter_order.__getitem__)
        return state

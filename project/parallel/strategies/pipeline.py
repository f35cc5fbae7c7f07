"""Pipeline parallelism as a Lightning strategy, on a (pipeline, data_parallel, tensor_parallel) mesh: a view of the
run's MeshShape with the stages outermost (data_parallel spans data x context; the views (pipeline, data, context,
tensor) and (pipeline, expert_data, expert, tensor) give the context and expert groups: LlamaParallelStrategy).

Lightning's loop stays as it is: one `training_step` per optimizer step, then backward, clipping
and the optimizer. A pipeline schedule runs forward and backward of all microbatches at once, so
the module's training step asks this strategy for the step's loss (`step_loss`, project.parallel.contract),
which runs the schedule, gradients included (`gradients_in_step`: the module then keeps Lightning from
zeroing them before its backward, which here only runs the precision plugin's hooks). Inside each stage,
tensor parallelism, activation checkpointing, compile and FSDP2 over the data-parallel replicas are applied
as in LlamaParallelStrategy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.fsdp import FSDPModule

from project.model.llama import Llama
from project.parallel.batch import BatchPlan
from project.parallel.contract import TrainingModule
from project.parallel.mesh import MeshShape
from project.parallel.pipeline import LlamaStage, PipelineSchedule, build_schedule, split_into_stages
from project.parallel.pipeline_layout import SPLIT_BACKWARD, chunk_ranks, default_virtual_stages
from project.parallel.strategies.model_parallel import LlamaParallelStrategy
from project.runtime.errors import ConfigError

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # rank of the tensor, its shape, and its dtype's index in _DTYPES


def send_activation(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup, tag: int
) -> list[tuple[Any, torch.Tensor]]:
    """Send a tensor of any shape and dtype to global rank `dst`: a fixed-size header, then the data.
    Returns the pending sends with the tensors they read, which must live until they complete."""
    tensor = tensor.contiguous()
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[-1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
    header = header.to(tensor.device)
    return [(dist.isend(t, dst, group=group, tag=tag), t) for t in (header, tensor)]


def receive_activation(src: int, group: dist.ProcessGroup, tag: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group, tag=tag)
    meta: list[int] = header.tolist()
    tensor = torch.empty(meta[1 : 1 + meta[0]], dtype=_DTYPES[meta[-1]], device=device)
    dist.recv(tensor, src, group=group, tag=tag)
    return tensor


class LlamaPipelineStrategy(LlamaParallelStrategy):
    """`pipeline_parallel_size` stages (x `virtual_stages` chunks each) run by one of torch's schedules.

    `n_microbatches` and `micro_batch_size` come from the run's batch plan (`plan_batches`):
    each training step's batch is one data-parallel replica's share of the global batch, which the
    schedule cuts into `n_microbatches` microbatches of `micro_batch_size` sequences.
    """

    outer_dims = ("pipeline",)  # the stages, outermost: each stage's ranks form the meshes of LlamaParallelStrategy
    gradients_in_step = True  # the schedule runs every microbatch's backward inside the training step
    reshard_after_forward = False  # gathered once per step, not per microbatch (torchtitan: not pp_enabled)

    def __init__(
        self,
        pipeline_parallel_size: int | Literal["auto"] = "auto",
        data_parallel_size: int | Literal["auto"] = 1,
        tensor_parallel_size: int | Literal["auto"] = 1,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        n_microbatches: int | None = None,
        stage_layers: list[int] | None = None,
        **stage_settings: Any,
    ):
        """`stage_settings`: LlamaParallelStrategy's (sequence/loss parallel, activation checkpointing,
        compile, dtypes, backend), applied inside each stage; not those a stage decides itself (it keeps its
        gathered parameters through the step, writes a folder of every stage's shards, and keeps them on the
        device)."""
        fixed = {"reshard_after_forward": None, "state_dict_type": "sharded", "cpu_offload": False}
        for name, value in fixed.items():
            if stage_settings.get(name, value) != value:
                raise ConfigError(f"strategy.{name}={stage_settings[name]}: a pipeline stage does not take it.")
        super().__init__(
            data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **stage_settings
        )
        self._pipeline_parallel_size = pipeline_parallel_size
        self.schedule = schedule
        self.virtual_stages = virtual_stages or default_virtual_stages(schedule)
        self.n_microbatches = n_microbatches
        self.micro_batch_size: int | None = None
        self.stage_layers = stage_layers

    def plan_batches(self, plan: BatchPlan) -> None:
        self.n_microbatches, self.micro_batch_size = plan.pipeline_microbatches, plan.micro_batch_size

    @property
    def _lit_module(self) -> LightningModule:
        module = self.lightning_module
        assert module is not None  # connected before the trainer sets the strategy up
        return module

    def asked_degrees(self) -> dict[str, Any]:
        return {**super().asked_degrees(), "pipeline_parallel_size": self._pipeline_parallel_size}

    def set_up_meshes(self, shape: MeshShape, device_type: str) -> None:
        self._pipeline_parallel_size = shape.pipeline_parallel
        super().set_up_meshes(shape, device_type)

    # -- building the stages ------------------------------------------------------------------------

    def parallelize(self, model: Llama, initialize: bool = True) -> None:
        """Keep this rank's chunks of `model`, parallelize and initialize them, and build the schedule."""
        if self.n_microbatches is None or self.micro_batch_size is None:
            raise RuntimeError("LlamaPipelineStrategy needs n_microbatches and micro_batch_size before configure_model")
        super().parallelize(model, initialize)  # shard (below), then memory and initial values
        pipeline = self.device_mesh["pipeline"]
        # Kept: slicing the mesh in a step would read its rank tensor on the host each time.
        self._pipeline_group, self._pipeline_size = pipeline.get_group(), pipeline.size()
        n_chunks = pipeline.size() * self.virtual_stages
        # Global ranks (of this rank's pipeline group) that run each chunk.
        self._stage_ranks = [
            dist.get_global_rank(pipeline.get_group(), r) for r in chunk_ranks(self.schedule, pipeline.size(), n_chunks)
        ]
        self._last_stage_rank = self._stage_ranks[-1]
        self._pipeline: PipelineSchedule | None = None  # built at the first training step (_schedule)

    def shard(self, model: Llama) -> None:
        """Prune `model` to this rank's stage chunks, then shard each as LlamaParallelStrategy does."""
        pipeline = self.device_mesh["pipeline"]
        # The whole model's parameter order, for checkpoints that list every stage's parameters.
        self._parameter_order = {f"model.{name}": i for i, (name, _) in enumerate(model.named_parameters())}
        self._chunks = split_into_stages(
            model, pipeline.get_local_rank(), pipeline.size(), self.schedule, self.virtual_stages, self.stage_layers
        )
        super().shard(model)  # tensor parallel, checkpointing, compile, FSDP2 per chunk

    @property
    def stage_chunks(self) -> dict[int, LlamaStage]:
        """This rank's stage chunks by index, once sharded."""
        return self._chunks

    def _sharded_roots(self, model: Llama) -> list[nn.Module]:
        # FSDP2 per chunk, so that torch's stages see an FSDP module and reduce gradients once per
        # step. Not under the split-backward schedules: see SPLIT_BACKWARD.
        return [] if self.schedule in SPLIT_BACKWARD else list(self._chunks.values())

    @property
    def _has_first_stage(self) -> bool:
        return 0 in self._chunks

    @property
    def _has_last_stage(self) -> bool:
        return self.pipeline_size * self.virtual_stages - 1 in self._chunks

    @property
    def pipeline_size(self) -> int:
        return self._pipeline_size

    # -- one training or validation step through the schedule --------------------------------------

    def _run_schedule(
        self, module: TrainingModule, train: bool, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """The batch's mean loss, on every rank of the pipeline (computed by the last stage).

        Training runs the schedule: forward and backward of every microbatch. Evaluation runs
        forward only (`_evaluate`). Under context parallelism the stages run this rank's part of every
        sequence, beside the whole sequences' documents.
        """
        whole = module.model_kwargs(inputs)  # of the whole sequences, also under context parallelism
        inputs, targets = self._own_parts(inputs, targets)
        if train:
            schedule = self._schedule(module, inputs, whole)
            kwargs: dict[str, Any] = {"seq_len": inputs.shape[1], **whole}
            losses: list[torch.Tensor] = []
            module.zero_grad(set_to_none=True)  # Lightning zeroes gradients after the step, not before
            schedule.step(
                *((inputs,) if self._has_first_stage else ()),
                target=targets if self._has_last_stage else None,
                losses=losses,
                return_outputs=False,
                **kwargs,
            )
            loss = torch.stack(losses).detach().mean() if losses else torch.zeros((), device=self.root_device)
        else:
            loss = self._evaluate(module, inputs, targets, whole)
        dist.broadcast(loss, src=self._last_stage_rank, group=self._pipeline_group)
        return loss

    def _schedule(self, module: TrainingModule, inputs: torch.Tensor, kwargs: dict[str, Any]) -> PipelineSchedule:
        """torch's schedule over this rank's chunks, built at the first training step with the shapes the step's first
        microbatch takes through them (project.parallel.pipeline.static_shapes: torch's stages then run no pass of
        their own to find them), from a forward of it without gradients, which trains nothing and which the model
        does not count."""
        if self._pipeline is None:
            assert self.n_microbatches is not None  # parallelize refuses to build the stages without it
            with torch.no_grad():
                examples = {stage: (x, out) for stage, _, x, out in self._forward(inputs, kwargs, rows=1)}
            self._pipeline = build_schedule(
                self._chunks,
                self.pipeline_size * self.virtual_stages,
                self._pipeline_group,
                self.root_device,
                self.schedule,
                self.n_microbatches,
                module.criterion,
                examples,
            )
        return self._pipeline

    @torch.no_grad()
    def _evaluate(
        self, module: TrainingModule, inputs: torch.Tensor, targets: torch.Tensor, kwargs: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Forward only (`_forward`). The sequence-weighted mean loss on the rank of the last chunk, zero elsewhere.

        Not torch's `schedule.eval()`: in torch 2.13 it fails for V-shaped schedules ("can't
        steal_bwd_input if this stage doesn't have backward"), and its buffers keep the training
        batch's shape, which the last validation batch of a replica need not have.
        """
        last = self.pipeline_size * self.virtual_stages - 1
        total = torch.zeros((), device=self.root_device)
        for stage, part, x, out in self._forward(inputs, kwargs):
            if stage == last:
                total += module.criterion(out, targets[part]).float() * x.shape[0]
        return total / inputs.shape[0]

    def step_scores(self, module: TrainingModule, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each row's target scores, computed by the last stage (forward only, as `_evaluate`) and sent to every
        stage; summed over the context group under context parallelism."""
        whole = module.model_kwargs(inputs)
        inputs, targets = self._own_parts(inputs, targets)
        last = self.pipeline_size * self.virtual_stages - 1
        scores = torch.zeros(inputs.shape[0], 3, device=self.root_device, dtype=torch.float64)
        with torch.no_grad():
            for stage, part, _, out in self._forward(inputs, whole):
                if stage == last:
                    scores[part] = module.head_scores(out, targets[part])
        dist.broadcast(scores, src=self._last_stage_rank, group=self._pipeline_group)
        return self._sum_over_context(scores)

    def _forward(
        self, inputs: torch.Tensor, kwargs: dict[str, torch.Tensor], rows: int | None = None
    ) -> Iterator[tuple[int, slice, torch.Tensor, torch.Tensor]]:
        """Microbatches of `micro_batch_size` (the first `rows` of them, or all) through this rank's chunks in stage
        order, outputs sent on to the rank of the next chunk: each chunk's (stage index, the microbatch's rows of
        the batch, input, output) as it runs. Run it to its end: the last sends are waited for there."""
        group = self._pipeline_group
        seq_len = inputs.shape[1]
        size = self.micro_batch_size
        assert size is not None  # parallelize refuses to build the stages without it
        parts = [slice(i, i + size) for i in range(0, inputs.shape[0], size)][:rows]
        last = self.pipeline_size * self.virtual_stages - 1
        here: dict[tuple[int, int], torch.Tensor] = {}  # outputs for the next chunk, when it is on this rank too
        sends: list[tuple[Any, torch.Tensor]] = []
        for stage, chunk in sorted(self._chunks.items()):
            for i, part in enumerate(parts):
                if stage == 0:
                    x = inputs[part]
                elif (stage - 1) in self._chunks:
                    x = here.pop((stage - 1, i))
                else:
                    x = receive_activation(self._stage_ranks[stage - 1], group, tag=stage - 1, device=self.root_device)
                out = chunk(x, seq_len=seq_len, **{k: v[part] for k, v in kwargs.items()})
                yield stage, part, x, out
                if stage == last:
                    continue
                if (stage + 1) in self._chunks:
                    here[(stage, i)] = out
                else:
                    sends.extend(send_activation(out, self._stage_ranks[stage + 1], group, tag=stage))
        for work, _ in sends:
            work.wait()
        # The forwards gathered each chunk's parameters once and kept them (reshard_after_forward); no backward
        # follows to free them, so they would hold a whole stage's memory until the next training step.
        for chunk in self._chunks.values():
            if isinstance(chunk, FSDPModule):
                chunk.reshard()

    def step_loss(
        self, module: TrainingModule, inputs: torch.Tensor, targets: torch.Tensor, train: bool
    ) -> torch.Tensor:
        return self._run_schedule(module, train, inputs, targets)

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The schedule ran every microbatch's backward in the training step (gradients_in_step, so the
        # module kept Lightning from zeroing them since): only the precision plugin's hooks are left to run.
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self._lit_module)
        return self.precision_plugin.post_backward(closure_loss, self._lit_module)

    def _sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self._pipeline_group)
        return value

    # -- checkpoints -------------------------------------------------------------------------------

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's optimizer state keyed by parameter name, with param_groups naming every
        stage's parameters: a distributed checkpoint keeps one copy of such non-tensor entries, which
        must then be right for the whole model (and any layout that resumes from it)."""
        state = super().optimizer_state(optimizer)
        gathered: list[Any] = [None] * self.pipeline_size
        own = [group["params"] for group in state["param_groups"]]
        dist.all_gather_object(gathered, own, group=self.device_mesh["pipeline"].get_group())
        for i, group in enumerate(state["param_groups"]):
            every_stage = {name for stage in gathered for name in stage[i]}
            group["params"] = sorted(every_stage, key=self._parameter_order.__getitem__)
        return state

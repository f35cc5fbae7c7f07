"""Pipeline parallelism for Llama: the model cut into stage chunks, and torch's schedules to run them.

A model of L blocks is cut into `pipeline_parallel_size x virtual_stages` chunks of consecutive
blocks; the first chunk also holds the embedding, the last the final norm and output head (the loss
is computed after it). Each rank keeps only the chunks it runs: the model is pruned in place, so
parameter names stay those of the plain model. Chunks are placed on ranks in a loop (chunk s on
rank s mod p) or, for the V-shaped schedules, down and back up (rank 0 holds the first and the last).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence, TypedDict, cast

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from project.model.llama import Llama
from project.parallel.pipeline_layout import chunk_ranks, stage_layer_counts

PipelineSchedule = PipelineScheduleSingle | PipelineScheduleMulti
SCHEDULES: dict[str, type[PipelineScheduleSingle] | type[PipelineScheduleMulti]] = {  # by SCHEDULE_NAMES
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}


class LlamaStage(nn.Module):
    """One chunk of a Llama: consecutive blocks, plus the embedding (first chunk) or the final norm
    and output head (last chunk). It shares these modules with the model, which stays their owner:
    parameter names, the optimizer and checkpoints all go through the model.

    forward(x, seq_len, document_ids=None): x is the tokens on the first chunk and the previous
    chunk's hidden states elsewhere; the result is hidden states, on the last chunk after the final norm: the
    schedule's loss function applies the output head to them a chunk of tokens at a time (Llama.head_loss),
    so that the last stage never holds whole logits.
    """

    def __init__(self, model: Llama, layer_ids: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        # Bound methods: the model is not registered as a submodule.
        self.run_layers = model.run_layers
        self.stage_output = None if model.hooks is None else model.hooks.stage_output

    def forward(self, x: torch.Tensor, seq_len: int, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        h = self.run_layers(h, self.layers.values(), seq_len, document_ids)
        h = h if self.norm is None else self.norm(h)
        return h if self.stage_output is None else self.stage_output(h)


def split_into_stages(
    model: Llama,
    pipeline_rank: int,
    pipeline_parallel_size: int,
    schedule: str,
    virtual_stages: int,
    stage_layers: Sequence[int] | None = None,
) -> dict[int, LlamaStage]:
    """This rank's chunks by stage index; `model` is pruned to them, so it holds nothing else."""
    n_chunks = pipeline_parallel_size * virtual_stages
    counts = stage_layer_counts(model.config.n_layers, n_chunks, stage_layers)
    starts = [sum(counts[:s]) for s in range(n_chunks)]
    ranks = chunk_ranks(schedule, pipeline_parallel_size, n_chunks)
    mine = [s for s in range(n_chunks) if ranks[s] == pipeline_rank]
    chunks = {
        s: LlamaStage(model, range(starts[s], starts[s] + counts[s]), first=s == 0, last=s == n_chunks - 1)
        for s in mine
    }
    kept = {name for chunk in chunks.values() for name in chunk.layers}
    for name in [name for name in model.layers if name not in kept]:
        del model.layers[name]
    # The pruned model no longer holds them, which Llama's annotations do not foresee.
    if 0 not in chunks:
        model.tok_embeddings = None  # type: ignore[assignment]
    if n_chunks - 1 not in chunks:
        model.norm = model.output = None  # type: ignore[assignment]
    return chunks


def build_schedule(
    chunks: Mapping[int, nn.Module],
    n_chunks: int,
    group: ProcessGroup,
    device: torch.device,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    examples: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> PipelineSchedule:
    """torch's schedule over this rank's chunks. `loss_fn` returns a microbatch's mean loss; the
    schedule divides the accumulated gradients by the number of microbatches, so they are those of
    the mean over the whole batch. `examples`: each chunk's input and output on one microbatch, by stage index
    (`static_shapes`); without them torch's stages find their shapes at the first step by a forward and backward
    pass of their own."""
    stages: list = [  # of PipelineStage (torch types the argument by its private base class)
        PipelineStage(
            chunk, index, n_chunks, device, group=group, **(static_shapes(*examples[index]) if examples else {})
        )
        for index, chunk in sorted(chunks.items())
    ]
    cls = SCHEDULES[schedule]
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    # Every schedule of SCHEDULES that is not single-stage is multi-stage.
    return cast(type[PipelineScheduleMulti], cls)(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)


class StageShapes(TypedDict, total=False):
    """PipelineStage's shape arguments; none given: torch infers them."""

    input_args: tuple[torch.Tensor, ...]
    output_args: tuple[torch.Tensor, ...]
    input_grads: tuple[torch.Tensor | None, ...]
    output_grads: tuple[torch.Tensor | None, ...]


def static_shapes(x: torch.Tensor, out: torch.Tensor) -> StageShapes:
    """PipelineStage's shapes of a chunk, from its input and output on one microbatch (computed without gradients):
    every microbatch's are alike, and in training what flows between stages carries gradients, the tokens none.

    Given them, torch's stages infer none. torch 2.13's inference is a training-mode forward and backward pass of
    the chunk at the first step, on empty tensors past the first stage (PipelineStage._forward_metadata_inference):
    its results are thrown away, but a model that counts what its forwards see (a mixture's expert loads) would count
    that pass too. The gradients are given too: tensor parallelism's last chunk outputs a DTensor, whose gradient's
    placement torch would otherwise infer in that pass (the last chunk receives none)."""

    def carried(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(t.is_floating_point())

    def gradient(t: torch.Tensor) -> torch.Tensor | None:
        return t.detach() if t.is_floating_point() else None

    return {
        "input_args": (carried(x),),
        "output_args": (carried(out),),
        "input_grads": (gradient(x),),
        "output_grads": (gradient(out),),
    }

"""Pipeline parallelism for Llama: the model cut into stage chunks, and torch's schedules to run them.

A model of L blocks is cut into `pipeline_parallel_size x virtual_stages` chunks of consecutive
blocks; the first chunk also holds the embedding, the last the final norm and output head (the loss
is computed after it). Each rank keeps only the chunks it runs: the model is pruned in place, so
parameter names stay those of the plain model. Chunks are placed on ranks in a loop (chunk s on
rank s mod p) or, for the V-shaped schedules, down and back up (rank 0 holds the first and the last).
"""

from __future__ import annotations

from typing import Callable, Sequence

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
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _PipelineSchedule

from project.errors import ConfigError
from project.model.llama import Llama, LlamaConfig
from project.parallel.mesh import MeshShape

SCHEDULES: dict[str, type[_PipelineSchedule]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
V_SHAPED = {"zbv"}  # the schedules that place chunks down the ranks and back up
# The zero-bubble schedules split each backward into an input part and a weight part. Seen on CPU
# with gloo, torch 2.13: with FSDP2 in the stages the weight gradients are wrong (the first step's
# gradient norm 13% off a single device's, whether FSDP2 shards over 1 or 2 ranks), and with tensor
# parallelism the input part fails ("Can't detach views in-place"). These schedules therefore run
# unsharded stages, on pipeline-only layouts.
SPLIT_BACKWARD = {"interleaved_zero_bubble", "zbv"}


def default_virtual_stages(schedule: str) -> int:
    return 2 if schedule in V_SHAPED else 1


def chunk_ranks(schedule: str, pipeline_parallel_size: int, n_chunks: int) -> list[int]:
    """The pipeline rank that runs each chunk, as torch's schedules expect them placed."""
    p = pipeline_parallel_size
    if schedule in V_SHAPED:
        return [s % p if (s // p) % 2 == 0 else p - 1 - s % p for s in range(n_chunks)]
    return [s % p for s in range(n_chunks)]


def stage_layer_counts(n_layers: int, n_chunks: int, stage_layers: Sequence[int] | None = None) -> list[int]:
    """Blocks per chunk: `stage_layers` if given, else as even as possible.

    Blocks left over from an even split go to the middle chunks first, then the first, then the
    last: the first chunk also runs the embedding (cheap), the last the output head and loss (as
    costly as a block or more, with a large vocabulary).
    """
    if stage_layers is not None:
        return list(stage_layers)
    counts = [n_layers // n_chunks] * n_chunks
    order = [*range(1, n_chunks - 1), 0, n_chunks - 1] if n_chunks > 1 else [0]
    for chunk in order[: n_layers % n_chunks]:
        counts[chunk] += 1
    return counts


def check_pipeline(
    config: LlamaConfig,
    schedule: str,
    shape: MeshShape,
    virtual_stages: int,
    n_microbatches: int,
    stage_layers: Sequence[int] | None = None,
    compile: bool = False,
    param_dtype: str | None = None,
) -> None:
    """Refuse, before any process starts, a pipeline that cannot be built or scheduled."""
    pipeline_parallel_size, data_parallel_size, tensor_parallel_size = shape
    if schedule not in SCHEDULES:
        raise ConfigError(f"strategy.schedule={schedule!r}: choose one of {list(SCHEDULES)}.")
    single = issubclass(SCHEDULES[schedule], PipelineScheduleSingle)
    if single and virtual_stages != 1:
        raise ConfigError(
            f"strategy.schedule={schedule} runs one stage chunk per rank, not strategy.virtual_stages={virtual_stages}: "
            "set strategy.virtual_stages=1, or choose interleaved_1f1b, looped_bfs, interleaved_zero_bubble or zbv."
        )
    if schedule in V_SHAPED and virtual_stages != 2:
        raise ConfigError(f"strategy.schedule={schedule} needs exactly 2 stage chunks per rank: set strategy.virtual_stages=2.")
    if virtual_stages < 1:
        raise ConfigError(f"strategy.virtual_stages={virtual_stages} must be at least 1.")
    n_chunks = pipeline_parallel_size * virtual_stages
    if stage_layers is not None:
        if len(stage_layers) != n_chunks or sum(stage_layers) != config.n_layers or min(stage_layers) < 1:
            raise ConfigError(
                f"strategy.stage_layers={list(stage_layers)} must give at least one layer to each of the {n_chunks} stage "
                f"chunks (pipeline_parallel_size={pipeline_parallel_size} x virtual_stages={virtual_stages}) and sum to "
                f"model.n_layers={config.n_layers}; or leave it null for a balanced split."
            )
    elif config.n_layers < n_chunks:
        raise ConfigError(
            f"model.n_layers={config.n_layers} is fewer than the {n_chunks} pipeline stage chunks (pipeline_parallel_size="
            f"{pipeline_parallel_size} x virtual_stages={virtual_stages}): each chunk needs at least one layer. "
            "Lower strategy.pipeline_parallel_size or strategy.virtual_stages."
        )
    if config.tie_embeddings and n_chunks > 1:
        raise ConfigError(
            "model.tie_embeddings=true is not supported with pipeline parallelism (the embedding and the output head "
            "live on different stages): set model.tie_embeddings=false."
        )
    needs = {"1f1b": pipeline_parallel_size}.get(schedule, 1)
    if n_microbatches < needs:
        raise ConfigError(
            f"strategy.schedule={schedule} needs at least {needs} microbatches per step (one per stage), but gets "
            f"{n_microbatches}: raise strategy.n_microbatches (or lower micro_batch_size), or choose strategy.schedule=gpipe."
        )
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, n_microbatches // pipeline_parallel_size)
        if n_microbatches % rounds:
            raise ConfigError(
                f"strategy.schedule={schedule} runs microbatches in rounds of pipeline_parallel_size={pipeline_parallel_size}: "
                f"{n_microbatches} microbatches are not a whole number of rounds. Choose a multiple of "
                f"{pipeline_parallel_size}, or fewer microbatches than that."
            )
    if schedule in SPLIT_BACKWARD and (data_parallel_size > 1 or tensor_parallel_size > 1 or param_dtype is not None):
        raise ConfigError(
            f"strategy.schedule={schedule} splits each backward pass into input and weight gradients, which torch 2.13 "
            "gets wrong for FSDP2-sharded stages and cannot run with tensor parallelism: with it, set "
            "strategy.data_parallel_size=1, strategy.tensor_parallel_size=1 and strategy.param_dtype=null "
            "(trainer.precision=bf16-mixed still computes in bfloat16), or choose interleaved_1f1b or 1f1b."
        )
    if compile and schedule in SPLIT_BACKWARD:
        raise ConfigError(
            f"strategy.schedule={schedule} splits the backward pass into input and weight parts, which torch.compile'd "
            "blocks do not support: set strategy.compile=false or choose another schedule."
        )


class LlamaStage(nn.Module):
    """One chunk of a Llama: consecutive blocks, plus the embedding (first chunk) or the final norm
    and output head (last chunk). It shares these modules with the model, which stays their owner:
    parameter names, the optimizer and checkpoints all go through the model.

    forward(x, seq_len, document_ids=None): x is the tokens on the first chunk and the previous
    chunk's hidden states elsewhere; the result is hidden states, or logits on the last chunk.
    """

    def __init__(self, model: Llama, layer_ids: Sequence[int], first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.run_layers = model.run_layers  # a bound method: the model is not registered as a submodule

    def forward(self, x: torch.Tensor, seq_len: int, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        h = self.run_layers(h, self.layers.values(), seq_len, document_ids)
        return self.output(self.norm(h)) if self.output is not None else h


def split_into_stages(
    model: Llama, pipeline_rank: int, pipeline_parallel_size: int, schedule: str, virtual_stages: int, stage_layers: Sequence[int] | None = None
) -> dict[int, LlamaStage]:
    """This rank's chunks by stage index; `model` is pruned to them, so it holds nothing else."""
    n_chunks = pipeline_parallel_size * virtual_stages
    counts = stage_layer_counts(model.config.n_layers, n_chunks, stage_layers)
    starts = [sum(counts[:s]) for s in range(n_chunks)]
    ranks = chunk_ranks(schedule, pipeline_parallel_size, n_chunks)
    mine = [s for s in range(n_chunks) if ranks[s] == pipeline_rank]
    chunks = {
        s: LlamaStage(model, range(starts[s], starts[s] + counts[s]), first=s == 0, last=s == n_chunks - 1) for s in mine
    }
    kept = {name for chunk in chunks.values() for name in chunk.layers}
    for name in [name for name in model.layers if name not in kept]:
        del model.layers[name]
    if 0 not in chunks:
        model.tok_embeddings = None
    if n_chunks - 1 not in chunks:
        model.norm = model.output = None
    return chunks


def build_schedule(
    chunks: dict[int, nn.Module],
    n_chunks: int,
    group: ProcessGroup,
    device: torch.device,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    """torch's schedule over this rank's chunks. `loss_fn` returns a microbatch's mean loss; the
    schedule divides the accumulated gradients by the number of microbatches, so they are those of
    the mean over the whole batch."""
    stages = [PipelineStage(chunk, index, n_chunks, device, group=group) for index, chunk in sorted(chunks.items())]
    cls = SCHEDULES[schedule]
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)

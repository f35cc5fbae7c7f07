"""Pipeline layouts as arithmetic: which schedules exist, how blocks are cut into stage chunks and
placed on ranks, and which settings cannot be built. No torch here, so settings are checked
(project.config.checks) before anything heavy is imported; project.parallel.pipeline builds the stages.
"""

from __future__ import annotations

from typing import Sequence

from project.model.config import LlamaConfig
from project.parallel.mesh import MeshShape
from project.runtime.errors import ConfigError

# torch.distributed.pipelining's schedules by their setting name (project.parallel.pipeline maps
# them to classes); the single-stage ones run one chunk per rank.
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv")
SINGLE_STAGE = {"gpipe", "1f1b"}
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
    pipeline_parallel_size, data_parallel_size = shape.pipeline_parallel, shape.data_parallel
    tensor_parallel_size = shape.tensor_parallel
    if schedule not in SCHEDULE_NAMES:
        raise ConfigError(f"strategy.schedule={schedule!r}: choose one of {list(SCHEDULE_NAMES)}.")
    if schedule in SINGLE_STAGE and virtual_stages != 1:
        raise ConfigError(
            f"strategy.schedule={schedule} runs one stage chunk per rank, not "
            f"strategy.virtual_stages={virtual_stages}: set strategy.virtual_stages=1, or choose interleaved_1f1b, "
            "looped_bfs, interleaved_zero_bubble or zbv."
        )
    if schedule in V_SHAPED and virtual_stages != 2:
        raise ConfigError(
            f"strategy.schedule={schedule} needs exactly 2 stage chunks per rank: set strategy.virtual_stages=2."
        )
    if virtual_stages < 1:
        raise ConfigError(f"strategy.virtual_stages={virtual_stages} must be at least 1.")
    n_chunks = pipeline_parallel_size * virtual_stages
    if stage_layers is not None:
        if len(stage_layers) != n_chunks or sum(stage_layers) != config.n_layers or min(stage_layers) < 1:
            raise ConfigError(
                f"strategy.stage_layers={list(stage_layers)} must give at least one layer to each of the {n_chunks} "
                f"stage chunks (pipeline_parallel_size={pipeline_parallel_size} x virtual_stages={virtual_stages}) and "
                f"sum to model.n_layers={config.n_layers}; or leave it null for a balanced split."
            )
    elif config.n_layers < n_chunks:
        raise ConfigError(
            f"model.n_layers={config.n_layers} is fewer than the {n_chunks} pipeline stage chunks "
            f"(pipeline_parallel_size={pipeline_parallel_size} x virtual_stages={virtual_stages}): each chunk needs at "
            "least one layer. Lower strategy.pipeline_parallel_size or strategy.virtual_stages."
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
            f"{n_microbatches}: raise strategy.n_microbatches (or lower micro_batch_size), or choose "
            "strategy.schedule=gpipe."
        )
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, n_microbatches // pipeline_parallel_size)
        if n_microbatches % rounds:
            raise ConfigError(
                f"strategy.schedule={schedule} runs microbatches in rounds of "
                f"pipeline_parallel_size={pipeline_parallel_size}: {n_microbatches} microbatches are not a whole "
                f"number of rounds. Choose a multiple of {pipeline_parallel_size}, or fewer microbatches than that."
            )
    sharded = data_parallel_size * shape.context_parallel > 1  # FSDP2 over data x context in each stage
    if schedule in SPLIT_BACKWARD and (sharded or tensor_parallel_size > 1 or param_dtype is not None):
        raise ConfigError(
            f"strategy.schedule={schedule} splits each backward pass into input and weight gradients, which torch 2.13 "
            "gets wrong for FSDP2-sharded stages and cannot run with tensor parallelism: with it, set "
            "strategy.data_parallel_size=1, strategy.context_parallel_size=1, strategy.tensor_parallel_size=1 and "
            "strategy.param_dtype=null "
            "(trainer.precision=bf16-mixed still computes in bfloat16), or choose interleaved_1f1b or 1f1b."
        )
    if compile and schedule in SPLIT_BACKWARD:
        raise ConfigError(
            f"strategy.schedule={schedule} splits the backward pass into input and weight parts, which torch.compile'd "
            "blocks do not support: set strategy.compile=false or choose another schedule."
        )

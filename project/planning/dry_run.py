"""Dry run: a cluster-size job checked and sharded on this one CPU, before it waits a day in a queue.

`python -m project.train ... dry_run=true` runs every check a real start makes (project.config.checks, the
strategy's constructor, Lightning's reading of trainer.precision), then, for a few representative ranks,
builds the model on the meta device and shards it with the strategy's own `shard` (the part of
`parallelize` before memory is given) on torch's fake process group of the job's full world size, where
collectives do nothing. What each rank would hold is read off the sharded model: nothing is allocated,
nothing trains, and only the report (dry_run.json in the run directory) is written.

Strategies that do not shard (ddp) hold a full replica.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from project.config.callbacks import check_callback_arguments
from project.config.checks import local_shards_differ
from project.config.data import data_on_this_machine
from project.config.layout import Layout
from project.config.trainer import check_trainer_arguments
from project.config.values import model_config
from project.data.shards import MANIFEST_NAME
from project.parallel.mesh import MeshShape
from project.parallel.pipeline_layout import chunk_ranks, default_virtual_stages
from project.planning.parameters import INIT_VALUES_PER_SECOND
from project.planning.placement import group_spans, placement_line
from project.runtime.errors import ConfigError

GIB = 2**30
# Parameter storage by trainer.precision: "-mixed" keeps float32 parameters and computes in 16 bits.
STORAGE_DTYPES = {"bf16-true": "bfloat16", "16-true": "float16", "64-true": "float64"}
ADAM_STEP_BYTES = 4  # AdamW's step count: one float32 scalar per parameter tensor


def dry_run_argv(argv: Sequence[str]) -> list[str]:
    """`dry_run=true|false` on the command line means `dry_run.enabled=...`: Hydra cannot set a group of
    settings (dry_run.ranks, ...) from one value."""
    return [
        f"dry_run.enabled={a.split('=', 1)[1]}" if a.split("=", 1)[0] in ("dry_run", "+dry_run") and "=" in a else a
        for a in argv
    ]


@dataclass
class RankShare:
    """What one rank holds: its mesh coordinates, stage chunks, and bytes of model state."""

    rank: int
    pipeline: int
    data_parallel: int
    tensor_parallel: int
    stages: list[str]  # "chunk 0: layers 0-9, embedding"; [] without a pipeline
    parameters: int  # elements of this rank's parameter shards
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: (
        int  # AdamW's two moments and step counts; no separate master weights (parameters are stored as trained)
    )
    largest_tensor: str  # name, local shape and bytes of the largest single parameter shard
    largest_bytes: int
    context_parallel: int = 0  # the rank's place in its context-parallel group

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def init_seconds(share: RankShare) -> float:
    """The estimated seconds `share`'s rank spends drawing its initial values (none when resuming a checkpoint)."""
    return share.parameters / INIT_VALUES_PER_SECOND


def representative_ranks(shape: MeshShape, last_stage: int) -> list[int]:
    """The first rank; the first rank of the stage holding the last chunk (output head); the last
    tensor-parallel and data-parallel (data x context: FSDP2's) ranks of the first stage (an uneven shard is the
    last one's); the last rank."""
    pp, shards, tp = shape.pipeline_parallel, shape.data_parallel * shape.context_parallel, shape.tensor_parallel
    picks = [(0, 0, 0), (last_stage, 0, 0), (0, 0, tp - 1), (0, shards - 1, 0), (pp - 1, shards - 1, tp - 1)]
    return sorted({shape.rank_at(pipeline=p, data_parallel=d, tensor=t) for p, d, t in picks})


def selected_ranks(setting: Any, shape: MeshShape, last_stage: int) -> list[int]:
    world = shape.world_size
    if setting == "representative":
        return representative_ranks(shape, last_stage)
    if setting == "all":
        return list(range(world))
    ranks = list(setting) if OmegaConf.is_list(setting) or isinstance(setting, (list, tuple)) else [setting]
    if not ranks or not all(isinstance(r, int) and 0 <= r < world for r in ranks):
        raise ConfigError(
            f"dry_run.ranks={setting}: choose representative, all, or a list of ranks from 0 to {world - 1} "
            f"(e.g. dry_run.ranks=[0,{world - 1}])."
        )
    return sorted(set(ranks))


def _tensor_line(name: str, shape: Sequence[int], nbytes: int) -> str:
    return (
        f"{name} {list(shape)} ({nbytes / GIB:.2f} GiB)"
        if nbytes >= GIB / 100
        else f"{name} {list(shape)} ({nbytes:,} bytes)"
    )


def _stage_lines(chunks: dict[int, Any], n_chunks: int) -> list[str]:
    lines = []
    for index, chunk in sorted(chunks.items()):
        layers = [int(name) for name in chunk.layers]
        extras = ["embedding"] * (index == 0) + ["norm and output head"] * (index == n_chunks - 1)
        lines.append(f"chunk {index}: layers {layers[0]}-{layers[-1]}" + "".join(f", {e}" for e in extras))
    return lines


def share_of(model: Any, rank: int, shape: MeshShape, stages: list[str]) -> RankShare:
    """Read a (sharded, meta) model's local parameters as MemoryMonitor reads a real run's."""
    from torch.distributed.tensor import DTensor

    from project.training.callbacks.memory import local_bytes

    params = list(model.parameters())
    param_bytes = local_bytes(params)
    local = [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()]
    name, largest = max(local, key=lambda item: item[1].numel() * item[1].element_size())
    nbytes = largest.numel() * largest.element_size()
    return RankShare(
        rank,
        *_coordinates(rank, shape),
        stages,
        parameters=sum(t.numel() for _, t in local),
        param_bytes=param_bytes,
        grad_bytes=param_bytes,  # gradients take their parameter's shard, shape and dtype
        optimizer_bytes=2 * param_bytes + ADAM_STEP_BYTES * len(params),
        largest_tensor=_tensor_line(name, largest.shape, nbytes),
        largest_bytes=nbytes,
        context_parallel=shape.coordinate(rank, "context"),
    )


def _coordinates(rank: int, shape: MeshShape) -> tuple[int, int, int]:
    """RankShare's (pipeline, data_parallel, tensor_parallel) of a global rank."""
    return shape.coordinate(rank, "pipeline"), shape.coordinate(rank, "data"), shape.coordinate(rank, "tensor")


def build_meta_model(cfg: DictConfig) -> Any:
    import torch

    from project.model.families import build_model

    with torch.device("meta"):
        model = build_model(model_config(cfg))
    dtype = STORAGE_DTYPES.get(str(cfg.trainer.get("precision", "32-true")))
    return model.to(getattr(torch, dtype)) if dtype else model


def shard_rank(cfg: DictConfig, shape: MeshShape, rank: int) -> RankShare:
    """Rank `rank`'s share, from the strategy's own `shard` on a fake process group of the full world."""
    import torch.distributed as dist
    from hydra.utils import instantiate
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's: collectives that do nothing

    from project.parallel.strategies.pipeline import LlamaPipelineStrategy

    strategy = instantiate(cfg.strategy, _convert_="all")
    pipeline = isinstance(strategy, LlamaPipelineStrategy)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=shape.world_size)
    try:
        strategy.set_up_meshes(shape, "cpu")  # the meshes a run's setup_environment makes
        model = build_meta_model(cfg)
        strategy.shard(model)
        n_chunks = shape.pipeline_parallel * strategy.virtual_stages if pipeline else 1
        return share_of(model, rank, shape, _stage_lines(strategy.stage_chunks, n_chunks) if pipeline else [])
    finally:
        dist.destroy_process_group()


def replica_share(cfg: DictConfig, shape: MeshShape, rank: int) -> RankShare:
    """DDP: every rank holds the whole model."""
    return share_of(build_meta_model(cfg), rank, shape, [])


def _kind(strategy: Any) -> str:
    from project.parallel.strategies.model_parallel import LlamaParallelStrategy

    return "sharded" if isinstance(strategy, LlamaParallelStrategy) else "replica"  # the pipeline's and fsdp's too


def how_shared(cfg: DictConfig) -> str:
    from hydra.utils import instantiate

    strategy = instantiate(cfg.strategy, _convert_="all")
    return {
        "sharded": f"{type(strategy).__name__}.shard on a fake process group of the job's size",
        "replica": "a full replica on every rank",
    }[_kind(strategy)]


def rank_share(cfg: DictConfig, layout: Layout, rank: int) -> RankShare:
    """What global rank `rank` of the run `cfg` describes holds, by the strategy's kind."""
    from hydra.utils import instantiate

    kind = _kind(instantiate(cfg.strategy, _convert_="all"))
    if kind == "sharded":
        return shard_rank(cfg, layout.shape, rank)
    return replica_share(cfg, layout.shape, rank)


def check_checkpoint_resumable(cfg: DictConfig, run_dir: Path) -> None:
    """The checkpoint to resume from holds a model of this run's shape, as a real start checks before it loads."""
    from project.config.checkpoints import checkpoint_dir, resume_point

    if (ckpt_path := resume_point(cfg, run_dir)) is None:  # ckpt_path=auto decided as a real start decides it
        return
    from project.checkpoint.files import checkpoint_metadata, resolve_ckpt_path
    from project.data.datamodule import tokenizer_identity
    from project.training.lit_module import check_resumable

    path = resolve_ckpt_path(str(ckpt_path), checkpoint_dir(cfg, run_dir))  # as a real start finds it
    local_shards = (
        not cfg.data.get("mix") and (Path(str(cfg.data.dir)) / MANIFEST_NAME).is_file() and not unchecked_shards(cfg)
    )
    tokenizer = tokenizer_identity(str(cfg.data.dir)) if local_shards else None  # shards elsewhere: a real start checks
    check_resumable(
        checkpoint_metadata(path), OmegaConf.to_container(cfg.model, resolve=True), tokenizer, path, cfg.data.dir
    )


def unchecked_shards(cfg: DictConfig) -> str | None:
    """Why the dry run has not checked the shards data.dir names, said as the job's machine would need to know it;
    None where it has, as a real start would (project.config.checks.dry_run_reads_shards_here)."""
    if not data_on_this_machine(cfg):
        return f"data.dir={cfg.data.dir} is not on this machine"
    if differences := local_shards_differ(cfg):
        return (
            f"data.dir={cfg.data.dir} here holds shards prepared from other data settings ({'; '.join(differences)}), "
            "not the job's, which it must find prepared from its own where it runs (a start on this machine would "
            "refuse these)"
        )
    return None


def dry_run(cfg: DictConfig, layout: Layout | None, strategy_name: str, run_dir: Path) -> list[RankShare]:
    """Shard the representative ranks (or dry_run.ranks), print what each holds, write dry_run.json."""
    if layout is None:
        raise ConfigError(
            "dry_run=true needs the job's size: set trainer.num_nodes and trainer.devices (devices per node), "
            "e.g. trainer.num_nodes=8 trainer.devices=8 for 64 GPUs."
        )
    check_trainer_arguments(cfg)  # trainer.precision: checked with the settings (check_trainer)
    check_callback_arguments(cfg)  # as a real start's Trainer checks them, building none
    check_checkpoint_resumable(cfg, run_dir)
    shape = layout.shape
    schedule = cfg.strategy.get("schedule", "1f1b")
    virtual = cfg.strategy.get("virtual_stages") or default_virtual_stages(schedule)
    last_stage = (
        chunk_ranks(schedule, shape.pipeline_parallel, shape.pipeline_parallel * virtual)[-1]
        if shape.pipeline_parallel > 1
        else 0
    )
    ranks = selected_ranks(cfg.dry_run.ranks, shape, last_stage)
    how = how_shared(cfg)  # the strategy's constructor runs its own checks here, as at a real start
    shares = [rank_share(cfg, layout, rank) for rank in ranks]
    # Offloaded states live in host memory: held against the device's, they would say nothing.
    memory = None if cfg.strategy.get("cpu_offload") else _cluster_memory(cfg)
    planned = {s.pipeline: planned_memory(cfg, layout, strategy_name, s.pipeline) for s in shares} if memory else {}
    about_model, model_record = model_lines(cfg, layout, strategy_name)
    print(render(cfg, layout, strategy_name, how, shares, memory, planned, about_model))
    record = {
        "strategy": strategy_name,
        "how": how,
        "world_size": layout.shape.world_size,
        "mesh": {
            "pipeline": layout.shape.pipeline_parallel,
            "data_parallel": layout.shape.data_parallel,
            "context_parallel": layout.shape.context_parallel,
            "tensor_parallel": layout.shape.tensor_parallel,
            "expert_parallel": layout.shape.expert_parallel,
            "data_parallel_shard": layout.shape.shard_ranks,
        },
        # Each kind of process group: its ranks, and the most nodes one of them spans (project.planning.placement).
        "groups": [span._asdict() for span in group_spans(layout.shape, cfg.trainer.devices)],
        "batch": {
            "global": layout.plan.global_batch_size,
            "micro": layout.plan.micro_batch_size,
            "accumulation": layout.plan.accumulate_grad_batches,
            "pipeline_microbatches": layout.plan.pipeline_microbatches,
        },
        "model_parameters": sum(p.numel() for p in build_meta_model(cfg).parameters()),
        # Whether the shards data.dir names were checked here, and why not where they were not.
        "data": {"dir": str(cfg.data.dir), "unchecked": unchecked_shards(cfg)},
        "model": model_record,
        "device_memory_bytes": memory[1] if memory else None,
        "ranks": [
            {
                **asdict(s),
                "state_bytes": s.state_bytes,
                "init_seconds": round(init_seconds(s), 1),
                "planned": _planned_record(planned.get(s.pipeline), s),
            }
            for s in shares
        ],
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "dry_run.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {run_dir / 'dry_run.json'}")
    return shares


def planned_memory(
    cfg: DictConfig, layout: Layout, strategy_name: str, pipeline_rank: int, allowance: Any = None
) -> Any | None:
    """The planner's estimate of the whole memory of a rank of this layout (project.planning.memory:
    activations, working copies and an allowance besides the model states), where it models the strategy;
    `allowance`: the planner's default where None."""
    from project.planning.memory import Allowance, estimate_memory

    candidate = planned_candidate(cfg, layout, strategy_name)
    if candidate is None or cfg.strategy.get("cpu_offload"):  # states in host memory: the planner counts them on
        return None  # the device
    precision = str(cfg.trainer.get("precision", "32-true"))
    accelerator = "gpu" if cfg.strategy.get("compile") else "cpu"  # the planner counts compiled (fused) blocks on GPUs
    estimate = estimate_memory(
        model_config(cfg),
        candidate,
        int(cfg.data.seq_len),
        precision,
        accelerator,
        allowance or Allowance(),
        pipeline_rank,
    )
    if strategy_name == "single":  # planned as DDP, whose gradient buckets (a copy of the parameters) it has not
        estimate = replace(estimate, working=estimate.working - estimate.params, working_note="")
    return estimate


def planned_candidate(cfg: DictConfig, layout: Layout, strategy_name: str) -> Any | None:
    """This job as the planner's candidate layout (project.planning.candidates), where the planner models it."""
    from project.planning.candidates import STRATEGIES, Candidate
    from project.planning.memory import STORAGE_BYTES

    s, plan = cfg.strategy, layout.plan
    pp, dp, tp = layout.shape.pipeline_parallel, layout.shape.data_parallel, layout.shape.tensor_parallel
    name = "ddp" if strategy_name == "single" else strategy_name
    precision = str(cfg.trainer.get("precision", "32-true"))
    if name == "fsdp" and s.get("sharding_strategy") != "SHARD_GRAD_OP":  # the planner's fsdp is that one (ZeRO-2)
        name = "fsdp2"  # the others are FSDP2's own layouts: their shard groups are the layout's (mesh_settings)
    if name not in STRATEGIES or precision not in STORAGE_BYTES:
        return None
    schedule = s.get("schedule") if pp > 1 else None
    return Candidate(
        name,
        dp,
        tp,
        pp,
        plan.micro_batch_size,
        max(plan.accumulate_grad_batches, plan.pipeline_microbatches),
        recompute="full" if s.get("activation_checkpointing") else "none" if cfg.document_mask else "selective",
        sequence_parallel=bool(s.get("sequence_parallel")) and tp > 1,
        schedule=schedule,
        virtual_stages=(s.get("virtual_stages") or default_virtual_stages(schedule)) if schedule else 1,
        context_parallel=layout.shape.context_parallel,
        regather_kv=bool(s.get("regather_kv")) and layout.shape.context_parallel > 1,
        float8=s.get("float8"),
        expert_parallel=layout.shape.expert_parallel,
        data_shard=layout.shape.data_shard,
        gradient_sync=s.get("gradient_sync", "every_micro_batch"),
        context_parallel_kv=s.get("context_parallel_kv", "gather"),
        # strategy=fsdp's SHARD_GRAD_OP, the planner's fsdp, keeps the parameters gathered as this setting does.
        reshard_after_forward=bool(s.get("reshard_after_forward", True)) and name != "fsdp",
    )


def model_lines(cfg: DictConfig, layout: Layout, strategy_name: str) -> tuple[list[str], dict[str, Any]]:
    """The model's size; with strategy.float8, what trains in float8 (float8_line); for a mixture under tensor
    parallelism, each rank's share of every expert (split_experts_line); for a mixture of experts split
    over ranks, how: what each rank holds of each mixture and the all-to-alls' bytes a step (the planner's count,
    project.planning.communication; held to measured runs in tests/test_comms.py), and their seconds on the cluster
    where one is given. The lines and their record."""
    from project.model.flops import count_parameters, parameter_counts

    config = model_config(cfg)
    total, active = count_parameters(config), count_parameters(config, active=True)
    said = f"model: {parameter_counts(config)}"
    if active < total:
        said += " (a token's forward uses the active: FLOPs and MFU count them)"
    lines, record = [said], {"parameters": total, "active_parameters": active}
    candidate = planned_candidate(cfg, layout, strategy_name)
    precision = str(cfg.trainer.get("precision", "32-true"))
    if candidate is not None and candidate.float8:
        said, record["float8"] = float8_line(config, candidate, precision)
        lines.append(said)
    ep, pp, tp = layout.shape.expert_parallel, layout.shape.pipeline_parallel, layout.shape.tensor_parallel
    mixture = next((m for i in range(config.n_layers) if (m := config.mixture(i)) is not None), None)
    if mixture is not None and tp > 1 and candidate is not None:
        said, record["tensor_parallel_experts"] = split_experts_line(config, candidate, cfg, precision, mixture)
        lines.append(said)
    if ep == 1 or candidate is None:
        return lines, record
    from project.planning.communication import expert_parallel
    from project.planning.step_time import seconds

    microbatches = candidate.microbatches
    # The pipeline rank whose stage holds the most mixtures sends the most (every rank of a stage alike).
    by_stage = [expert_parallel(config, candidate, int(cfg.data.seq_len), precision, rank) for rank in range(pp)]
    sent = max(by_stage, key=lambda collectives: sum(c.bytes for c in collectives))
    step_bytes = sum(c.bytes for c in sent) * microbatches
    calls = sum(c.calls for c in sent) * microbatches
    # Expert parallelism is refused for a family without experts.
    experts = next(m.experts for i in range(config.n_layers) if (m := config.mixture(i)) is not None)
    said = (
        f"experts: each mixture's {experts} split over the {ep} ranks of an expert group ({experts // ep} each); "
        f"all-to-alls of {step_bytes / GIB:.2f} GiB per rank a step in {calls:.0f} calls"
        f"{' on the busiest stage' if pp > 1 else ''} (the planner's count, routing spread evenly)"
    )
    record |= {"expert_parallel": ep, "all_to_all_bytes_per_step": step_bytes, "all_to_all_calls_per_step": calls}
    cluster = _cluster(cfg)
    if cluster is not None:
        taken = seconds(sent, cluster) * microbatches
        said += f", about {taken:.2f} s of each step on {cluster.name}'s links"
        record["all_to_all_seconds_per_step"] = taken
    return [*lines, said], record


def split_experts_line(
    config: Any, candidate: Any, cfg: DictConfig, precision: str, mixture: Any
) -> tuple[str, dict[str, Any]]:
    """Under tensor parallelism, what each rank holds of every expert (its share of the hidden units) and the
    all-reduces of the routed results over the group a step (the planner's count, on the busiest stage). The line
    and its record."""
    from project.planning.communication import routed_reductions

    tp, seq_len = candidate.tensor_parallel, int(cfg.data.seq_len)
    stages = range(candidate.pipeline_parallel)
    calls, sent = max((routed_reductions(config, candidate, seq_len, precision, r) for r in stages), key=lambda x: x[1])
    step_bytes, step_calls = sent * candidate.microbatches, calls * candidate.microbatches
    said = (
        f"experts: each expert's {mixture.width} hidden units split over the {tp} tensor-parallel ranks "
        f"({mixture.width // tp} each; the router whole on every rank); the routed results all-reduced over them: "
        f"{step_bytes / GIB:.2f} GiB per rank a step in {step_calls} calls"
        f"{' on the busiest stage' if candidate.pipeline_parallel > 1 else ''} (the planner's count)"
    )
    record = {"hidden_units_per_rank": mixture.width // tp, "all_reduce_bytes_per_step": step_bytes}
    return said, record


def float8_line(config: Any, candidate: Any, precision: str) -> tuple[str, dict[str, Any]]:
    """What strategy.float8 converts (the planner's rule, project.planning.parameters.float8_weights, which
    project.parallel.float8 applies) and, where FSDP2 gathers the float8 weights as float8, the all-gathers' bytes
    a step with and without it (rank 0's, the planner's count). The line and its record."""
    from project.parallel.float8_rules import block_projections, in_float8
    from project.planning.communication import data_parallel, float8_gathers
    from project.planning.parameters import block_weights, float8_weights

    blocks, tp = range(config.n_layers), candidate.tensor_parallel
    taken = sum(sum(float8_weights(config, candidate, i)) for i in blocks)
    matrices = sum(sum(w.cols > 1 for w in block_weights(config, i)) for i in blocks)
    kept = [name for name in block_projections(config, tp) if name not in in_float8(config, tp)]
    said = f"float8: {candidate.float8} on {taken} of the blocks' {matrices} weight matrices; kept in {precision}: "
    if kept:
        said += f"{', '.join(kept)} (a side not a multiple of 16 on a rank), "
    if any(config.mixture(i) is not None for i in blocks):
        said += "a mixture's router and experts, "
    said += "the embedding and the output head"
    record: dict[str, Any] = {"recipe": candidate.float8, "float8_matrices": taken, "block_matrices": matrices}
    record["kept"] = kept
    if float8_gathers(candidate):

        def gathered(c: Any) -> float:
            return sum(x.bytes for x in data_parallel(config, c, precision) if x.kind == "all_gather")

        with_float8, without = gathered(candidate), gathered(replace(candidate, float8=None))
        said += (
            f"; FSDP2 gathers them as float8: {with_float8 / GIB:.2f} GiB of all-gathers per rank a step, "
            f"{without / GIB:.2f} GiB without float8 (the planner's count)"
        )
        record |= {"all_gather_bytes_per_step": with_float8, "all_gather_bytes_without_float8": without}
    return said, record


def _planned_record(estimate: Any | None, share: RankShare) -> dict[str, float] | None:
    """The planner's parts beside the dry run's model states, and their sum: this rank's memory as planned."""
    if estimate is None:
        return None
    parts = {"activations": estimate.activations, "working": estimate.working, "allowance": estimate.overhead}
    return {**parts, "total_bytes": share.state_bytes + sum(parts.values())}


def _cluster(cfg: DictConfig) -> Any | None:
    if cfg.get("cluster") is None:
        return None
    from project.planning.cluster import Cluster

    return Cluster.from_config(OmegaConf.to_container(cfg.cluster, resolve=True))


def _cluster_memory(cfg: DictConfig) -> tuple[str, float] | None:
    cluster = _cluster(cfg)
    return None if cluster is None else (cluster.name, cluster.memory_bytes)


def render(
    cfg: DictConfig,
    layout: Layout,
    strategy_name: str,
    how: str,
    shares: list[RankShare],
    memory: tuple[str, float] | None,
    planned: dict[int, Any],
    about_model: Sequence[str] = (),
) -> str:
    dp, cp, plan = layout.shape.data_parallel, layout.shape.context_parallel, layout.plan
    lines = [
        f"dry run: strategy={strategy_name} on {layout.shape.world_size} devices ({cfg.trainer.num_nodes} node(s) x "
        f"{cfg.trainer.devices}), mesh {layout.shape.describe()}; "
        f"batch: global {plan.global_batch_size} "
        f"= micro {plan.micro_batch_size} x {max(plan.accumulate_grad_batches, plan.pipeline_microbatches)} x {dp} "
        f"replicas; precision {cfg.trainer.get('precision', '32-true')}",
        *filter(None, [placement_line(layout.shape, cfg.trainer.devices)]),
        f"shares: {how}. Every check of a real start passed"
        + (f", but the shards': {unchecked}." if (unchecked := unchecked_shards(cfg)) else "."),
        "Parameters are held as trained (float32 under -mixed precision, which casts copies for compute): "
        "no separate master weights.",
        *about_model,
        "",
        *([f"Context parallelism: the states are sharded over data x context ({dp * cp} ranks)."] if cp > 1 else []),
        f"{'rank':>6} {'pp':>3} {'dp':>4}"
        + (f" {'cp':>3}" if cp > 1 else "")
        + f" {'tp':>3} {'parameters':>12} {'params':>10} {'grads':>10} {'AdamW':>10} {'states':>10}  largest tensor",
    ]
    for s in shares:
        gib = [f"{b / GIB:.2f} GiB" for b in (s.param_bytes, s.grad_bytes, s.optimizer_bytes, s.state_bytes)]
        data = f"{s.data_parallel:>4}" + (f" {s.context_parallel:>3}" if cp > 1 else "")
        lines.append(
            f"{s.rank:>6} {s.pipeline:>3} {data} {s.tensor_parallel:>3} {s.parameters / 1e9:>11.4f}B "
            f"{gib[0]:>10} {gib[1]:>10} {gib[2]:>10} {gib[3]:>10}  {s.largest_tensor}"
        )
        for stage in s.stages:
            lines.append(f"{'':>30}{stage}")
    slowest = max(shares, key=init_seconds)
    lines += [
        "",
        f"initialization: each rank draws only its shard's initial values; rank {slowest.rank}'s "
        f"{slowest.parameters / 1e9:.2f}B take about {init_seconds(slowest):.0f} s at "
        f"{INIT_VALUES_PER_SECOND / 1e6:.0f}M values/s on one CPU core (none when resuming a checkpoint)",
    ]
    if cfg.strategy.get("cpu_offload"):
        lines += [
            "",
            "memory: the model states live in host memory (strategy.cpu_offload): the device's is not estimated",
        ]
    if memory:
        name, capacity = memory
        lines += [
            "",
            f"against {name}'s {capacity / GIB:.1f} GiB per device (activations, working copies and allowance: "
            "the planner's estimate for this layout):",
        ]
        for s in shares:
            estimate = planned.get(s.pipeline)
            rest = estimate.total - estimate.states if estimate else 0.0
            total = s.state_bytes + rest
            left = capacity - total
            parts = f"model states {s.state_bytes / GIB:.1f}" + (
                f" + activations {estimate.activations / GIB:.1f} + working copies {estimate.working / GIB:.1f}"
                f" + allowance {estimate.overhead / GIB:.1f}"
                f" = {total / GIB:.1f} GiB"
                if estimate
                else " GiB (no estimate of the rest for this strategy)"
            )
            verdict = (
                f"fits, {left / GIB:.1f} GiB to spare" if left > 0 else f"does not fit: {-left / GIB:.1f} GiB over"
            )
            lines.append(f"rank {s.rank}: {parts} ({total / capacity:.0%}): {verdict}")
    return "\n".join(lines)

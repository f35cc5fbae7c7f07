"""The planner's answers as a person or a script reads them: a table, the best layout as `project.train`
overrides, a wandb sweep spec over the top layouts, JSON."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import yaml

from project.planning.candidates import HAS_CHECKPOINTING, HAS_COMPILE, HAS_SEQUENCE_PARALLEL, Candidate
from project.planning.cluster import GIB, Cluster
from project.planning.planner import Outcome, Workload


def model_arguments(name: str | None, fields: dict[str, Any]) -> list[str]:
    """`model=NAME` for a preset as it is, else every field of the model (a preset changed, or none)."""
    if name:
        return [f"model={name}"]
    return [
        f"model.{key}={json.dumps(value) if not isinstance(value, str) else value}"
        for key, value in fields.items()
        if value is not None
    ]


def train_overrides(candidate: Candidate, workload: Workload, cluster: Cluster, model: list[str]) -> list[str]:
    """`project.train` arguments that run `candidate` on `cluster` as the planner assumed it; `model`:
    model_arguments()."""
    c = candidate
    out = [*model]
    out += [
        f"trainer={cluster.accelerator}",
        f"trainer.num_nodes={cluster.nodes}",
        f"trainer.devices={cluster.gpus_per_node}",
        f"trainer.precision={workload.precision}",
        f"data.seq_len={workload.seq_len}",
        f"global_batch_size={workload.global_batch_size}",
        f"micro_batch_size={c.micro_batch_size}",
        f"strategy={c.strategy}",
    ]
    if c.strategy == "fsdp":
        out.append("strategy.sharding_strategy=SHARD_GRAD_OP")
    if c.context_parallel > 1:
        out.append(f"strategy.context_parallel_size={c.context_parallel}")
        if c.regather_kv:
            out.append("strategy.regather_kv=true")
        if c.context_parallel_kv == "ring":
            out.append("strategy.context_parallel_kv=ring")
    if c.expert_parallel > 1:
        out.append(f"strategy.expert_parallel_size={c.expert_parallel}")
    if c.data_shard:
        out.append(f"strategy.data_parallel_shard_size={c.data_shard}")
    if c.gradient_sync != "every_micro_batch":
        out.append(f"strategy.gradient_sync={c.gradient_sync}")
    if not c.reshard_after_forward and c.strategy in ("fsdp2", "tp_fsdp"):
        out.append("strategy.reshard_after_forward=false")
    if c.strategy in ("tp", "tp_fsdp", "pipeline"):
        out.append(f"strategy.tensor_parallel_size={c.tensor_parallel}")
    if c.strategy == "pipeline":
        out += [
            f"strategy.pipeline_parallel_size={c.pipeline_parallel}",
            f"strategy.data_parallel_size={c.data_parallel}",
            f"strategy.schedule={c.schedule}",
            f"strategy.virtual_stages={c.virtual_stages}",
        ]
    if c.strategy in HAS_SEQUENCE_PARALLEL and c.tensor_parallel > 1:
        out.append(f"strategy.sequence_parallel={str(c.sequence_parallel).lower()}")
    if c.strategy in HAS_CHECKPOINTING:
        out.append(f"strategy.activation_checkpointing={str(c.recompute == 'full').lower()}")
    if c.strategy in HAS_COMPILE and cluster.accelerator == "gpu":
        out.append("strategy.compile=true")  # the activation count assumes compiled (fused) blocks
    if c.float8:
        out.append(f"strategy.float8={c.float8}")
    # FSDP2 gathers in bfloat16 under bf16-mixed by default (LlamaParallelStrategy.gather_dtype): nothing to add.
    return out


def table(outcomes: list[Outcome], limit: int) -> str:
    """The layouts that fit, fastest first, then those that do not (at most `limit` rows each)."""
    fitting = [o for o in outcomes if o.prediction.fits][:limit]
    other = [o for o in outcomes if not o.prediction.fits][: max(0, limit - len(fitting)) or 3]
    width = max(len(o.prediction.candidate.name) for o in fitting + other)
    head = (
        f"{'layout':<{width}} {'GiB/dev':>8} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} {'days':>9}  "
        f"{'bubble':>6}  note"
    )
    lines = [head, "-" * len(head)]
    for o in fitting + other:
        t = o.prediction.time
        note = "" if o.prediction.fits else o.prediction.reason
        lines.append(
            f"{o.prediction.candidate.name:<{width}} {o.prediction.memory.total / GIB:>8.1f} "
            f"{o.tokens_per_second:>11,.0f} {o.tflops_per_device:>8.3g} {o.mfu:>6.1%} {o.days:>9,.1f}  "
            f"{t.bubble / t.total:>6.1%}  {note}"
        )
    return "\n".join(lines)


def as_record(outcome: Outcome, overrides: list[str]) -> dict[str, Any]:
    p = outcome.prediction
    return {
        "layout": p.candidate.name,
        "candidate": vars(p.candidate),
        "fits": p.fits,
        "reason": p.reason,
        "memory_bytes": {
            **{k: getattr(p.memory, k) for k in ("params", "grads", "optimizer", "working", "activations", "overhead")},
            "total": p.memory.total,
        },
        "memory_pipeline_rank": p.memory.pipeline_rank,
        "step_seconds": {**vars(p.time), "total": p.time.total},
        "tokens_per_second": outcome.tokens_per_second,
        "tflops_per_device": outcome.tflops_per_device,
        "mfu": outcome.mfu,
        "days": outcome.days,
        "train_overrides": overrides,
    }


def sweep_spec(
    name: str, outcomes: list[Outcome], workload: Workload, cluster: Cluster, model: list[str], folder: Path
) -> dict[str, Any]:
    """A wandb sweep (experiments/sweeps/ format) over the top layouts: each layout is an experiment file in
    `folder`/experiment/, which the sweep's command adds to Hydra's search path."""
    experiments = folder / "experiment"
    experiments.mkdir(parents=True, exist_ok=True)
    names = []
    for o in outcomes:
        layout = o.prediction.candidate.name
        (experiments / f"{layout}.yaml").write_text(
            experiment_file(train_overrides(o.prediction.candidate, workload, cluster, model))
        )
        names.append(layout)
    return {
        "name": name,
        "description": f"the planner's top {len(names)} layouts of "
        f"{model[0].removeprefix('model=') if len(model) == 1 else 'the model'} on {cluster.devices} devices of "
        f"{cluster.name}",
        "program": "project/train.py",
        "project": "llama-pretrain",
        "method": "grid",
        "metric": {"name": "train/tokens_per_sec", "goal": "maximize"},
        "parameters": {"experiment": {"values": names}},
        "command": [
            "${env}",
            "${interpreter}",
            "-m",
            "project.train",
            f"hydra.searchpath=[file://{search_path(folder)}]",
            "logger=wandb",
            "hydra.run.dir=${paths.log_dir}/sweeps/${oc.env:WANDB_SWEEP_ID}/${oc.env:WANDB_RUN_ID}",
            "${args_no_hyphens}",
        ],
    }


# The project's root: where `python -m project.train` runs from, a sweep's agents included.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def search_path(folder: Path) -> str:
    """The plan's folder as the sweep's command finds it from the project's root (`outputs/plans/NAME`), so that a
    plan made on a laptop runs in the cluster's copy of the project; absolute only for a folder outside it."""
    folder = folder.resolve()
    return folder.relative_to(PROJECT_ROOT).as_posix() if folder.is_relative_to(PROJECT_ROOT) else folder.as_posix()


def experiment_file(overrides: list[str]) -> str:
    """An experiment config (conf/experiment/ format) that sets what `overrides` set."""
    groups = {"model", "trainer", "strategy"}
    defaults, values = [], {}
    for override in overrides:
        key, _, value = override.partition("=")
        if key in groups:
            defaults.append({f"override /{key}": value})
        else:
            node = values
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = yaml.safe_load(value)
    body = yaml.safe_dump({"defaults": defaults, **values}, sort_keys=False)
    return "# @package _global_\n# Written by project.plan: one layout of a planned sweep.\n" + body


def command_line(overrides: list[str]) -> str:
    return "python -m project.train " + " ".join(shlex.quote(o) for o in overrides)

"""Collectives measured per optimizer step and rank, beside the planner's: `python -m benchmarks.comms
[layouts=ddp,fsdp,...|all] [steps=4] [step=2] [node_size=2] [out=experiments/benchmarks]`

Each layout trains the debug model (dim 64, 4 layers under a pipeline, else 2; vocabulary 4,096, 256-token
sequences, batches of 8 in micro batches of 2, 32-true) for `steps` steps with `python -m project.train` on its
processes (2; 4 for tp_fsdp and the 2-D pipelines; 8 for 3-D) over gloo, counting on every rank the calls and bytes
of each kind of collective on each process group (benchmarks.count_collectives.CountCollectives). The table sets
step `step` (0-based) beside project.planning.communication's collectives for the same layout, model and batch: a
step after the first two (torch's pipeline exchanges shapes in the first, DDP rebuilds its buckets in the second)
and before the last, the one logging step (logging steps reduce the metrics, agree on a stop signal and save).
Calls, and bytes (each call's whole buffer: an all-gather's output, a reduce-scatter's input, an all-to-all's
input). A mixture of experts' all-to-alls carry what its router sends each rank: the planner counts an even spread,
which their sum over the ranks is (tests/test_comms.py holds that), not each rank's. Each rank's bytes are also
split into those on groups inside a node and on groups across nodes, `node_size` consecutive processes standing for
a node, beside the planner's split (a group whose consecutive ranks do not fit a node crosses). Writes new files
<date>-<host>-comms.{json,md}.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.runner import (
    ROOT,
    Benchmark,
    main,
    out_folder,
)
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError

DEFAULTS = {"layouts": "all", "steps": "4", "step": "2", "node_size": "2", "out": "experiments/benchmarks"}
GLOBAL_BATCH, MICRO_BATCH, PRECISION = 8, 2, "32-true"
PIPELINE = ("strategy=pipeline", "strategy.pipeline_parallel_size=2")
MOE, EP = ("model=moe_debug",), "strategy.expert_parallel_size"


@dataclass(frozen=True)
class Layout:
    """A layout as `project.train` overrides, and the same layout as the planner's Candidate describes it."""

    devices: int
    overrides: tuple[str, ...]
    strategy: str
    data_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    sequence_parallel: bool = False
    schedule: str | None = None
    virtual_stages: int = 1
    layers: int = 2
    float8: str | None = None
    model: str = "debug"  # the preset in conf/model
    expert_parallel: int = 1
    data_shard: int | None = None  # HSDP's shard groups (strategy.data_parallel_shard_size)
    gradient_sync: str = "every_micro_batch"
    context_parallel_kv: str = "gather"
    reshard_after_forward: bool = True
    micro_batch: int | None = None  # None: MICRO_BATCH, or the candidate's argument

    def candidate(self, global_batch: int = GLOBAL_BATCH, micro_batch: int = MICRO_BATCH):
        from project.planning.candidates import Candidate

        micro_batch = self.micro_batch or micro_batch
        microbatches = global_batch // self.data_parallel // micro_batch  # accumulated, or the pipeline's
        return Candidate(
            self.strategy, self.data_parallel, self.tensor_parallel, self.pipeline_parallel, micro_batch,
            microbatches, "selective", self.sequence_parallel, self.schedule, self.virtual_stages,
            self.context_parallel, float8=self.float8, expert_parallel=self.expert_parallel, data_shard=self.data_shard,
            gradient_sync=self.gradient_sync, context_parallel_kv=self.context_parallel_kv,
            reshard_after_forward=self.reshard_after_forward,
        )  # fmt: skip

    def pipeline_rank(self, rank: int) -> int:
        return self.candidate().shape.coordinate(rank, "pipeline")


def _pipeline(
    schedule: str, virtual_stages: int = 1, devices: int = 2, sequence_parallel: bool = False, **degrees: int
) -> Layout:
    """Two stages of 2 blocks each (chunks of one under virtual stages), with the other degrees given."""
    settings = [f"strategy.schedule={schedule}", f"strategy.virtual_stages={virtual_stages}"]
    settings += [f"strategy.{name}_size={degree}" for name, degree in degrees.items()]
    settings += ["strategy.sequence_parallel=true"] if sequence_parallel else []
    return Layout(
        devices, (*PIPELINE, *settings), "pipeline", pipeline_parallel=2, schedule=schedule,
        virtual_stages=virtual_stages, layers=4, sequence_parallel=sequence_parallel, **degrees,
    )  # fmt: skip


LAYOUTS = {
    "ddp": Layout(2, ("strategy=ddp",), "ddp", data_parallel=2),
    # strategy=fsdp's SHARD_GRAD_OP (the planner's fsdp): each block's parameters gathered for a micro batch's
    # forward and kept for its backward.
    "fsdp": Layout(
        2, ("strategy=fsdp", "strategy.sharding_strategy=SHARD_GRAD_OP", "micro_batch_size=1"), "fsdp",
        data_parallel=2, reshard_after_forward=False, micro_batch=1,
    ),
    "fsdp2": Layout(2, ("strategy=fsdp2",), "fsdp2", data_parallel=2),
    "tp": Layout(2, ("strategy=tp",), "tp", tensor_parallel=2),
    "tp-sp": Layout(
        2, ("strategy=tp", "strategy.sequence_parallel=true"), "tp", tensor_parallel=2, sequence_parallel=True
    ),
    "cp": Layout(2, ("strategy=fsdp2", "strategy.context_parallel_size=2"), "fsdp2", context_parallel=2),
    # Ring attention: keys and values passed around the context group (and their gradients, in the backward).
    "cp-ring": Layout(
        2, ("strategy=fsdp2", "strategy.context_parallel_size=2", "strategy.context_parallel_kv=ring"), "fsdp2",
        context_parallel=2, context_parallel_kv="ring",
    ),
    "cp4-ring": Layout(
        4, ("strategy=fsdp2", "strategy.context_parallel_size=4", "strategy.context_parallel_kv=ring"), "fsdp2",
        context_parallel=4, context_parallel_kv="ring",
    ),
    "fsdp2-float8": Layout(
        2, ("strategy=fsdp2", "strategy.float8=tensorwise"), "fsdp2", data_parallel=2, float8="tensorwise"
    ),
    "tp-float8": Layout(2, ("strategy=tp", "strategy.float8=tensorwise"), "tp", tensor_parallel=2, float8="tensorwise"),
    "pipeline-gpipe": _pipeline("gpipe"),
    "pipeline-1f1b": _pipeline("1f1b"),
    "pipeline-interleaved_1f1b": _pipeline("interleaved_1f1b", 2),
    "pipeline-looped_bfs": _pipeline("looped_bfs", 2),
    "pipeline-interleaved_zero_bubble": _pipeline("interleaved_zero_bubble", 2),
    "pipeline-zbv": _pipeline("zbv", 2),
    "tp_fsdp": Layout(4, ("strategy=tp_fsdp",), "tp_fsdp", data_parallel=2, tensor_parallel=2),
    "tp_fsdp-sp": Layout(
        4,
        ("strategy=tp_fsdp", "strategy.sequence_parallel=true"),
        "tp_fsdp",
        data_parallel=2,
        tensor_parallel=2,
        sequence_parallel=True,
    ),  # fmt: skip
    "pipeline-fsdp2": _pipeline("1f1b", devices=4, data_parallel=2),
    "pipeline-fsdp2-float8": replace(
        _pipeline("1f1b", devices=4, data_parallel=2),
        overrides=(*_pipeline("1f1b", devices=4, data_parallel=2).overrides, "strategy.float8=tensorwise"),
        float8="tensorwise",
    ),
    "tp_fsdp-float8": Layout(
        4,
        ("strategy=tp_fsdp", "strategy.float8=tensorwise"),
        "tp_fsdp",
        data_parallel=2,
        tensor_parallel=2,
        float8="tensorwise",
    ),  # fmt: skip
    # HSDP: FSDP2's gathers and reduce-scatters within pairs of ranks, the gradient shards all-reduced across them.
    "fsdp2-hsdp": Layout(
        4, ("strategy=fsdp2", "strategy.data_parallel_shard_size=2"), "fsdp2", data_parallel=4, data_shard=2,
    ),
    # Two micro batches per step: HSDP's all-reduce across the pairs after the last only; or every reduction then.
    "fsdp2-hsdp-replicas-at-last": Layout(
        4, ("strategy=fsdp2", "strategy.data_parallel_shard_size=2", "strategy.gradient_sync=replicas_at_last",
            "micro_batch_size=1"), "fsdp2", data_parallel=4, data_shard=2, gradient_sync="replicas_at_last",
        micro_batch=1,
    ),
    "fsdp2-at-last": Layout(
        2, ("strategy=fsdp2", "strategy.gradient_sync=at_last"), "fsdp2", data_parallel=2, gradient_sync="at_last",
    ),
    "tp_fsdp-sp-hsdp": Layout(
        8, ("strategy=tp_fsdp", "strategy.sequence_parallel=true", "strategy.data_parallel_shard_size=2"), "tp_fsdp",
        data_parallel=4, tensor_parallel=2, sequence_parallel=True, data_shard=2,
    ),
    "pipeline-cp": _pipeline("1f1b", devices=4, context_parallel=2),
    "pipeline-tp-sp": _pipeline("1f1b", devices=4, sequence_parallel=True, tensor_parallel=2),
    "3d": _pipeline("1f1b", devices=8, sequence_parallel=True, data_parallel=2, tensor_parallel=2),
    # A mixture of experts: its experts' all-to-alls and groups (and, with routing biases, their loads summed each
    # step).
    "fsdp2-moe-ep2": Layout(
        2, ("strategy=fsdp2", *MOE, f"{EP}=2"), "fsdp2", data_parallel=2, model="moe_debug", expert_parallel=2,
    ),
    "fsdp2-moe-dp4-ep2": Layout(
        4, ("strategy=fsdp2", *MOE, "model.bias_update_rate=0.01", f"{EP}=2"), "fsdp2", data_parallel=4,
        model="moe_debug", expert_parallel=2,
    ),
    "fsdp2-moe-cp2-ep2": Layout(
        4, ("strategy=fsdp2", *MOE, "strategy.context_parallel_size=2", f"{EP}=2"), "fsdp2", data_parallel=2,
        context_parallel=2, model="moe_debug", expert_parallel=2,
    ),
    "pipeline-moe-dp2-ep2": replace(
        _pipeline("1f1b", devices=4, data_parallel=2),
        overrides=(*_pipeline("1f1b", devices=4, data_parallel=2).overrides, *MOE, f"{EP}=2"),
        model="moe_debug",
        expert_parallel=2,
    ),
    # Each expert's hidden units (and the shared expert's) split over the tensor-parallel ranks: its results and
    # their tokens' gradients all-reduced.
    "tp-moe-shared": Layout(
        2, ("strategy=tp", *MOE, "model.shared_expert=true"), "tp", tensor_parallel=2, model="moe_debug",
    ),
    "tp_fsdp-sp-moe-ep2": Layout(
        4, ("strategy=tp_fsdp", "strategy.sequence_parallel=true", *MOE, "model.shared_expert=true", f"{EP}=2"),
        "tp_fsdp", data_parallel=2,
        tensor_parallel=2, sequence_parallel=True, model="moe_debug", expert_parallel=2,
    ),
}  # fmt: skip


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS, doc=__doc__)
    layouts = list(LAYOUTS) if args["layouts"] == "all" else [name for name in args["layouts"].split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or not layouts:
        raise ConfigError(f"layouts={args['layouts']}: choose all, or among {list(LAYOUTS)}, separated by commas.")
    for key in ("steps", "step"):
        if not args[key].isdigit():
            raise ConfigError(f"{key}={args[key]}: give a whole number.")
    if not args["node_size"].isdigit() or int(args["node_size"]) < 1:
        raise ConfigError(f"node_size={args['node_size']}: give the processes that stand for one node, 1 or more.")
    steps, step = int(args["steps"]), int(args["step"])
    if not 2 <= step < steps - 1:
        raise ConfigError(
            f"step={step} with steps={steps}: choose a step after the first two (their extras: the pipeline's shape "
            f"exchange, DDP's bucket rebuild) and before the last (which logs): 2 to {steps - 2}, with steps=4 or more."
        )
    return {
        "layouts": layouts,
        "steps": steps,
        "step": step,
        "node_size": int(args["node_size"]),
        "out": out_folder(args["out"]),
    }


def model_config(layout: Layout, vocab_size: int):
    """The model a layout's runs train: its preset of conf/model (the debug model's) with this vocabulary, its depth
    and its `model.KEY=VALUE` overrides."""
    import yaml

    from project.model.families import model_config as family_config

    fields = yaml.safe_load((ROOT / "conf" / "model" / f"{layout.model}.yaml").read_text())
    for key, value in (o.split("=", 1) for o in layout.overrides if o.startswith("model.")):
        fields[key.removeprefix("model.")] = yaml.safe_load(value)
    return family_config({**fields, "vocab_size": vocab_size, "n_layers": layout.layers})


def by_group(rows: list[list], shape) -> dict[tuple[str, str], tuple[int, int]]:
    """A rank's measured rows ([kind, ranks, calls, bytes], benchmarks.count_collectives) as {(kind, mesh dimensions):
    (calls, bytes)}, each group named by the dimensions its ranks span (project.planning.communication)."""
    from project.planning.communication import dimension_of

    table: dict[tuple[str, str], tuple[int, int]] = {}
    for kind, ranks, calls, size in rows:
        group = dimension_of(map(int, ranks.split(",")), shape) if ranks[0].isdigit() else ranks
        before = table.get((kind, group), (0, 0))
        table[(kind, group)] = (before[0] + calls, before[1] + size)
    return table


def planned(layout: Layout, config, seq_len: int, rank: int) -> dict[tuple[str, str], tuple[float, float]]:
    """The planner's collectives of one step on global rank `rank` of the layout, by kind and group."""
    from project.planning.communication import by_kind_and_group, collectives

    found = collectives(config, layout.candidate(), seq_len, PRECISION, layout.pipeline_rank(rank))
    return by_kind_and_group(found)


def measured_by_node(rows: list[list], node_size: int, world_size: int) -> tuple[int, int]:
    """A rank's measured bytes ([kind, ranks, calls, bytes] rows) on groups inside one node and on groups across
    nodes, `node_size` consecutive global ranks to a node (a group named by a word: every rank)."""
    inside = across = 0
    for _, ranks, _, size in rows:
        members = [int(r) for r in ranks.split(",")] if ranks[0].isdigit() else list(range(world_size))
        if len({member // node_size for member in members}) > 1:
            across += size
        else:
            inside += size
    return inside, across


def planned_by_node(found: Iterable[Any], node_size: int) -> tuple[float, float]:
    """The planner's bytes (its Collectives) on groups inside one node and across nodes: a group whose consecutive
    ranks (its span) do not fit in a node crosses nodes, as the planner times it (Cluster.bandwidth)."""
    inside = across = 0.0
    for x in found:
        if x.span > node_size:
            across += x.bytes
        else:
            inside += x.bytes
    return inside, across


def compare(measured: dict, plan: dict) -> list[dict]:
    """One row per (kind, group) of either table: calls and bytes of both, and whether they agree (the same
    calls, bytes within 10%)."""
    rows = []
    for key in sorted(measured.keys() | plan.keys()):
        (calls, size), (planned_calls, planned_size) = measured.get(key, (0, 0)), plan.get(key, (0, 0))
        off = size / planned_size - 1 if planned_size else (0.0 if not size else float("inf"))
        rows.append(
            {
                "kind": key[0],
                "group": key[1],
                "calls": calls,
                "planned_calls": planned_calls,
                "bytes": size,
                "planned_bytes": planned_size,
                "bytes_off": off,
                "agrees": calls == planned_calls and abs(off) <= 0.10,
            }
        )
    return rows


def measure(name: str, steps: int, step: int, data: Path, scratch: Path, node_size: int = 2) -> dict:
    """Train `name` with the counter; its table against the planner's on every rank, and each rank's bytes inside
    and across nodes of `node_size` processes against the planner's."""
    from benchmarks.count_collectives import read_record
    from benchmarks.train_step import SEQ_LEN, VOCAB_SIZE, data_settings
    from project.planning.communication import collectives

    layout = LAYOUTS[name]
    run_dir = scratch / name
    command = [
        sys.executable, "-m", "project.train", "experiment=debug", *data_settings(data),
        f"trainer.devices={layout.devices}", f"model.n_layers={layout.layers}", f"hydra.run.dir={run_dir}",
        f"trainer.max_steps={steps}", f"trainer.log_every_n_steps={steps}", f"global_batch_size={GLOBAL_BATCH}",
        f"micro_batch_size={MICRO_BATCH}", f"trainer.precision={PRECISION}", "ckpt_every_n_steps=1000",
        "val_every_n_steps=1000", *layout.overrides,  # last: a layout's own micro batch wins
        "+callbacks.comms._target_=benchmarks.count_collectives.CountCollectives",
        f"+callbacks.comms.output_dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{name}: project.train failed:\n{result.stderr[-3000:]}")
    c = layout.candidate()
    shape = c.shape
    config = model_config(layout, VOCAB_SIZE)
    ranks: list[dict[str, Any]] = []
    for rank in range(layout.devices):
        record = read_record(run_dir, rank)
        if step in record["logging_steps"]:
            raise RuntimeError(f"{name}: step {step} logs (logging steps {record['logging_steps']})")
        measured = by_group(record["steps"][step], shape)
        rows = compare(measured, planned(layout, config, SEQ_LEN, rank))
        found = collectives(config, c, SEQ_LEN, PRECISION, layout.pipeline_rank(rank))
        inside, across = measured_by_node(record["steps"][step], node_size, layout.devices)
        planned_inside, planned_across = planned_by_node(found, node_size)
        nodes = {"inside": inside, "across": across, "planned_inside": planned_inside, "planned_across": planned_across}
        ranks.append({"rank": rank, "pipeline_rank": layout.pipeline_rank(rank), "rows": rows, "by_node": nodes})
    return {
        "layout": name,
        "candidate": c.name,
        "processes": layout.devices,
        "ranks_agreeing": sum(all(r["agrees"] for r in rank["rows"]) for rank in ranks),
        "ranks": ranks,
    }


def _size(n: float) -> str:
    return f"{n:,.0f}"


def table(report: dict) -> str:
    lines = [
        f"# Collectives per optimizer step and rank, measured and planned, {report['date']} on {report['host']}",
        "",
        f"`{report['command']}`: the debug model (dim 64; vocabulary {report['vocab_size']}, "
        f"{report['seq_len']}-token sequences), global batch {GLOBAL_BATCH} in micro batches of {MICRO_BATCH}, "
        f"{PRECISION}, gloo; step {report['step']} (0-based) of {report['steps']}, after the first two and before the "
        "last, which logs. "
        "Measured: benchmarks.count_collectives on every rank; planned: project.planning.communication. Bytes: each "
        "call's "
        "whole buffer (an all-gather's output, a reduce-scatter's input). A group is named by the mesh dimensions "
        "its ranks span. Shown: the first rank of each pipeline stage; `agree` counts the ranks whose every row "
        "has the planned calls and bytes within 10%.",
        "",
        "| layout | rank | kind | group | calls | planned | bytes | planned | off | agree |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        shown = [rank for rank in r["ranks"] if rank["rank"] == min(
            x["rank"] for x in r["ranks"] if x["pipeline_rank"] == rank["pipeline_rank"]
        )]  # fmt: skip
        for rank in shown:
            for row in rank["rows"]:
                off = "-" if row["bytes_off"] == float("inf") else f"{row['bytes_off']:+.1%}"
                lines.append(
                    f"| {r['layout']} | {rank['rank']} | {row['kind']} | {row['group']} | {row['calls']} | "
                    f"{row['planned_calls']:g} | {_size(row['bytes'])} | {_size(row['planned_bytes'])} | {off} | "
                    f"{r['ranks_agreeing']}/{r['processes']} |"
                )
    lines += [
        "",
        f"Each rank's bytes inside a node and across nodes, {report.get('node_size', 2)} processes standing for a node "
        "(a group whose ranks lie in two nodes or more crosses), measured and planned:",
        "",
        "| layout | rank | inside a node | planned | across nodes | planned |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        for rank in r["ranks"]:
            n = rank.get("by_node")
            if n:
                lines.append(
                    f"| {r['layout']} | {rank['rank']} | {_size(n['inside'])} | {_size(n['planned_inside'])} | "
                    f"{_size(n['across'])} | {_size(n['planned_across'])} |"
                )
    return "\n".join(lines) + "\n"


def rows(args: dict, scratch: Path) -> Iterator[dict]:
    from benchmarks.train_step import shards

    data = shards(scratch)
    for name in args["layouts"]:
        yield measure(name, args["steps"], args["step"], data, scratch, args["node_size"])


def header(args: dict) -> dict:
    from benchmarks.train_step import SEQ_LEN, VOCAB_SIZE

    return {
        "steps": args["steps"],
        "step": args["step"],
        "node_size": args["node_size"],
        "seq_len": SEQ_LEN,
        "vocab_size": VOCAB_SIZE,
    }


BENCHMARK = Benchmark("benchmarks.comms", "-comms", parse, rows, table, header)


if __name__ == "__main__":
    main(BENCHMARK)

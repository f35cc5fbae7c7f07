"""Context parallelism on this machine: `python -m benchmarks.context_parallel
[seq_lens=1024,2048,4096,8192] [model=small4m] [steps=4] [out=experiments/benchmarks]`

For each sequence length, two sequences per optimizer step on 2 processes (`project.train`, strategy=fsdp2,
32-bit): context_parallel_size=1 (two replicas, each rank a whole sequence) against 2 (both ranks split each of the
two sequences, one at a time). Each rank computes as many tokens either way; what changes is how many each holds at
once. Measured per layout: the step time (the last `train/tokens_per_sec` window, the first step left out), and
rank 0's activations (MemoryMonitor's `memory/activation_bytes`: what autograd kept for the backward) and peak
resident memory; beside them the planner's step time and activations for the same layouts on `cluster=cpu`
(project.planning). Writes new files <date>-<host>-context-parallel.{json,md,svg} (the SVG: step time and
activations against the sequence length).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.runner import ROOT, add_row, load_preset, new_report, result_stem, write_report
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError, exit_on_config_error

DEFAULTS = {"seq_lens": "1024,2048,4096,8192", "model": "small4m", "steps": "4", "out": "experiments/benchmarks"}
VOCAB = 1024
DEGREES = (1, 2)  # context_parallel_size on the 2 processes


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS, doc=__doc__)
    seq_lens = args["seq_lens"].split(",")
    if not all(s.isdigit() and int(s) >= 64 and int(s) % 4 == 0 for s in seq_lens):
        raise ConfigError(f"seq_lens={args['seq_lens']}: give sequence lengths of 64 or more, divisible by 4.")
    if not args["steps"].isdigit() or int(args["steps"]) < 2 or int(args["steps"]) % 2:
        raise ConfigError(f"steps={args['steps']}: give an even number of steps, 2 or more (the first is not timed).")
    if not (ROOT / "conf" / "model" / f"{args['model']}.yaml").is_file():
        raise ConfigError(f"model={args['model']}: no conf/model/{args['model']}.yaml.")
    out = Path(args["out"])
    return {
        "seq_lens": [int(s) for s in seq_lens],
        "model": args["model"],
        "steps": int(args["steps"]),
        "out": out if out.is_absolute() else ROOT / out,
    }


def train(work: Path, seq_len: int, model: str, steps: int, cp: int) -> dict:
    """One layout's run; its last logged window's tokens/s and rank 0's memory figures."""
    run_dir = work / f"cp{cp}-{seq_len}"
    argv = [
        sys.executable,
        "-m",
        "project.train",
        "experiment=debug",
        f"model={model}",
        "model.tie_embeddings=false",
        f"model.max_seq_len={seq_len}",
        f"data.dir={work / f'shards-{seq_len}'}",
        f"data.sources=[{work / 'raw'}/*.txt]",
        "data.fetch=null",
        f"data.seq_len={seq_len}",
        f"data.vocab_size={VOCAB}",
        "global_batch_size=2",
        "micro_batch_size=1",
        f"trainer.max_steps={steps}",
        f"trainer.log_every_n_steps={steps // 2}",  # the last window: the second half of the steps
        "val_every_n_steps=1000",
        "ckpt_every_n_steps=1000",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={run_dir}",
        "strategy=fsdp2",
        "trainer.devices=2",
        f"strategy.context_parallel_size={cp}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"cp={cp} at {seq_len} tokens failed:\n{done.stderr[-3000:]}")
    with open(run_dir / "metrics.csv", newline="") as f:
        rates = [float(r["train/tokens_per_sec"]) for r in csv.DictReader(f) if r.get("train/tokens_per_sec")]
    memory = json.loads((run_dir / "memory" / "rank0.json").read_text())
    return {
        "step_seconds": round(2 * seq_len / rates[-1], 3),
        "activation_bytes": memory["activation_bytes"],
        "peak_resident_bytes": memory["peak_bytes"],
    }


def predicted(model: str, seq_len: int, cp: int) -> dict:
    """The planner's step time and activations of the layout on conf/cluster/cpu.yaml."""
    import yaml

    from project.planning.candidates import Candidate
    from project.planning.cluster import Cluster
    from project.planning.memory import Allowance
    from project.planning.planner import Workload, evaluate

    config = dataclasses.replace(load_preset(model, VOCAB), max_seq_len=seq_len, tie_embeddings=False)
    cluster = Cluster.from_config(yaml.safe_load((ROOT / "conf" / "cluster" / "cpu.yaml").read_text()))
    replicas = 2 // cp  # two sequences per step: one per replica, or both through the one replica in turn
    candidate = Candidate("fsdp2", replicas, 1, 1, 1, 2 // replicas, "selective", context_parallel=cp)
    work = Workload(config, seq_len, 2, 1e9, "32-true")
    prediction = evaluate(work, cluster, candidate, 0.5, Allowance()).prediction
    return {
        "planned_step_seconds": round(prediction.time.total, 3),
        "planned_activation_bytes": prediction.memory.activations,
    }


def table(report: dict) -> str:
    lines = [
        f"# Context parallelism, {report['date']} on {report['host']}",
        "",
        f"`{report['command']}`: {report['model']}, two sequences per step on 2 processes (fsdp2, 32-bit, one "
        "thread each); cp=1: each rank a whole sequence (two replicas); cp=2: both ranks split each sequence. Step "
        "time from the last `train/tokens_per_sec` window (the first step left out); rank 0's activations "
        "(`memory/activation_bytes`) and peak resident memory; the planner's prediction on `cluster=cpu` beside them.",
        "",
        "| tokens | cp | step (s) | planner step (s) | activations (MiB) | planner activations (MiB) "
        "| peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['seq_len']:,} | {r['cp']} | {r['step_seconds']} | {r['planned_step_seconds']} | "
            f"{r['activation_bytes'] / 2**20:.1f} | {r['planned_activation_bytes'] / 2**20:.1f} | "
            f"{r['peak_resident_bytes'] / 2**20:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict) -> str:
    from benchmarks.svg_plots import line_chart

    series = []
    for cp in DEGREES:
        rows = [r for r in report["rows"] if r["cp"] == cp]
        series.append((f"activations, cp={cp}", [(r["seq_len"], r["activation_bytes"] / 2**20) for r in rows]))
        series.append((f"planner, cp={cp}", [(r["seq_len"], r["planned_activation_bytes"] / 2**20) for r in rows]))
    return line_chart(
        f"Rank 0's activations, {report['model']}, 2 processes (measured and planned)",
        series,
        "tokens per sequence",
        "MiB",
    )


@exit_on_config_error()
def main() -> None:
    args = parse(sys.argv[1:])
    from benchmarks.data import write_text

    report = new_report("benchmarks.context_parallel", sys.argv[1:], model=args["model"])
    work = Path(tempfile.mkdtemp(prefix="bench-context-parallel-"))
    try:
        # Enough text for every length: (steps + validation) x 2 sequences of the longest, several times over.
        write_text(work / "raw", max(2.0, 40 * max(args["seq_lens"]) / 1e6))
        for seq_len in args["seq_lens"]:
            for cp in DEGREES:
                measured = train(work, seq_len, args["model"], args["steps"], cp)
                add_row(report, {"seq_len": seq_len, "cp": cp, **measured, **predicted(args["model"], seq_len, cp)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stem = write_report(result_stem(args["out"], "-context-parallel"), report, table(report))
    stem.with_name(stem.name + ".svg").write_text(plot(report))
    print(table(report))
    print(f"wrote {stem}.json, .md and .svg")


if __name__ == "__main__":
    main()

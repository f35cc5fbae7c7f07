"""The host's waits, counted per training step: `python -m benchmarks.host_sync
[layouts=single,ddp,fsdp2,tp,pipeline] [steps=9] [log_every=3] [out=experiments/benchmarks]`

Each layout trains the debug model for `steps` steps with `python -m project.train` (2 processes but for single),
saves by time on (`ckpt_every_minutes`, never due), the ranks deciding on them and on a stop signal at logging steps
(`ckpt_check_every_n_steps` = `log_every`, as the defaults have both 10), and spikes rolled back
(`stability=rollback`, a threshold never reached), with a callback that counts, per step and rank
(benchmarks.count_conversions), the conversions of tensors to Python values (`item`, `tolist`, `bool`, `float`,
`int`), each of which on a GPU makes the host wait for every kernel launched before it, and the collectives called
from the host (torch.distributed's functions, the training's own traffic aside), each of which makes every rank wait
for the slowest. Steps are split into the logging steps (`trainer.log_every_n_steps`, and the last), the first step,
and the others, which should wait for nothing. Writes new files <date>-<host>-host-sync.{json,md}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from benchmarks.runner import (
    ROOT,
    Benchmark,
    main,
    out_folder,
)
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError

DEFAULTS = {"layouts": "single,ddp,fsdp2,tp,pipeline", "steps": "9", "log_every": "3", "out": "experiments/benchmarks"}
LAYOUTS = {
    "single": [],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "fsdp2": ["strategy=fsdp2", "trainer.devices=2"],
    "tp": ["strategy=tp", "trainer.devices=2"],
    "pipeline": ["strategy=pipeline", "trainer.devices=2", "model.n_layers=4", "micro_batch_size=2"],
}


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS, doc=__doc__)
    layouts = [name for name in args["layouts"].split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or not layouts:
        raise ConfigError(f"layouts={args['layouts']}: choose among {list(LAYOUTS)}, separated by commas.")
    for key in ("steps", "log_every"):
        if not args[key].isdigit() or int(args[key]) < 2:
            raise ConfigError(f"{key}={args[key]}: give a whole number of at least 2.")
    return {
        "layouts": layouts,
        "steps": int(args["steps"]),
        "log_every": int(args["log_every"]),
        "out": out_folder(args["out"]),
    }


def count(layout: str, steps: int, log_every: int, data: Path, scratch: Path) -> dict:
    """Train `layout` with the counting callback; conversions and host collectives per step, the most of any rank."""
    from benchmarks.train_step import data_settings

    run_dir = scratch / layout
    command = [
        sys.executable, "-m", "project.train", "experiment=debug", *data_settings(data), *LAYOUTS[layout],
        f"hydra.run.dir={run_dir}", f"trainer.max_steps={steps}", f"trainer.log_every_n_steps={log_every}",
        "global_batch_size=8", "ckpt_every_n_steps=1000", "val_every_n_steps=1000", "trainer.enable_progress_bar=true",
        "ckpt_every_minutes=1000", f"ckpt_check_every_n_steps={log_every}", "stability=rollback",
        "stability.threshold=1000",
        "+callbacks.conversions._target_=benchmarks.count_conversions.CountConversions",
        f"+callbacks.conversions.output_dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{layout}: project.train failed:\n{result.stderr[-3000:]}")
    per_step: dict[int, int] = {}
    collectives: dict[int, int] = {}
    logging: set[int] = set()
    for record_file in sorted((run_dir / "conversions").glob("rank*.json")):
        record = json.loads(record_file.read_text())
        for step, n in record["counts"].items():
            per_step[int(step)] = max(per_step.get(int(step), 0), n)
        for step, n in record["collectives"].items():
            collectives[int(step)] = max(collectives.get(int(step), 0), n)
        logging |= set(record["logging_steps"])
    others = [step for step in per_step if step != 0 and step not in logging]
    return {
        "layout": layout,
        "processes": 1 if layout == "single" else 2,
        "first_step": per_step.get(0, 0),
        "logging_steps": sorted(logging),
        "per_logging_step": max((per_step[s] for s in logging), default=0),
        "other_steps": len(others),
        "per_other_step": max((per_step[s] for s in others), default=0),
        "collectives_first_step": collectives.get(0, 0),
        "collectives_per_logging_step": max((collectives.get(s, 0) for s in logging), default=0),
        "collectives_per_other_step": max((collectives.get(s, 0) for s in others), default=0),
    }


def table(report: dict) -> str:
    lines = [
        f"# Host waits for the device and for the other ranks per step, {report['date']} on {report['host']}",
        "",
        f"`{report['command']}`: the debug model, {report['steps']} steps, logging every {report['log_every']}; "
        "per step (the most of any rank), conversions of tensors to Python values, each a wait for the device on "
        "a GPU, and / collectives called from the host, each a wait for every rank (the training's own traffic "
        "aside).",
        "",
        "| layout | processes | steps that log | at each, at most | first step | other steps | at each, at most |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        logged = f"{r['per_logging_step']} / {r['collectives_per_logging_step']}"
        first = f"{r['first_step']} / {r['collectives_first_step']}"
        other = f"{r['per_other_step']} / {r['collectives_per_other_step']}"
        lines.append(
            f"| {r['layout']} | {r['processes']} | {', '.join(map(str, r['logging_steps']))} | "
            f"{logged} | {first} | {r['other_steps']} | {other} |"
        )
    return "\n".join(lines) + "\n"


def rows(args: dict, scratch: Path) -> Iterator[dict]:
    from benchmarks.train_step import shards

    data = shards(scratch)
    for layout in args["layouts"]:
        yield count(layout, args["steps"], args["log_every"], data, scratch)


def header(args: dict) -> dict:
    return {"steps": args["steps"], "log_every": args["log_every"]}


BENCHMARK = Benchmark("benchmarks.host_sync", "-host-sync", parse, rows, table, header)


if __name__ == "__main__":
    main(BENCHMARK)

"""Training time a checkpoint costs, written in the foreground and in the background: `python -m
benchmarks.checkpoint [sizes=small,large] [steps=25] [every=6] [out=experiments/benchmarks]`

Each model size trains under fsdp2 on 2 gloo processes (32-true, global batch 8 in micro batches of 2, 256-token
sequences) three times: saving no checkpoint, saving last.ckpt every `every` steps as training waits
(ckpt_async=false), and in the background (ckpt_async=true: the step copies each rank's shard to host memory and a
thread writes it). Rank 0 clocks every optimizer step (StepClock); the time lost per save is the sum of the steps'
times (after the second step, before the last, whose save the run waits for at its end) over the run that saves
none, divided by the saves among them: the stall and, in the background, the writer's share of the cores. The stall
alone, the seconds training waited inside each save, is the run's own `checkpoint/stall_seconds` (rank 0), averaged
over its saves. Writes new files <date>-<host>-checkpoint.{json,md}.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from benchmarks.runner import (
    ROOT,
    Benchmark,
    main,
    out_folder,
)
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError

DEFAULTS = {"sizes": "small,large", "steps": "25", "every": "6", "out": "experiments/benchmarks"}
# The debug preset, widened: (dim, layers, heads, FFN width).
SIZES = {"small": (256, 8, 8, 768), "large": (512, 8, 8, 1536)}
MODES = {"none": [], "foreground": ["ckpt_async=false"], "background": ["ckpt_async=true"]}
FIRST_TIMED = 2  # the steps before carry the first step's compilation of the loader and the allocator's warm-up


class StepClock(Callback):
    """Rank 0's clock at the end of each optimizer step, written to `<output_dir>/steps.json` as training ends."""

    def __init__(self, output_dir: str):
        self.output_dir = Path(output_dir)
        self.ends: dict[int, float] = {}

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.ends.setdefault(trainer.global_step, time.perf_counter())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            (self.output_dir / "steps.json").write_text(json.dumps(self.ends))


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS, doc=__doc__)
    sizes = [s for s in args["sizes"].split(",") if s]
    if not sizes or any(s not in SIZES for s in sizes):
        raise ConfigError(f"sizes={args['sizes']}: choose among {list(SIZES)}.")
    steps, every = int(args["steps"]), int(args["every"])
    saves = len(range(every, steps - 1, every))
    if saves < 1 or every <= FIRST_TIMED:
        raise ConfigError(f"steps={steps} every={every}: at least one save after step {FIRST_TIMED} before the last.")
    return {"sizes": sizes, "steps": steps, "every": every, "out": out_folder(args["out"])}


def parameters(dim: int, layers: int, ffn: int, vocab: int) -> int:
    return layers * (4 * dim * dim + 3 * dim * ffn + 2 * dim) + 2 * vocab * dim + dim


def run(size: str, mode: str, steps: int, every: int, data: Path, scratch: Path) -> tuple[dict[int, float], float]:
    """(seconds of each timed step, the mean stall per save)"""
    from benchmarks.train_step import data_settings

    dim, layers, heads, ffn = SIZES[size]
    run_dir = scratch / f"{size}-{mode}"
    run_dir.mkdir(parents=True)
    saves = [f"ckpt_every_n_steps={every}"] if mode != "none" else ["ckpt_every_n_steps=100000"]
    command = [
        sys.executable, "-m", "project.train", "experiment=debug", *data_settings(data), "strategy=fsdp2",
        "trainer.devices=2", f"model.dim={dim}", f"model.n_layers={layers}", f"model.n_heads={heads}",
        f"model.n_kv_heads={heads}", f"model.ffn_dim={ffn}", f"hydra.run.dir={run_dir}", f"trainer.max_steps={steps}",
        "global_batch_size=8", "micro_batch_size=2", "trainer.precision=32-true", "val_every_n_steps=100000",
        *saves, *MODES[mode], "+callbacks.clock._target_=benchmarks.checkpoint.StepClock",
        f"+callbacks.clock.output_dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{size} {mode}: project.train failed:\n{result.stderr[-3000:]}")
    ends = {int(k): v for k, v in json.loads((run_dir / "steps.json").read_text()).items()}
    with open(run_dir / "metrics.csv", newline="") as file:
        stalls = [
            float(row["checkpoint/stall_seconds"])
            for row in csv.DictReader(file)
            if row.get("checkpoint/stall_seconds")
        ]
    return {step: ends[step] - ends[step - 1] for step in range(FIRST_TIMED + 1, steps)}, (
        sum(stalls) / len(stalls) if stalls else 0.0
    )


def measure(size: str, steps: int, every: int, data: Path, scratch: Path) -> dict:
    from benchmarks.train_step import VOCAB_SIZE

    runs = {mode: run(size, mode, steps, every, data, scratch) for mode in MODES}
    times = {mode: timed for mode, (timed, _) in runs.items()}
    stall = {mode: runs[mode][1] for mode in ("foreground", "background")}
    # A save after step k (StepCheckpoint, after the clock in Lightning's order) is in step k + 1's time.
    saved = [k + 1 for k in range(every, steps - 1, every) if FIRST_TIMED + 1 <= k + 1 < steps]
    base = sum(times["none"].values())
    lost = {mode: (sum(times[mode].values()) - base) / len(saved) for mode in ("foreground", "background")}
    dim, layers, _, ffn = SIZES[size]
    n = parameters(dim, layers, ffn, VOCAB_SIZE)
    return {
        "size": size,
        "parameters": n,
        "state_bytes": 3 * 4 * n,  # float32 weights and AdamW's two moments
        "saves": len(saved),
        "step_seconds": {mode: sum(t.values()) / len(t) for mode, t in times.items()},
        "lost_per_save": lost,
        "background_over_foreground": lost["background"] / lost["foreground"] if lost["foreground"] > 0 else None,
        "stall_per_save": stall,
        "stall_background_over_foreground": stall["background"] / stall["foreground"] if stall["foreground"] else None,
    }


def table(report: dict) -> str:
    lines = [
        f"# Training time lost per checkpoint, foreground and background, {report['date']} on {report['host']}",
        "",
        f"`{report['command']}`: fsdp2 on 2 gloo processes, 32-true, global batch 8 in micro batches of 2, "
        f"{report['steps']} steps, last.ckpt every {report['every']}; the time lost per save is the steps' time over "
        "a run that saves none, per save (rank 0's clock); the stall is the seconds training waited inside each save "
        "(`checkpoint/stall_seconds`, rank 0, mean over the run's saves).",
        "",
        "| model | parameters | weights and moments | step, no saves (s) | lost per save, foreground (s) | "
        "lost per save, background (s) | background / foreground | stall, foreground (s) | stall, background (s) "
        "| stall background / foreground |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        ratio, stall = r["background_over_foreground"], r.get("stall_background_over_foreground")
        lines.append(
            f"| {r['size']} | {r['parameters'] / 1e6:.1f}M | {r['state_bytes'] / 2**20:,.0f} MiB | "
            f"{r['step_seconds']['none']:.3f} | {r['lost_per_save']['foreground']:.3f} | "
            f"{r['lost_per_save']['background']:.3f} | {'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{r['stall_per_save']['foreground']:.3f} | {r['stall_per_save']['background']:.3f} | "
            f"{'-' if stall is None else f'{stall:.2f}'} |"
        )
    return "\n".join(lines) + "\n"


def rows(args: dict, scratch: Path) -> Iterator[dict]:
    from benchmarks.train_step import shards

    data = shards(scratch / "data")
    for size in args["sizes"]:
        yield measure(size, args["steps"], args["every"], data, scratch / "runs")


def header(args: dict) -> dict:
    return {"steps": args["steps"], "every": args["every"]}


BENCHMARK = Benchmark("benchmarks.checkpoint", "-checkpoint", parse, rows, table, header)


if __name__ == "__main__":
    main(BENCHMARK)

"""The platform against a hand-written loop, side by side: `make bench` or

    python -m project.bench_platform [presets=debug,small10m,small50m] [steps=S] [warmup=W] [repeats=R]
                                     [threads=T] [startup=true] [out=experiments/benchmarks]

For each preset, alternating A B A B ... R times: A is `python -m project.train` on one process (prepared
shards, the run's AdamW, warmup + cosine and clipping, logging every step, no validation or checkpoint within
the timed steps), B is a minimal PyTorch loop over the same model class, batch, AdamW and clipping on random
tokens, in a process of its own with the same thread count. Each gives tokens/s over S optimizer steps after W
warm-up steps; A's step times are those its TokenThroughput callback logs (first micro batch's start to the
last one's end). The ratio A / B of the medians is what the platform costs or saves; absolute figures drift
between runs and machines of this kind, ratios taken side by side much less.

Then, unless startup=false, the start-up: seconds from the command to the end of the first optimizer step of
`experiment=debug`, split into `import lightning` and the rest, and the process's peak resident memory.

Writes new files <date>-<host>-platform.json and .md into `out`; no file there is edited.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from project.bench import ROOT, free_stem, load_preset, parse_key_values, preset_path, result_stem
from project.errors import ConfigError, exit_on_config_error

DEFAULTS = {"presets": "debug,small10m,small50m", "steps": "", "warmup": "1", "repeats": "3", "threads": "", "startup": "true",
            "out": "experiments/benchmarks"}
VOCAB_SIZE, SEQ_LEN = 4096, 256
# Batch and timed steps per preset: steps long enough that a step's timer noise averages out.
SHAPES = {"debug": {"batch": 8, "steps": 20}, "small10m": {"batch": 8, "steps": 6}, "small50m": {"batch": 8, "steps": 3}}
OPTIM = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}  # conf/train.yaml's


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS)
    presets = [p for p in args["presets"].split(",") if p]
    for name in presets or [""]:
        if not preset_path(name).is_file():
            raise ConfigError(f"presets: no model preset {name!r} in conf/model (comma-separated names).")
    for key in ("steps", "warmup", "repeats", "threads"):
        if args[key] and (not args[key].isdigit() or (key != "warmup" and int(args[key]) < 1)):
            raise ConfigError(f"{key}={args[key]}: expected a positive integer.")
    if args["startup"] not in ("true", "false"):
        raise ConfigError(f"startup={args['startup']}: choose true or false.")
    out = Path(args["out"])
    return {
        "startup": args["startup"] == "true", "presets": presets, "steps": int(args["steps"]) if args["steps"] else None, "warmup": int(args["warmup"]),
        "repeats": int(args["repeats"]), "threads": int(args["threads"] or os.cpu_count() or 1),
        "out": out if out.is_absolute() else ROOT / out,
    }


def shards(root: Path) -> Path:
    """Shards of generated text at VOCAB_SIZE and SEQ_LEN, prepared once per benchmark run."""
    from project.bench_data import write_text
    from project.data.prepare import prepare_shards

    folder = root / "shards"
    write_text(root / "raw", megabytes=4)
    prepare_shards(str(root / "raw"), folder, vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN, num_workers=1)
    return folder


def platform_run(preset: str, batch: int, steps: int, warmup: int, data: Path, run_dir: Path, env: dict) -> dict:
    """A: `python -m project.train` for warmup + steps optimizer steps; tokens/s of the last `steps`."""
    command = [
        sys.executable, "-m", "project.train", "experiment=debug", f"model={preset}", f"data.dir={data}",
        f"data.seq_len={SEQ_LEN}", f"data.vocab_size={VOCAB_SIZE}", f"global_batch_size={batch}", f"micro_batch_size={batch}",
        f"trainer.max_steps={warmup + steps}", "trainer.log_every_n_steps=1", "val_every_n_steps=1000000",
        "ckpt_every_n_steps=1000000", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{result.stderr[-3000:]}")
    with open(run_dir / "metrics.csv", newline="") as f:
        rates = {int(r["step"]): float(r["train/tokens_per_sec"]) for r in csv.DictReader(f) if r.get("train/tokens_per_sec")}
    timed = [rates[s] for s in sorted(rates)[warmup:]]
    tokens = batch * SEQ_LEN
    return {"tokens_per_sec": len(timed) * tokens / sum(tokens / r for r in timed), "command": shlex.join(command[1:])}


def hand_loop(preset: str, batch: int, steps: int, warmup: int) -> dict:
    """B, in this process: the model class, AdamW and clipping, nothing else."""
    import torch
    import torch.nn.functional as F

    from project.model import Llama

    torch.manual_seed(0)
    config = load_preset(preset, VOCAB_SIZE)
    model = Llama(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": OPTIM["weight_decay"]}, {"params": rest, "weight_decay": 0.0}],
        lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
    )
    tokens = torch.randint(0, config.vocab_size, (batch, SEQ_LEN + 1))

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return {"tokens_per_sec": steps * batch * SEQ_LEN / (time.perf_counter() - start)}


def hand_loop_run(preset: str, batch: int, steps: int, warmup: int, env: dict) -> dict:
    command = [sys.executable, "-m", "project.bench_platform", "--hand-loop", preset, str(batch), str(steps), str(warmup)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{result.stderr[-3000:]}")
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "command": shlex.join(command[1:])}


def compare(args: dict, data: Path, scratch: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args["threads"]), "WANDB_MODE": "offline"}
    env.pop("PYTEST_CURRENT_TEST", None)
    rows = []
    for preset in args["presets"]:
        shape = SHAPES.get(preset, {"batch": 8, "steps": 4})
        steps = args["steps"] or shape["steps"]
        ours, hand = [], []
        for repeat in range(args["repeats"]):  # A B A B ...: drift on a shared machine hits both alike
            ours.append(platform_run(preset, shape["batch"], steps, args["warmup"], data, scratch / f"{preset}-{repeat}", env))
            hand.append(hand_loop_run(preset, shape["batch"], steps, args["warmup"], env))
            print(f"{preset} run {repeat + 1}/{args['repeats']}: project.train {ours[-1]['tokens_per_sec']:,.0f} tokens/s, "
                  f"hand loop {hand[-1]['tokens_per_sec']:,.0f}", flush=True)
        a, b = (statistics.median(r["tokens_per_sec"] for r in runs) for runs in (ours, hand))
        rows.append({
            "preset": preset, "batch": shape["batch"], "seq_len": SEQ_LEN, "steps": steps, "warmup": args["warmup"],
            "threads": args["threads"], "project_train_tokens_per_sec": round(a, 1), "hand_loop_tokens_per_sec": round(b, 1),
            "ratio": round(a / b, 3), "runs": {"project_train": [round(r["tokens_per_sec"], 1) for r in ours],
                                               "hand_loop": [round(r["tokens_per_sec"], 1) for r in hand]},
            "commands": {"project_train": ours[0]["command"], "hand_loop": hand[0]["command"]},
        })
    return rows


def startup(data: Path, scratch: Path, env: dict, runs: int = 3) -> dict:
    """Seconds from the command to the end of the first optimizer step of `experiment=debug` on one process (its
    time/seconds_to_first_step), split into `import lightning` (timed alone in a fresh process) and the rest; and
    the process's peak resident memory. Medians of `runs`."""
    imports, firsts, peaks = [], [], []
    for i in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import lightning"], cwd=ROOT, env=env, check=True)
        imports.append(time.perf_counter() - start)
        run_dir = scratch / f"startup-{i}"
        command = [sys.executable, "-m", "project.train", "experiment=debug", f"data.dir={data}", f"data.seq_len={SEQ_LEN}",
                   f"data.vocab_size={VOCAB_SIZE}", "trainer.max_steps=1", "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}"]
        subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
        with open(run_dir / "metrics.csv", newline="") as f:
            firsts.append(next(float(r["time/seconds_to_first_step"]) for r in csv.DictReader(f) if r.get("time/seconds_to_first_step")))
        peaks.append(json.loads((run_dir / "memory" / "rank0.json").read_text())["peak_bytes"])
    first, lightning = statistics.median(firsts), statistics.median(imports)
    return {
        "command": shlex.join(command[1:-1]), "seconds_to_first_step": round(first, 2), "import_lightning_seconds": round(lightning, 2),
        "rest_seconds": round(first - lightning, 2), "peak_rss_mib": round(statistics.median(peaks) / 2**20),
        "runs": {"seconds_to_first_step": [round(x, 2) for x in firsts], "import_lightning_seconds": [round(x, 2) for x in imports]},
    }


def table(report: dict) -> str:
    lines = [
        f"# project.train against a hand-written loop, {report['date']} on {report['hostname']}",
        "",
        f"{report['platform']}, torch {report['torch']}, {report['threads']} threads per process; medians of "
        f"{report['repeats']} alternated runs each. Command: `{report['command']}`",
        "",
        "| preset | batch x seq | timed steps | project.train tokens/s | hand loop tokens/s | ratio (target >= 0.97) |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['preset']} | {r['batch']} x {r['seq_len']} | {r['steps']} | {r['project_train_tokens_per_sec']:,.0f} | "
                     f"{r['hand_loop_tokens_per_sec']:,.0f} | {r['ratio']:.3f} |")
    lines += ["", "Each run's figures are in the .json file, with both commands."]
    if report.get("startup"):
        s = report["startup"]
        lines += [
            "", f"Start-up of `{s['command']}` (one process; medians of {len(s['runs']['seconds_to_first_step'])}):",
            f"**{s['seconds_to_first_step']} s** from the command to the end of the first optimizer step = "
            f"`import lightning` {s['import_lightning_seconds']} s + the rest {s['rest_seconds']} s (target: the rest <= 2 s); "
            f"peak resident memory {s['peak_rss_mib']:,} MiB.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["--hand-loop"]:  # B, started by compare() in a process of its own
        preset, batch, steps, warmup = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(hand_loop(preset, batch, steps, warmup)))
        return
    with exit_on_config_error():
        args = parse(sys.argv[1:])
    import torch

    env = {**os.environ, "OMP_NUM_THREADS": str(args["threads"]), "WANDB_MODE": "offline"}
    with tempfile.TemporaryDirectory(prefix="bench-platform-") as scratch:
        data = shards(Path(scratch))
        rows = compare(args, data, Path(scratch))
        started = startup(data, Path(scratch), env, runs=args["repeats"]) if args["startup"] else None
    report = {
        "date": datetime.date.today().isoformat(), "hostname": platform.node(), "platform": platform.platform(),
        "torch": torch.__version__, "threads": args["threads"], "repeats": args["repeats"],
        "command": shlex.join(["python", "-m", "project.bench_platform", *sys.argv[1:]]), "rows": rows, "startup": started,
    }
    stem = free_stem(result_stem(args["out"], "-platform"), [".json", ".md"])
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_name(stem.name + ".md").write_text(table(report))
    print(table(report) + f"\nwritten: {stem}.json and .md")


if __name__ == "__main__":
    main()

"""Training-step throughput of model presets on this machine, and how fast a bad setting is answered: `make bench` or

    python -m benchmarks.model_step [presets=debug,small10m] [vocab_size=V] [batch=B] [seq_len=T] [steps=S]
                            [precision=32|bf16] [compile=false] [error_latency=true] [out=experiments/benchmarks]

For each preset, times forward + backward + AdamW steps of the plain model (no Lightning, no data
loading) after one warm-up step: tokens/s, model TFLOP/s, MFU when the device's peak is known, peak
memory. vocab_size, batch, seq_len and steps default per preset (PRESET_DEFAULTS); given, they apply to
every preset. Then, unless error_latency=false, the config error latency: wall seconds of
`python -m project.train experiment=debug trainer.max_steps=null`, a settings error, from start to exit
(median of 3 runs). Writes new files <date>-<host>.json and .md into `out` (relative to the repository);
a name already taken gets -2, -3, ...: results already there are never edited.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.runner import ROOT, load_preset, preset_path, result_stem, write_report
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError, exit_on_config_error

DEFAULTS = {
    "presets": "debug,small10m",
    "vocab_size": "",
    "batch": "",
    "seq_len": "",
    "steps": "",
    "precision": "32",
    "compile": "false",
    "error_latency": "true",
    "out": "experiments/benchmarks",
}
# What `make bench` measured before one invocation ran every preset; other presets take "*".
PRESET_DEFAULTS = {
    "*": {"vocab_size": "4096", "batch": "8", "seq_len": "256", "steps": "5"},
    "debug": {"vocab_size": "512", "batch": "8", "seq_len": "64", "steps": "20"},
    "small10m": {"vocab_size": "4096", "batch": "16", "seq_len": "256", "steps": "5"},
}
DTYPES = {"32": "float32", "bf16": "bfloat16"}
ERROR_COMMAND = ["-m", "project.train", "experiment=debug", "trainer.max_steps=null"]
ERROR_RUNS = 3


def parse(argv: list[str]) -> dict:
    """The arguments, checked before torch is imported: one settings dict per preset, and the run's own."""
    args = parse_key_values(argv, DEFAULTS)
    names = [name for name in args["presets"].split(",") if name]
    known = sorted(p.stem for p in preset_path("x").parent.glob("*.yaml"))
    for name in names or [""]:
        if not preset_path(name).is_file():
            raise ConfigError(f"presets: no model preset {name!r} in conf/model; choose from {known}, comma-separated.")
    if args["precision"] not in DTYPES:
        raise ConfigError(f"precision={args['precision']}: choose one of {list(DTYPES)}.")
    for key in ("compile", "error_latency"):
        if args[key] not in ("true", "false"):
            raise ConfigError(f"{key}={args[key]}: choose true or false.")
    presets = []
    for name in names:
        settings = {"model": name, "precision": args["precision"], "compile": args["compile"] == "true"}
        for key, default in PRESET_DEFAULTS.get(name, PRESET_DEFAULTS["*"]).items():
            value = args[key] or default
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{key}={value}: expected a positive integer.")
            settings[key] = int(value)
        presets.append(settings)
    out = Path(args["out"])
    return {
        "presets": presets,
        "error_latency": args["error_latency"] == "true",
        "out": out if out.is_absolute() else ROOT / out,
    }


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU x{torch.get_num_threads()} threads"


def bench(settings: dict) -> dict:
    """Throughput of one preset: `settings` as one entry of `parse(...)["presets"]`."""
    import torch
    from lightning.fabric.utilities.throughput import get_available_flops

    from project.model.flops import count_parameters, training_flops_per_token
    from project.model.llama import Llama

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, DTYPES[settings["precision"]])
    config = load_preset(settings["model"], settings["vocab_size"])
    batch, seq_len, steps = settings["batch"], settings["seq_len"], settings["steps"]
    model = Llama(config).to(device)
    step_model = torch.compile(model) if settings["compile"] else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = step_model(tokens[:, :-1], targets=tokens[:, 1:])  # the model's loss, as training computes it
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: allocation, kernel selection, compilation
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    tokens_per_sec = batch * seq_len / seconds
    model_flops = training_flops_per_token(config, seq_len) * tokens_per_sec
    peak = get_available_flops(device, dtype)
    return {
        "model": settings["model"],
        "device": device_name(device),
        "parameters": count_parameters(config),
        "vocab_size": config.vocab_size,
        "batch": batch,
        "seq_len": seq_len,
        "steps": steps,
        "precision": settings["precision"],
        "compile": settings["compile"],
        "step_seconds": round(seconds, 4),
        "tokens_per_sec": round(tokens_per_sec, 1),
        "model_tflops": round(model_flops / 1e12, 4),
        "mfu": round(model_flops / peak, 4) if peak else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
    }


def config_error_latency() -> dict:
    """Wall seconds from starting a training run with a settings error until it exits: how soon a typo is answered."""
    command = [sys.executable, *ERROR_COMMAND]
    runs, result = [], None
    for _ in range(ERROR_RUNS):
        start = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        runs.append(time.perf_counter() - start)
    last_line = (result.stderr.strip().splitlines() or [""])[-1]
    if result.returncode != 2 or not last_line.startswith("error:"):
        print(
            f"warning: {shlex.join(command)} exited {result.returncode} with {last_line!r}, not a settings error",
            file=sys.stderr,
        )
    return {
        "command": shlex.join(command),
        "median_seconds": round(statistics.median(runs), 3),
        "runs_seconds": [round(s, 3) for s in runs],
        "exit_status": result.returncode,
        "stderr": last_line,
    }


def table(report: dict) -> str:
    """The report as Markdown: a header naming the machine and command, one row per preset, the latency."""
    machine = report["machine"]
    lines = [
        f"# Benchmarks, {report['date']} on {machine['hostname']}",
        "",
        f"{machine['platform']}, {machine['cpu_count']} CPUs, torch {report['torch']}, {report['threads']} threads. "
        f"Command: `{report['command']}`",
        "",
        "Training step: forward + backward + AdamW of the plain model on random tokens, after one warm-up step.",
        "",
        "| preset | device | parameters | batch | seq_len | steps | precision | step (s) | tokens/s | model TFLOP/s | "
        "MFU | peak memory (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["presets"]:
        lines.append(
            f"| {r['model']} | {r['device']} | {r['parameters']:,} | {r['batch']} | {r['seq_len']} | {r['steps']} | "
            f"{r['precision']}{' compiled' if r['compile'] else ''} | {r['step_seconds']} | {r['tokens_per_sec']:,.1f} "
            f"| {r['model_tflops']} | {'-' if r['mfu'] is None else r['mfu']} | "
            f"{'-' if r['peak_memory_gib'] is None else r['peak_memory_gib']} |"
        )
    latency = report.get("config_error_latency")
    if latency:
        lines += [
            "",
            f"Config error latency: **{latency['median_seconds']} s**, median of {len(latency['runs_seconds'])} runs "
            f"({', '.join(map(str, latency['runs_seconds']))} s) "
            f"from start to exit (status {latency['exit_status']}) of `{latency['command']}`: `{latency['stderr']}`",
        ]
    return "\n".join(lines) + "\n"


@exit_on_config_error()
def main() -> None:
    args = parse(sys.argv[1:])
    import torch

    report = {
        "date": datetime.date.today().isoformat(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "hostname": platform.node(),
        },
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": shlex.join(sys.orig_argv),
        "presets": [],
    }
    for settings in args["presets"]:
        report["presets"].append(bench(settings))
        print(json.dumps(report["presets"][-1]), flush=True)
    if args["error_latency"]:
        report["config_error_latency"] = config_error_latency()
        print(json.dumps(report["config_error_latency"]), flush=True)
    stem = write_report(result_stem(args["out"]), report, table(report))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()

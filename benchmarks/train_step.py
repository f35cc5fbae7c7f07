"""The platform against a hand-written loop, side by side: `make bench` or

    python -m benchmarks.train_step [presets=debug,small10m,small50m] [compiled=small10m]
                                     [scaling=ddp,fsdp2,tp] (or horovod) [scaling_preset=small10m] [steps=S] [warmup=W]
                                     [litgpt=auto] [repeats=3] [threads=T] [startup=true] [out=experiments/benchmarks]
                                     [compile_effect=single,ddp,fsdp2,tp,pipeline] (or horovod)

For each preset, eager, and again compiled for those in `compiled` (strategy.compile=true; the hand loop
compiles the same blocks), alternating A B C C B A ... R times: A is `python -m project.train` on one process
(prepared shards, the run's AdamW, warmup + cosine and clipping, logging every step, no validation or
checkpoint within the timed steps), B is a minimal PyTorch loop over the same model class, batch, AdamW and
clipping on random tokens, in a process of its own with the same thread count. Each gives tokens/s over S
optimizer steps after W warm-up steps; A's step times are those its TokenThroughput callback logs (first
micro batch's start to the last one's end: the loader's wait before a step and the logging after it are left
out, as B has neither). The ratio A / B of the medians is what the platform costs or
saves; absolute figures drift between runs and machines of this kind, ratios taken side by side much less.
Alternations go A B C, then C B A: with an even `repeats`, drift that runs one way during them favours no side.
The default, 3, is the fewest whose median sets one slow run aside (the median of 2 is their mean); A then runs
first in two alternations of three, so a steady drift is no longer cancelled in full.
With litgpt installed (`make bench` puts it beside the environment; litgpt=auto uses it then), a third side C
runs litgpt's GPT of the same architecture and parameter count in the same loop (benchmarks/litgpt_loop.py).
MFU is taken against the fp32 matrix-product rate measured in the same run, at the same thread count.

Then data-parallel scaling: each strategy in `scaling` on 2 processes x 1 thread against one process x 2
threads, same model and global batch, alternated. Then, for each strategy in `compile_effect` (none unless
named: about half a minute per strategy and alternation here), project.train with strategy.compile=true
against eager under that strategy, same model and global batch, alternated. `presets=` empty times only the
scaling and the compile effect. Then, unless startup=false, the start-up: seconds from the command to the end
of the first optimizer step of `experiment=debug`, split into `import lightning` and the rest, and the
process's peak resident memory.

Writes new files <date>-<host>-platform.json, .md and .svg (the ratios as bars) into `out`; no file there is
edited. `python -m benchmarks.train_step --redraw FILE.json` draws a written report's .md and .svg again.
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
from collections.abc import Callable
from pathlib import Path

from benchmarks.runner import ROOT, free_stem, load_preset, preset_path, result_stem
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError, exit_on_config_error

DEFAULTS = {
    "presets": "debug,small10m,small50m",
    "compiled": "small10m",
    "scaling": "ddp,fsdp2,tp",
    "scaling_preset": "small10m",
    "litgpt": "auto",
    "steps": "",
    "warmup": "1",
    "repeats": "3",
    "threads": "",
    "startup": "true",
    "out": "experiments/benchmarks",
    "compile_effect": "",
}
VOCAB_SIZE, SEQ_LEN = 4096, 256
# Batch and timed steps per preset: steps long enough that a step's timer noise averages out, few enough that
# `make bench` stays within 20 minutes (small10m timed 6 steps until 2026-11-24; its 4 save about a minute).
# debug timed 20 steps until 2026-11-25: 2.3 s, in which one stall of the machine moved a run by 30%.
SHAPES = {
    "debug": {"batch": 8, "steps": 40},
    "small10m": {"batch": 8, "steps": 4},
    "small50m": {"batch": 8, "steps": 3},
}
# Data-parallel scaling: each strategy on 2 processes x 1 thread against one process with 2 threads: its
# launcher (Lightning starts the second process itself; horovodrun starts both) and settings.
HOROVODRUN = [str(Path(sys.executable).parent / "horovodrun"), "-np", "2", "-H", "localhost:2"]
SCALED = {
    "ddp": ([], ["strategy=ddp", "trainer.devices=2"]),
    "fsdp2": ([], ["strategy=fsdp2", "trainer.devices=2"]),
    "tp": ([], ["strategy=tp", "trainer.devices=2"]),
    "horovod": (HOROVODRUN, ["strategy=horovod"]),
}
# strategy.compile=true against eager under each strategy: its processes (the threads split between them), launcher,
# settings and micro batch ("null": each rank's share; the pipeline's 2 make 4 microbatches for 1F1B to overlap).
COMPILE_EFFECT = {
    "single": (1, [], [], None),
    **{name: (2, launcher, settings, "null") for name, (launcher, settings) in SCALED.items()},
    "pipeline": (2, [], ["strategy=pipeline", "trainer.devices=2"], "2"),
}
OPTIM = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}  # conf/train.yaml's


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS)
    presets = [p for p in args["presets"].split(",") if p]
    compiled = [p for p in args["compiled"].split(",") if p]
    if not presets and not any(a.startswith("compiled=") for a in argv):
        compiled = []  # `presets=` alone times the strategies only, not the default compiled preset either
    scaling = [s for s in args["scaling"].split(",") if s]
    compile_effect = [s for s in args["compile_effect"].split(",") if s]
    if not presets and not scaling and not compile_effect:
        raise ConfigError(
            "presets: empty, and so are scaling and compile_effect: nothing to time. Name model presets "
            "(comma-separated, e.g. presets=debug,small10m) or strategies to time alone (e.g. presets= "
            "compile_effect=ddp)."
        )
    for key, names in (("presets", presets), ("compiled", compiled), ("scaling_preset", [args["scaling_preset"]])):
        for name in names:
            if not preset_path(name).is_file():
                raise ConfigError(f"{key}: no model preset {name!r} in conf/model (comma-separated names).")
    for name in scaling:
        if name not in SCALED:
            raise ConfigError(f"scaling: {name!r} is not one of {list(SCALED)} (comma-separated; empty for none).")
    for name in compile_effect:
        if name not in COMPILE_EFFECT:
            raise ConfigError(
                f"compile_effect: {name!r} is not one of {list(COMPILE_EFFECT)} (comma-separated; empty for none)."
            )
    for key, names in (("scaling", scaling), ("compile_effect", compile_effect)):
        if "horovod" in names and not Path(HOROVODRUN[0]).is_file():
            raise ConfigError(
                f"{key}: horovod needs Horovod, which this environment lacks: `make install-horovod` builds it."
            )
    for key in ("steps", "warmup", "repeats", "threads"):
        if args[key] and (not args[key].isdigit() or (key != "warmup" and int(args[key]) < 1)):
            raise ConfigError(f"{key}={args[key]}: expected a positive integer.")
    if args["litgpt"] not in ("auto", "true", "false"):
        raise ConfigError(f"litgpt={args['litgpt']}: choose auto (when installed), true or false.")
    from benchmarks.litgpt_loop import available, reference_path

    if args["litgpt"] == "true" and not available():
        raise ConfigError(
            f"litgpt=true: litgpt is not installed in {reference_path()}; `make bench` installs it there."
        )
    if args["startup"] not in ("true", "false"):
        raise ConfigError(f"startup={args['startup']}: choose true or false.")
    out = Path(args["out"])
    return {
        "startup": args["startup"] == "true",
        "presets": presets,
        "compiled": compiled,
        "scaling": scaling,
        "compile_effect": compile_effect,
        "scaling_preset": args["scaling_preset"],
        "litgpt": args["litgpt"] == "true" or (args["litgpt"] == "auto" and available()),
        "steps": int(args["steps"]) if args["steps"] else None,
        "warmup": int(args["warmup"]),
        "repeats": int(args["repeats"]),
        "threads": int(args["threads"] or os.cpu_count() or 1),
        "out": out if out.is_absolute() else ROOT / out,
    }


def shards(root: Path) -> Path:
    """Shards of generated text at VOCAB_SIZE and SEQ_LEN, prepared once per benchmark run."""
    from benchmarks.data import write_text
    from project.data.prepare import prepare_shards

    folder = root / "shards"
    write_text(root / "raw", megabytes=4)
    prepare_shards(str(root / "raw"), folder, vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN, num_workers=1)
    return folder


def data_settings(data: Path) -> list[str]:
    """The settings `shards` prepared `data` from: a run with other ones is refused (project.config.checks)."""
    return [
        f"data.dir={data}",
        f"data.sources=[{data.parent / 'raw'}]",
        "data.fetch=null",
        f"data.seq_len={SEQ_LEN}",
        f"data.vocab_size={VOCAB_SIZE}",
    ]


def platform_run(
    preset: str,
    batch: int,
    steps: int,
    warmup: int,
    data: Path,
    run_dir: Path,
    env: dict,
    *extra: str,
    micro_batch: str | None = None,
    launcher: list[str] = (),
) -> dict:
    """A: `python -m project.train` for warmup + steps optimizer steps; tokens/s of the last `steps`. The micro
    batch is the whole batch unless given ("null": each data-parallel rank's share, no accumulation)."""
    command = [
        *launcher,
        sys.executable,
        "-m",
        "project.train",
        "experiment=debug",
        f"model={preset}",
        *data_settings(data),
        f"global_batch_size={batch}",
        f"micro_batch_size={micro_batch or batch}",
        f"trainer.max_steps={warmup + steps}",
        "trainer.log_every_n_steps=1",
        "val_every_n_steps=1000000",
        "ckpt_every_n_steps=1000000",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        *extra,
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{result.stderr[-3000:]}")
    with open(run_dir / "metrics.csv", newline="") as f:
        rates = {
            int(r["step"]): float(r["train/tokens_per_sec"]) for r in csv.DictReader(f) if r.get("train/tokens_per_sec")
        }
    timed = [rates[s] for s in sorted(rates)[warmup:]]
    tokens = batch * SEQ_LEN
    # As a user types it: python's path left out (the -m ... part), a launcher's by its name.
    shown = (
        [Path(launcher[0]).name, *launcher[1:], "python", *command[len(launcher) + 1 :]] if launcher else command[1:]
    )
    return {"tokens_per_sec": len(timed) * tokens / sum(tokens / r for r in timed), "command": shlex.join(shown)}


def hand_loop(preset: str, batch: int, steps: int, warmup: int, compiled: bool, model_class: str = "ours") -> dict:
    """B (or C, model_class="litgpt": litgpt's GPT of the same shape), in this process: the model, AdamW and
    clipping, nothing else; compiled block by block as strategy.compile does."""
    import torch
    import torch.nn.functional as F

    from project.model.llama import Llama
    from project.parallel.compiled import compile_blocks

    torch.manual_seed(0)
    config = load_preset(preset, VOCAB_SIZE)
    if model_class == "litgpt":
        from benchmarks.litgpt_loop import litgpt_twin, twin_blocks

        model = litgpt_twin(config, SEQ_LEN)
        if compiled:
            for block in twin_blocks(model):
                block.compile()
    else:
        model = Llama(config)
        if compiled:
            compile_blocks(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": OPTIM["weight_decay"]}, {"params": rest, "weight_decay": 0.0}],
        lr=OPTIM["lr"],
        betas=OPTIM["betas"],
        eps=OPTIM["eps"],
    )
    tokens = torch.randint(0, config.vocab_size, (batch, SEQ_LEN + 1))

    def loss() -> torch.Tensor:
        if model_class == "litgpt":  # litgpt's GPT gives logits
            return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        return model(tokens[:, :-1], targets=tokens[:, 1:])  # the model's loss, as project.train computes it

    def step() -> None:
        loss().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return {"tokens_per_sec": steps * batch * SEQ_LEN / (time.perf_counter() - start)}


def matmul_peak(size: int = 2048, runs: int = 10) -> dict:
    """The machine's fp32 matrix-product rate at this process's thread count: the best of `runs` square products."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # the first product pays for thread start-up
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return {"flops_per_sec": 2 * size**3 / best, "size": size}


def in_own_process(argv: list[str], env: dict) -> dict:
    """One of this module's measurements (--hand-loop, --matmul-peak) in a fresh process with `env`'s threads."""
    command = [sys.executable, "-m", "benchmarks.train_step", *argv]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{result.stderr[-3000:]}")
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "command": shlex.join(command[1:])}


def thread_env(threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "offline"}
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def run_in_balanced_order(sides: list, repeat: int) -> None:
    """Each (results, run) side's run, appended to its results: A B C in even alternations, C B A in odd ones.
    A machine that speeds up or slows down while they run then favours no side, where A first every time
    would take any drift within an alternation on its side alone."""
    for results, run in sides if repeat % 2 == 0 else reversed(sides):
        results.append(run())


def compare(args: dict, data: Path, scratch: Path, peaks: list[dict]) -> list[dict]:
    """Per preset, eager and (for those in `compiled`) compiled: project.train and the hand loop, alternated, and the
    matrix-product rate once per alternation, appended to `peaks` (MFU is filled in against their best)."""
    from project.model.flops import training_flops_per_token

    env = thread_env(args["threads"])
    cases = [(p, False) for p in args["presets"]] + [(p, True) for p in args["compiled"]]
    rows = []
    for preset, compiled in cases:
        shape = SHAPES.get(preset, {"batch": 8, "steps": 4})
        steps, mode = args["steps"] or shape["steps"], "compiled" if compiled else "eager"
        extra = ["strategy.compile=true"] if compiled else []
        ours, hand, twin = [], [], []
        loop = ["--hand-loop", preset, str(shape["batch"]), str(steps), str(args["warmup"]), mode]
        for repeat in range(args["repeats"]):
            run_dir = scratch / f"{preset}-{mode}-{repeat}"
            sides = [
                (ours, lambda: platform_run(preset, shape["batch"], steps, args["warmup"], data, run_dir, env, *extra)),
                (hand, lambda: in_own_process([*loop, "ours"], env)),
            ]
            if args["litgpt"]:
                sides.append((twin, lambda: in_own_process([*loop, "litgpt"], env)))
            run_in_balanced_order(sides, repeat)
            peaks.append(in_own_process(["--matmul-peak"], env))
            print(
                f"{preset} {mode} run {repeat + 1}/{args['repeats']}: project.train {ours[-1]['tokens_per_sec']:,.0f} "
                f"tokens/s, hand loop {hand[-1]['tokens_per_sec']:,.0f}"
                + (f", litgpt {twin[-1]['tokens_per_sec']:,.0f}" if twin else ""),
                flush=True,
            )
        a, b = (statistics.median(r["tokens_per_sec"] for r in runs) for runs in (ours, hand))
        c = statistics.median(r["tokens_per_sec"] for r in twin) if twin else None
        flops = training_flops_per_token(load_preset(preset, VOCAB_SIZE), SEQ_LEN)
        rows.append(
            {
                "preset": preset,
                "mode": mode,
                "batch": shape["batch"],
                "seq_len": SEQ_LEN,
                "steps": steps,
                "warmup": args["warmup"],
                "threads": args["threads"],
                "project_train_tokens_per_sec": round(a, 1),
                "hand_loop_tokens_per_sec": round(b, 1),
                "ratio": round(a / b, 3),
                "litgpt_tokens_per_sec": round(c, 1) if c else None,
                "ratio_to_litgpt": round(a / c, 3) if c else None,
                "flops_per_token": flops,
                "runs": {
                    "project_train": [round(r["tokens_per_sec"], 1) for r in ours],
                    "hand_loop": [round(r["tokens_per_sec"], 1) for r in hand],
                    "litgpt": [round(r["tokens_per_sec"], 1) for r in twin],
                },
                "commands": {
                    "project_train": ours[0]["command"],
                    "hand_loop": hand[0]["command"],
                    "litgpt": twin[0]["command"] if twin else None,
                },
            }
        )
    return rows


def scaling(args: dict, data: Path, scratch: Path) -> list[dict]:
    """Each strategy in `scaling` on 2 processes x 1 thread against one process x 2 threads, the same global batch and
    model (untied embeddings, which tensor parallelism needs), alternated; the ratio is what the split of work costs."""
    preset = args["scaling_preset"]
    shape = SHAPES.get(preset, {"batch": 8, "steps": 4})
    # 3 steps at most: 6 runs per strategy, and the split's cost shows in every step alike.
    steps, model = args["steps"] or min(shape["steps"], 3), ["model.tie_embeddings=false"]
    two_procs = [*model, "threads_per_process=1"]
    rows = []

    def side(folder: str, threads: int, settings: list[str], launcher: list[str] = ()) -> Callable[[int], dict]:
        """One side of the pair: the global batch on two processes of one thread, or one process of two."""
        return lambda repeat: platform_run(
            preset, shape["batch"], steps, args["warmup"], data, scratch / f"{folder}-{repeat}", thread_env(threads),
            *settings, micro_batch="null", launcher=launcher,
        )  # fmt: skip

    for name in args["scaling"]:
        launcher, settings = SCALED[name]
        split = side(f"scale-{name}", 1, [*two_procs, *settings], launcher)
        whole = side(f"scale-single-{name}", 2, model)
        rows.append(
            {
                "strategy": name,
                "preset": preset,
                "batch": shape["batch"],
                "seq_len": SEQ_LEN,
                "steps": steps,
                **paired(f"scaling {name}", {"two_processes": split, "one_process": whole}, args["repeats"]),
            }
        )
    return rows


def compile_effect(args: dict, data: Path, scratch: Path) -> list[dict]:
    """strategy.compile=true against eager under each strategy in `compile_effect`: the scaling preset (untied
    embeddings, which tensor parallelism needs), the same global batch and threads, alternated; the ratio is what
    compiling the blocks gives that layout."""
    preset = args["scaling_preset"]
    shape = SHAPES.get(preset, {"batch": 8, "steps": 4})
    steps = args["steps"] or min(shape["steps"], 3)
    rows = []
    for name in args["compile_effect"]:
        processes, launcher, settings, micro = COMPILE_EFFECT[name]
        threads = max(1, args["threads"] // processes)
        common = [
            "model.tie_embeddings=false",
            *([f"threads_per_process={threads}"] if processes > 1 else []),
            *settings,
        ]

        def side(mode: str, *extra: str):
            return lambda repeat: platform_run(
                preset,
                shape["batch"],
                steps,
                args["warmup"],
                data,
                scratch / f"compile-{name}-{mode}-{repeat}",
                thread_env(threads),
                *common,
                *extra,
                micro_batch=micro,
                launcher=launcher,
            )

        rows.append(
            {
                "strategy": name,
                "preset": preset,
                "processes": processes,
                "threads_per_process": threads,
                "batch": shape["batch"],
                "seq_len": SEQ_LEN,
                "steps": steps,
                **paired(
                    f"compile effect {name}",
                    {"compiled": side("compiled", "strategy.compile=true"), "eager": side("eager")},
                    args["repeats"],
                ),
            }
        )
    return rows


def paired(label: str, sides: dict, repeats: int) -> dict:
    """Two sides, {key: run(repeat) -> {"tokens_per_sec", "command"}}, run in balanced order `repeats` times: each
    side's median tokens/s (`<key>_tokens_per_sec`), runs and command, and the ratio of the first to the second."""
    results = {key: [] for key in sides}
    for repeat in range(repeats):
        run_in_balanced_order([(results[key], lambda run=run: run(repeat)) for key, run in sides.items()], repeat)
        print(
            f"{label} run {repeat + 1}/{repeats}: "
            + ", ".join(
                f"{key.replace('_', ' ')} {runs[-1]['tokens_per_sec']:,.0f} tokens/s" for key, runs in results.items()
            ),
            flush=True,
        )
    medians = {key: statistics.median(r["tokens_per_sec"] for r in runs) for key, runs in results.items()}
    first, second = medians.values()
    return {
        **{f"{key}_tokens_per_sec": round(m, 1) for key, m in medians.items()},
        "ratio": round(first / second, 3),
        "runs": {key: [round(r["tokens_per_sec"], 1) for r in runs] for key, runs in results.items()},
        "commands": {key: runs[0]["command"] for key, runs in results.items()},
    }


# Runs project.train in a process that first imports lightning and records when that finished, so both
# figures come from one process: `import lightning` timed in a process of its own could take longer than a
# whole run a moment later on these machines, and the rest would come out negative.
_TIMED_IMPORT = """import runpy, sys
from project.data.loader_workers import start_worker_server
from project.runtime.startup import collector_paused_for_imports
start_worker_server()  # as project.train does before these imports, so that the server's imports run beside them
with collector_paused_for_imports():  # what project.train imports with the collector paused, lightning first
    import lightning
    from project.training.callbacks.throughput import process_age_seconds
    lightning_imported = process_age_seconds()
    import project.training.run
with open(sys.argv[1], "w") as f: f.write(str(lightning_imported))
sys.argv = ["project.train", *sys.argv[2:]]
runpy.run_module("project.train", run_name="__main__", alter_sys=True)
"""


def startup(data: Path, scratch: Path, env: dict, runs: int = 3) -> dict:
    """Seconds from the command to the end of the first optimizer step of `experiment=debug` on one process (its
    time/seconds_to_first_step), split into `import lightning` (from the same process's start) and the rest; and
    the process's peak resident memory. Medians of `runs`."""
    imports, firsts, peaks = [], [], []
    for i in range(runs):
        run_dir = scratch / f"startup-{i}"
        run_dir.mkdir(parents=True)
        overrides = [
            "experiment=debug",
            *data_settings(data),
            "trainer.max_steps=1",
            "trainer.enable_progress_bar=false",
            f"hydra.run.dir={run_dir}",
        ]
        subprocess.run(
            [sys.executable, "-c", _TIMED_IMPORT, str(run_dir / "import-seconds"), *overrides],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
        imports.append(float((run_dir / "import-seconds").read_text()))
        with open(run_dir / "metrics.csv", newline="") as f:
            firsts.append(
                next(
                    float(r["time/seconds_to_first_step"])
                    for r in csv.DictReader(f)
                    if r.get("time/seconds_to_first_step")
                )
            )
        peaks.append(json.loads((run_dir / "memory" / "rank0.json").read_text())["peak_bytes"])
    first, lightning = statistics.median(firsts), statistics.median(imports)
    return {
        "command": shlex.join(["-m", "project.train", *overrides[:-1]]),
        "seconds_to_first_step": round(first, 2),
        "import_lightning_seconds": round(lightning, 2),
        "rest_seconds": round(first - lightning, 2),
        "peak_rss_mib": round(statistics.median(peaks) / 2**20),
        "runs": {
            "seconds_to_first_step": [round(x, 2) for x in firsts],
            "import_lightning_seconds": [round(x, 2) for x in imports],
        },
    }


def table(report: dict) -> str:
    lines = [
        f"# project.train against a hand-written loop, {report['date']} on {report['hostname']}",
        "",
        f"{report['platform']}, torch {report['torch']}, {report['threads']} threads per process; medians of "
        f"{report['repeats']} alternated runs each. Command: `{report['command']}`",
    ]
    if report["rows"]:  # none where only scaling or compile_effect was asked for
        lines += comparison_lines(report)
    if report.get("scaling"):
        lines += section(
            "Data-parallel scaling: 2 processes x 1 thread against 1 process x 2 threads, the same global batch",
            ["strategy", "preset", "batch x seq", "2 x 1 thread tokens/s", "1 x 2 threads tokens/s", "ratio"],
            [
                [
                    r["strategy"],
                    r["preset"],
                    f"{r['batch']} x {r['seq_len']}",
                    f"{r['two_processes_tokens_per_sec']:,.0f}",
                    f"{r['one_process_tokens_per_sec']:,.0f}",
                    f"{r['ratio']:.3f}",
                ]
                for r in report["scaling"]
            ],
        )
    if report.get("compile_effect"):
        lines += section(
            "`strategy.compile=true` against eager, per strategy: the same model and global batch",
            [
                "strategy",
                "processes x threads",
                "preset",
                "batch x seq",
                "compiled tokens/s",
                "eager tokens/s",
                "ratio",
            ],
            [
                [
                    r["strategy"],
                    f"{r['processes']} x {r['threads_per_process']}",
                    r["preset"],
                    f"{r['batch']} x {r['seq_len']}",
                    f"{r['compiled_tokens_per_sec']:,.0f}",
                    f"{r['eager_tokens_per_sec']:,.0f}",
                    f"{r['ratio']:.3f}",
                ]
                for r in report["compile_effect"]
            ],
        )
    if report.get("startup"):
        s = report["startup"]
        lines += [
            "",
            f"Start-up of `{s['command']}` (one process; medians of {len(s['runs']['seconds_to_first_step'])}):",
            f"**{s['seconds_to_first_step']} s** from the command to the end of the first optimizer step = "
            f"`import lightning` {s['import_lightning_seconds']} s (from the process's start) + the rest "
            f"{s['rest_seconds']} s (target: the rest <= 2 s); "
            f"peak resident memory {s['peak_rss_mib']:,} MiB.",
        ]
    return "\n".join(lines) + "\n"


def section(title: str, columns: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "",
        f"## {title}",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def comparison_lines(report: dict) -> list[str]:
    """The presets' rows: project.train against the hand loop and litgpt, with MFU against the measured peak."""
    peak = report["matmul_peak"]
    lines = [
        "",
        "MFU: model FLOPs (6N + attention) x tokens/s over this machine's fp32 matrix-product rate, measured in the "
        f"same run at the same threads: {peak['flops_per_sec'] / 1e9:,.1f} GFLOP/s ({peak['size']} x {peak['size']}, "
        "best of 10 products, "
        + (
            f"best of {len(peak['runs'])} measurements, one per alternation)."
            if "runs" in peak
            else "measured once, at the start)."
        ),
        "",
        "| preset | mode | batch x seq | timed steps | project.train tokens/s | hand loop tokens/s | ratio (target >= "
        "0.97) | litgpt tokens/s | project.train / litgpt (target >= 1.0) | MFU project.train | MFU hand loop |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        litgpt = (
            f"{r['litgpt_tokens_per_sec']:,.0f} | {r['ratio_to_litgpt']:.3f}"
            if r["litgpt_tokens_per_sec"]
            else "not run | -"
        )
        lines.append(
            f"| {r['preset']} | {r['mode']} | {r['batch']} x {r['seq_len']} | {r['steps']} | "
            f"{r['project_train_tokens_per_sec']:,.0f} | {r['hand_loop_tokens_per_sec']:,.0f} | {r['ratio']:.3f} | "
            f"{litgpt} | {r['project_train_mfu']:.1%} | {r['hand_loop_mfu']:.1%} |"
        )
    eager = {r["preset"]: r for r in report["rows"] if r["mode"] == "eager"}
    effects = [
        f"{r['preset']} x{r['project_train_tokens_per_sec'] / eager[r['preset']]['project_train_tokens_per_sec']:.2f}"
        for r in report["rows"]
        if r["mode"] == "compiled" and r["preset"] in eager
    ]
    if effects:
        lines += ["", "`strategy.compile=true` against eager, project.train: " + ", ".join(effects) + "."]
    return lines + [
        "",
        "litgpt: its `GPT` with our preset's architecture and parameter count (benchmarks/litgpt_loop.py), in "
        "the hand loop, compiled block by block as ours. Each run's figures are in the .json file, with the commands.",
    ]


def plot(report: dict) -> str:
    """The ratios as bars: project.train against the hand loop and litgpt per preset and mode, then the scaling and
    the effect of compiling per strategy."""
    from benchmarks.svg_plots import bar_chart

    bars = []
    for r in report["rows"]:
        bars.append((f"{r['preset']} {r['mode']}: project.train / hand loop", r["ratio"]))
        if r.get("ratio_to_litgpt"):
            bars.append((f"{r['preset']} {r['mode']}: project.train / litgpt", r["ratio_to_litgpt"]))
    for r in report.get("scaling") or []:
        bars.append((f"{r['strategy']} {r['preset']}: 2 x 1 thread / 1 x 2 threads", r["ratio"]))
    for r in report.get("compile_effect") or []:
        bars.append((f"{r['strategy']} {r['preset']}: compiled / eager", r["ratio"]))
    return bar_chart(
        f"Tokens/s ratios, {report['date']} on {report['hostname']} (1.0: as fast)",
        bars,
        "ratio of tokens/s (medians of alternated runs)",
        ".3f",
    )


def write_report(report: dict, out: Path) -> Path:
    stem = free_stem(result_stem(out, "-platform"), [".json", ".md", ".svg"])
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_name(stem.name + ".md").write_text(table(report))
    stem.with_name(stem.name + ".svg").write_text(plot(report))
    return stem


def main() -> None:
    if sys.argv[1:2] == ["--redraw"]:  # the .md and .svg of a .json written before, beside it
        source = Path(sys.argv[2])
        report = json.loads(source.read_text())
        source.with_suffix(".md").write_text(table(report))
        source.with_suffix(".svg").write_text(plot(report))
        return
    if sys.argv[1:2] == ["--hand-loop"]:  # B, started by compare() in a process of its own
        preset, (batch, steps, warmup), mode, model_class = (
            sys.argv[2],
            map(int, sys.argv[3:6]),
            sys.argv[6],
            sys.argv[7],
        )
        print(json.dumps(hand_loop(preset, batch, steps, warmup, compiled=mode == "compiled", model_class=model_class)))
        return
    if sys.argv[1:2] == ["--matmul-peak"]:
        print(json.dumps(matmul_peak()))
        return
    with exit_on_config_error():
        args = parse(sys.argv[1:])
    import torch

    env = thread_env(args["threads"])
    with tempfile.TemporaryDirectory(prefix="bench-platform-") as scratch:
        data = shards(Path(scratch))
        peaks: list[dict] = []  # measured again in every alternation: this machine's speed drifts within a run
        rows = compare(args, data, Path(scratch), peaks)
        peak = (
            {**max(peaks, key=lambda p: p["flops_per_sec"]), "runs": [round(p["flops_per_sec"]) for p in peaks]}
            if peaks
            else None
        )
        for row in rows:
            row["project_train_mfu"] = round(
                row["project_train_tokens_per_sec"] * row["flops_per_token"] / peak["flops_per_sec"], 4
            )
            row["hand_loop_mfu"] = round(
                row["hand_loop_tokens_per_sec"] * row["flops_per_token"] / peak["flops_per_sec"], 4
            )
        scaled = scaling(args, data, Path(scratch))
        compile_rows = compile_effect(args, data, Path(scratch))
        started = startup(data, Path(scratch), env, runs=args["repeats"]) if args["startup"] else None
    report = {
        "date": datetime.date.today().isoformat(),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": args["threads"],
        "repeats": args["repeats"],
        "command": shlex.join(["python", "-m", "benchmarks.train_step", *sys.argv[1:]]),
        "matmul_peak": peak,
        "rows": rows,
        "scaling": scaled,
        "compile_effect": compile_rows,
        "startup": started,
    }
    stem = write_report(report, args["out"])
    print(table(report) + f"\nwritten: {stem}.json, .md and .svg")


if __name__ == "__main__":
    main()

"""The check's four sections in order, each within its share of the time, with progress on the console; then the
report (tools.gpu_check.report)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.data import loader_rate, write_text
from benchmarks.runner import ROOT, load_preset
from tools.gpu_check import attention, correctness, links, speed
from tools.gpu_check.environment import describe

# Each section's share of the time budget (what one leaves, the next may use); `sections=` that leaves some out
# shares the budget among the others in the same proportions.
SECTION_SHARES = {"correctness": 0.45, "speed": 0.45, "data": 0.1}
# What the speed section times, by device: the presets (a ~1B Llama, then the largest of the others that the
# planner fits on one device), sequence lengths, micro batch cap, precision, and timed and warm-up steps.
SPEED = {
    "cuda": {
        "first": "llama3_2_1b",
        "larger": ["llama3_8b", "llama2_7b"],
        "seq_lens": [2048, 8192],
        "cap": 64,
        "precision": "bf16-mixed",
        "steps": 10,
        "warmup": 3,
        "text_mb": 8,
        "all_reduce_mb": [64, 256],
        "all_reduces": 10,
        "attention_steps": 3,
    },
    # The same plumbing in seconds: the debug model, fp32 (bf16 matrix products crawl on most CPUs).
    "cpu": {
        "first": "debug",
        "larger": [],
        "seq_lens": [128],
        "cap": 4,
        "precision": "32-true",
        "steps": 3,
        "warmup": 1,
        "text_mb": 1,
        "all_reduce_mb": [4],
        "all_reduces": 3,
        "attention_steps": 2,
    },
}
# Of the speed section's time, what the links' and the ring's timings may take before the training steps'.
KERNELS_SHARE = 0.25


@dataclass
class Options:
    device: str  # cuda | cpu
    devices: int
    minutes: float
    out: Path
    sections: tuple[str, ...] = tuple(SECTION_SHARES)
    float8: tuple[str, ...] = ()  # strategy.float8 recipes each compiled step is timed in again


def say(text: str) -> None:
    print(text, flush=True)


def per_process_threads(devices: int) -> int:
    """Threads of each process of a run: the cores split between the run's processes (on a CPU, between the
    processes that stand in for devices)."""
    return max(1, (os.cpu_count() or 1) // devices)


def child_env(threads: int) -> dict:
    """The runs' environment: their thread count, wandb offline, output unbuffered."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def prepare(work: Path, megabytes: float, seq_len: int, env: dict, tokenizer: Path | None = None) -> dict:
    """Generated text in `work/raw` (written once), prepared by `python -m project.prepare` for `seq_len`."""
    raw = work / "raw"
    if not raw.is_dir():
        write_text(raw, megabytes)
    folder = work / f"shards-{seq_len}"
    argv = [
        sys.executable,
        "-m",
        "project.prepare",
        "experiment=debug",
        f"data.dir={folder}",
        f"data.sources=[{raw}/*.txt]",
        "data.fetch=null",
        f"data.seq_len={seq_len}",
        f"data.vocab_size={correctness.VOCAB_SIZE}",
        *([f"data.tokenizer={tokenizer}"] if tokenizer else []),
    ]
    finished = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"preparing the check's data failed:\n{finished.stderr[-3000:]}")
    return {"dir": str(folder), "sources": f"{raw}/*.txt"}


def run_correctness(options: Options, data: dict, work: Path, env: dict, deadline: float) -> list[dict]:
    found = correctness.cases(options.device, options.devices, options.float8)
    done: dict[str, correctness.Result] = {}
    for i, case in enumerate(found, 1):
        result = correctness.run_case(
            case, options.device, options.devices, data, work / "runs", env, done, deadline - time.monotonic()
        )
        done[case.name] = result
        figure = (
            f", max rel. diff {result.max_rel_diff:.1e} (tolerance {result.tolerance:.0e})"
            if result.tolerance and result.max_rel_diff is not None
            else ""
        )
        timing = f", {result.seconds} s" if result.seconds is not None else ""
        say(
            f"[correctness {i}/{len(found)}] {case.name}: {result.status}{figure}{timing}"
            + (f": {result.detail}" if result.detail else "")
        )
    return [{k: v for k, v in asdict(r).items() if k != "losses"} | {"losses": r.losses} for r in done.values()]


def speed_presets(options: Options, facts: dict) -> tuple[list[str], list[dict]]:
    """The presets to time, and those left out with the planner's reason: the ~1B model and the largest other
    preset whose step fits the device at micro batch 1 and the shortest sequence, by the planner's count."""
    plan = SPEED[options.device]
    cluster = speed.device_cluster(
        facts["device_name"], options.device, facts["memory_bytes"], facts["peak_flops"], facts.get("memory_gbps")
    )
    chosen, left_out = [plan["first"]], []
    for name in plan["larger"]:
        config = load_preset(name, correctness.VOCAB_SIZE)
        if speed.planned_micro_batch(config, plan["seq_lens"][0], plan["precision"], cluster, 1):
            chosen.append(name)
            break
        left_out.append({"preset": name, "why": "the planner does not fit its step on one device at micro batch 1"})
    return chosen, left_out


def time_step(setting: speed.Setting, env: dict, deadline: float) -> tuple[speed.Setting, dict]:
    """Measure `setting`, halving its micro batch after each out-of-memory error; the setting that ran, the outcome."""
    mode = ("compiled" if setting.compile else "eager") + (f", float8 {setting.float8}" if setting.float8 else "")
    while True:
        if deadline - time.monotonic() < 1:
            return setting, {"ok": False, "error": "out of time (minutes=)"}
        say(f"[speed] {setting.preset}, {setting.seq_len} tokens, micro batch {setting.micro_batch}, {mode} ...")
        outcome = speed.measure(setting, env, deadline - time.monotonic())
        if outcome.get("oom") and setting.micro_batch == 1:
            return setting, {**outcome, "error": f"does not fit: out of memory at micro batch 1 ({outcome['error']})"}
        if not outcome.get("oom"):
            return setting, outcome
        say(f"[speed] out of memory at micro batch {setting.micro_batch}: halving it")
        setting = replace(setting, micro_batch=setting.micro_batch // 2)


def run_speed(options: Options, facts: dict, env: dict, deadline: float) -> tuple[list[dict], list[dict]]:
    plan = SPEED[options.device]
    peak = facts["peak_flops"].get("bf16" if plan["precision"] == "bf16-mixed" else "fp32")
    cluster = speed.device_cluster(
        facts["device_name"], options.device, facts["memory_bytes"], facts["peak_flops"], facts.get("memory_gbps")
    )
    presets, left_out = speed_presets(options, facts)
    rows = []
    for preset in presets:
        config = load_preset(preset, correctness.VOCAB_SIZE)
        for seq_len in plan["seq_lens"]:
            micro = speed.planned_micro_batch(config, seq_len, plan["precision"], cluster, plan["cap"])
            if micro == 0:
                left_out.append({"preset": preset, "seq_len": seq_len, "why": "the planner fits no micro batch"})
                continue
            # Eager first: finding the micro batch that fits costs no compilation there, and compiled then runs at
            # the same one. The first compiled step of each preset is profiled: where its time goes.
            for compiled in (False, True):
                setting = speed.Setting(
                    preset,
                    seq_len,
                    micro,
                    compiled,
                    plan["precision"],
                    options.device,
                    plan["steps"],
                    plan["warmup"],
                    correctness.VOCAB_SIZE,
                    profile=compiled and seq_len == plan["seq_lens"][0],
                )
                setting, outcome = time_step(setting, env, deadline)
                micro = setting.micro_batch
                planned = speed.prediction(config, seq_len, micro, plan["precision"], cluster, compiled)
                rows.append(speed.row(setting, outcome, config, peak, planned))
                said(rows[-1], outcome)
            # The compiled step again with its blocks' linear layers in float8, each from the micro batch bf16 took.
            compiled_step = setting
            for recipe in options.float8 if rows and rows[-1]["status"] == "measured" else ():
                setting, outcome = time_step(replace(compiled_step, float8=recipe, profile=False), env, deadline)
                planned = speed.prediction(
                    config, seq_len, setting.micro_batch, plan["precision"], cluster, True, recipe
                )
                rows.append(speed.row(setting, outcome, config, peak, planned))
                said(rows[-1], outcome)
    return rows, left_out


def run_links(options: Options, facts: dict, env: dict, deadline: float) -> list[dict]:
    """Where there are two devices or more: an all-reduce over all of them, its bus bandwidth beside the planner's."""
    if options.devices < 2:
        return []
    plan, rows = SPEED[options.device], []
    for megabytes in plan["all_reduce_mb"]:
        if deadline - time.monotonic() < 1:
            rows.append(links.row(facts, megabytes, {"ok": False, "skipped": True, "error": "out of time (minutes=)"}))
            continue
        say(f"[links] all-reduce of {megabytes} MiB over {options.devices} devices ...")
        outcome = links.measure(
            options.devices, options.device, megabytes, plan["all_reduces"], env, deadline - time.monotonic()
        )
        rows.append(links.row(facts, megabytes, outcome))
        found = rows[-1]
        planned = f" (the planner's {found['preset']}: {found['planner_gbps']:g} GB/s)" if "preset" in found else ""
        say(f"[links]   {found.get('bus_gbps', 'not measured')} GB/s bus bandwidth{planned}")
    return rows


def run_attention(options: Options, env: dict, deadline: float) -> list[dict]:
    """Ring attention's kernels against the fused one on one device, at each length the device takes."""
    rows = []
    for length in attention.LENGTHS[options.device]:
        if deadline - time.monotonic() < 1:
            rows.append(attention.row(length, {"ok": False, "skipped": True, "error": "out of time (minutes=)"}))
            continue
        say(f"[attention] ring against fused attention, {length} tokens on one device ...")
        outcome = attention.measure(
            options.device, length, SPEED[options.device]["attention_steps"], env, deadline - time.monotonic()
        )
        rows.append(attention.row(length, outcome))
        ratio = rows[-1].get("ring_over_fused")
        say(f"[attention]   the ring takes {ratio}x the fused kernel's time" if ratio else "[attention]   not measured")
    return rows


def said(row: dict, outcome: dict) -> None:
    if outcome.get("ok"):
        mfu = f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else ""
        say(f"[speed]   {row['tokens_per_sec']:,.0f} tokens/s{mfu}")
    else:
        say(f"[speed]   not measured: {outcome.get('error', '')}")


def run_data_path(options: Options, work: Path, env: dict, rows: list[dict], deadline: float) -> dict:
    """The train loader's tokens/s (one replica, one worker) at the speed section's first sequence length and
    micro batch, against what the fastest step measured there consumes per device."""
    timed = [r for r in rows if r.get("tokens_per_sec")]
    if not timed:
        return {"status": "skip", "why": "no step was timed"}
    first = timed[0]
    if deadline - time.monotonic() < 5:
        return {"status": "skip", "why": "out of time (minutes=)"}
    data = prepare(
        work,
        SPEED[options.device]["text_mb"],
        first["seq_len"],
        env,
        work / f"shards-{correctness.SEQ_LEN}" / "tokenizer.json",
    )
    consumed = max(r["tokens_per_sec"] for r in timed if r["seq_len"] == first["seq_len"])
    batches = 20
    rate = loader_rate(data["dir"], batches, seq_len=first["seq_len"], micro_batch=first["micro_batch"])
    return {
        "status": "measured",
        "seq_len": first["seq_len"],
        "micro_batch": first["micro_batch"],
        "batches": batches,
        "loader_tokens_per_sec": round(rate, 1),
        "step_tokens_per_sec": consumed,
        "headroom": round(rate / consumed, 2),
    }


def section_ends(start: float, budget: float, sections: tuple[str, ...]) -> dict[str, float]:
    """The monotonic time by which each chosen section must end: the budget shared among them by their shares."""
    total = sum(SECTION_SHARES[name] for name in sections)
    ends, elapsed = {}, 0.0
    for name, share in SECTION_SHARES.items():
        if name in sections:
            elapsed += share / total
            ends[name] = start + elapsed * budget
    return ends


def run(options: Options) -> dict:
    """Every section; the report as a dict (tools.gpu_check.report writes and prints it)."""
    start = time.monotonic()
    budget = options.minutes * 60
    ends = section_ends(start, budget, options.sections)
    say(f"checking {options.devices} {options.device} device(s) in at most {options.minutes:g} minutes")
    threads = per_process_threads(options.devices)
    facts = describe(options.device, options.devices, threads)
    say(f"[environment] {facts['devices']} x {facts['device_name']}, torch {facts['torch']}")
    env = child_env(threads)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    report: dict = {"environment": facts, "minutes": options.minutes}
    report["errors"] = []

    def section(name: str, work_of_section, default):
        """A section's result; an error in it is reported (and fails the check) without losing the others'."""
        try:
            return work_of_section()
        except Exception:  # a bug or a broken environment: the report still gets written
            report["errors"].append({"section": name, "traceback": traceback.format_exc()[-3000:]})
            say(f"[{name}] error:\n{report['errors'][-1]['traceback']}")
            return default

    report["sections"] = list(options.sections)
    data = None
    if {"correctness", "data"} & set(options.sections):  # the speed section times random tokens
        data = section("data", lambda: prepare(work, SPEED[options.device]["text_mb"], correctness.SEQ_LEN, env), None)
    if data is not None and "correctness" in options.sections:
        report["correctness"] = section(
            "correctness", lambda: run_correctness(options, data, work, env, ends["correctness"]), []
        )
    report["speed"], report["speed_left_out"], report["links"], report["attention"] = [], [], [], []
    if "speed" in options.sections:
        kernels_end = time.monotonic() + KERNELS_SHARE * (ends["speed"] - time.monotonic())
        report["links"] = section("links", lambda: run_links(options, facts, env, kernels_end), [])
        report["attention"] = section("attention", lambda: run_attention(options, env, kernels_end), [])
        report["speed"], report["speed_left_out"] = section(
            "speed", lambda: run_speed(options, facts, env, ends["speed"]), ([], [])
        )
    report["data_path"] = {"status": "skip", "why": "not among sections="}
    if "data" in options.sections:
        report["data_path"] = section(
            "data path",
            lambda: run_data_path(options, work, env, report["speed"], ends["data"]),
            {"status": "skip", "why": "an error, above"},
        )
    if any(r["status"] == "fail" for r in report.get("correctness", [])) or report["errors"]:
        report["work_dir"] = str(work)  # the failed runs' logs (train.log in each run directory) stay
    else:
        shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = round(time.monotonic() - start, 1)
    return report

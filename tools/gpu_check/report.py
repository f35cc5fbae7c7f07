"""The check's report: a JSON record and a Markdown page, new files named after the date and the device."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from benchmarks.runner import write_report
from tools.gpu_check.environment import lines as environment_lines
from tools.gpu_check.speed import PROFILED_STEPS


def stem(out: Path, facts: dict) -> Path:
    """`out/<date>-<gpu name>-gpu` (`<date>-<host>-cpu-check` for the CPU plumbing); write_report takes the next
    free one if that is taken."""
    if facts["device_type"] == "cuda":
        name = re.sub(r"[^a-z0-9]+", "-", facts["device_name"].lower()).strip("-") + "-gpu"
    else:
        name = re.sub(r"[^a-z0-9]+", "-", facts["host"].split(".")[0].lower()).strip("-") + "-cpu-check"
    return out / f"{datetime.date.today().isoformat()}-{name}"


def failures(report: dict) -> list[str]:
    """What failed: correctness cases, and speed steps that ran but gave a non-finite loss or an error."""
    failed = [f"error in the {e['section']} section" for e in report.get("errors", [])]
    failed += [f"correctness: {r['name']}" for r in report.get("correctness", []) if r["status"] == "fail"]
    for name, rows in (("links", report.get("links", [])), ("ring attention", report.get("attention", []))):
        failed += [f"{name}: {last_line(r['error'])}" for r in rows if r["status"] == "failed"]
    for r in report.get("speed", []):
        if r["status"] == "measured" and not r.get("loss_finite"):
            failed.append(f"speed: {r['preset']} at {r['seq_len']} tokens, {r['mode']}: the loss is not finite")
        elif r["status"] == "failed":
            failed.append(f"speed: {r['preset']} at {r['seq_len']} tokens, {r['mode']}: {r['error'].splitlines()[0]}")
    return failed


def last_line(error: str | None) -> str:
    """An error's last non-empty line: the exception, where a traceback ends."""
    return ((error or "").strip().splitlines() or ["no output"])[-1]


def skipped(report: dict) -> list[str]:
    """What did not run, and why: cases and steps skipped for time, for want of devices, or too large."""
    cases = [f"{r['name']} ({r['detail']})" for r in report.get("correctness", []) if r["status"] == "skip"]
    cases += [f"links, {r['megabytes']:g} MiB ({last_line(r['error'])})" for r in report.get("links", [])
              if r["status"] == "skipped"]  # fmt: skip
    cases += [f"ring attention at {r['length']} tokens ({last_line(r['error'])})" for r in report.get("attention", [])
              if r["status"] == "skipped"]  # fmt: skip
    steps = [
        f"{r['preset']} at {r['seq_len']} tokens, {r['mode']} ({r['error'].splitlines()[0]})"
        for r in report.get("speed", [])
        if r["status"] == "skipped"
    ]
    return cases + steps


def _number(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:.2f}M"


# Issue #32's goal for the ~1B compiled bf16 step on an H100, above Megatron-LM's published 47%.
MFU_GOAL = 0.5


def profile_lines(report: dict) -> list[str]:
    """Where the time of each profiled step goes: shares by kind, and the largest operators or kernels."""
    out = []
    for r in report.get("speed", []):
        profiled = r.get("profile")
        if not profiled:
            continue
        goal = ""
        if report["environment"]["device_type"] == "cuda" and r["mfu"] is not None:
            reached = "reaches" if r["mfu"] >= MFU_GOAL else "is below"
            goal = f" Its MFU, {r['mfu']:.1%}, {reached} the goal of {MFU_GOAL:.0%}."
        kinds = ", ".join(f"{kind} {share:.0%}" for kind, share in profiled["kinds"].items())
        out += [
            "",
            f"### Where the time goes: {r['preset']}, {r['seq_len']} tokens, {r['mode']}",
            "",
            f"torch.profiler over {PROFILED_STEPS} more steps, self time of each operator ({profiled['clock']} clock, "
            f"{profiled['ms_per_step']:.1f} ms per step in all): {kinds}.{goal}",
            "",
            "| operator or kernel | kind | ms per step | share |",
            "|---|---|---|---|",
            *(f"| `{t['name']}` | {t['kind']} | {t['ms_per_step']:.2f} | {t['share']:.1%} |" for t in profiled["top"]),
        ]
    return out


def kernel_lines(report: dict) -> list[str]:
    """The links' bus bandwidth beside the planner's figure, and ring attention against the fused kernel."""
    out = []
    if report.get("links"):
        out += [
            "",
            "## Links",
            "",
            "An all-reduce over every device of the machine (tools/gpu_check/links.py): its bus bandwidth, NCCL's "
            "measure, beside the planner's link figure (`intra_node_gbps` of its preset for this device) and the time "
            "it predicts for the call.",
            "",
            "| devices | MiB | seconds | bus GB/s | planner's preset | planner GB/s | planner seconds |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in report["links"]:
            out.append(
                f"| {r['devices']} | {r['megabytes']:g} | {_number(r.get('seconds'), '.4f')} | "
                f"{_number(r.get('bus_gbps'), '.1f')} | {r.get('preset', 'none')} | "
                f"{_number(r.get('planner_gbps'), 'g')} | {_number(r.get('planner_seconds'), '.4f')} |"
            )
    if report.get("attention"):
        out += [
            "",
            "## Ring attention on one device",
            "",
            "A causal attention's forward and backward over one sequence with Llama 3 8B's heads: ring attention's "
            "written-out float32 math (a ring of one rank) against torch's fused kernel, which the gather runs "
            "(tools/gpu_check/attention.py).",
            "",
            "| tokens | ring ms | fused ms | ring / fused | ring peak GiB | fused peak GiB | max abs. diff |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in report["attention"]:
            if r["status"] != "measured":
                out.append(f"| {r['length']} | not measured: {last_line(r['error'])} | | | | | |")
                continue
            out.append(
                f"| {r['length']} | {r['ring_ms']:.1f} | {r['fused_ms']:.1f} | {r['ring_over_fused']:.2f} | "
                f"{r['ring_peak_gib']:.2f} | {r['fused_peak_gib']:.2f} | {r['max_abs_diff']:.1e} |"
            )
    return out


def markdown(report: dict) -> str:
    facts = report["environment"]
    failed = failures(report)
    verdict = f"**{len(failed)} failed**: " + "; ".join(failed) + "." if failed else "**Every check that ran passed.**"
    if left := skipped(report):
        verdict += f" Not run: {'; '.join(left)}."
    out = [
        f"# GPU check, {report['date']}: {facts['devices']} x {facts['device_name']}",
        "",
        f"Command: `{report['command']}`; {report['seconds']:.0f} s of a {report['minutes']:g}-minute budget. "
        + verdict,
        "",
        "## Environment",
        "",
        *environment_lines(facts),
        "",
        "## Correctness",
        "",
        "The debug model trained 20 steps by `python -m project.train` in each case; every step's loss against the "
        "reference run's at the same step (largest relative difference).",
        "",
        "| case | what it proves | against | max rel. diff | tolerance | result | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report.get("correctness", []):
        result = r["status"] + (f": {r['detail'].splitlines()[0]}" if r["detail"] else "")
        out.append(
            f"| {r['name']} | {r['proves']} | {r['reference'] or '-'} | {_number(r['max_rel_diff'], '.1e')} | "
            f"{_number(r['tolerance'], '.0e')} | {result} | {_number(r['seconds'], '.1f')} |"
        )
    out += [
        "",
        "## Speed",
        "",
        "One device's training step (forward, float32 cross-entropy, backward, clipping, AdamW) on random tokens, "
        "compiled block by block and eager; MFU against the peak above. The planner's columns are its prediction "
        "for the same model, micro batch and device (`project.planning`, achievable fraction 0.5); the last column "
        "is the achievable fraction at which it predicts the measured tokens/s (`project.plan achievable_fraction=`).",
        "",
        "| model | parameters | seq | micro batch | mode | precision | tokens/s | MFU | peak memory (GiB) | "
        "planner tokens/s | planner MFU | planner memory (GiB) | fraction measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.get("speed", []):
        planned = r["planner"]
        measured = (
            _number(r["tokens_per_sec"], ",.0f")
            if r["tokens_per_sec"]
            else f"not measured: {r['error'].splitlines()[0]}"
        )
        out.append(
            f"| {r['preset']} | {_count(r['parameters'])} | {r['seq_len']} | {r['micro_batch']} | {r['mode']} | "
            f"{r['precision']} | {measured} | {_number(r['mfu'], '.1%')} | {_number(r['peak_memory_gib'], '.1f')} | "
            f"{_number(planned.get('tokens_per_sec'), ',.0f')} | {_number(planned.get('mfu'), '.1%')} | "
            f"{_number(planned.get('memory_gib'), '.1f')} | {_number(planned.get('fraction'), '.3f')} |"
        )
    for left in report.get("speed_left_out", []):
        out.append(
            f"\nNot timed: {left['preset']}"
            + (f" at {left['seq_len']} tokens" if "seq_len" in left else "")
            + f": {left['why']}."
        )
    out += profile_lines(report)
    out += kernel_lines(report)
    data = report.get("data_path", {})
    out += ["", "## Data path", ""]
    if data.get("status") == "measured":
        out.append(
            f"The train loader (one replica, one worker) delivered {data['loader_tokens_per_sec']:,.0f} tokens/s at "
            f"{data['seq_len']} tokens and micro batch {data['micro_batch']}; the fastest step above consumes "
            f"{data['step_tokens_per_sec']:,.0f} tokens/s per device: **{data['headroom']}x** headroom."
        )
    else:
        out.append(f"Not measured: {data.get('why', 'the check stopped before it')}.")
    for error in report.get("errors", []):
        out += ["", f"Error in the {error['section']} section:", "", "```", error["traceback"].rstrip(), "```"]
    if report.get("work_dir"):
        out += ["", f"The runs' directories (train.log, metrics.csv) are kept in `{report['work_dir']}`."]
    return "\n".join(out) + "\n"


def write(report: dict, out: Path) -> Path:
    """New `<stem>.json` and `<stem>.md` in `out`; returns the stem."""
    return write_report(stem(out, report["environment"]), report, markdown(report))

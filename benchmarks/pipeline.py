"""Pipeline bubble: step time against the number of microbatches, for torch's schedules on this machine.

    python -m benchmarks.pipeline [pp=2] [schedules=gpipe,1f1b,interleaved_1f1b] [microbatches=1,2,4,8,16]
                                     [dim=512] [layers=8] [seq_len=256] [steps=3] [out=experiments/benchmarks]

Each pipeline rank is a gloo process with one thread, running our stage chunks under torch's schedule
(forward and backward of every microbatch, no optimizer). The reference is one process with one thread
running the whole model over the same microbatches one after another. Measured pipeline efficiency is
reference time / (p x pipeline time); the ideal is m / (m + p - 1) for GPipe and 1F1B, and
m / (m + (p - 1) / v) for interleaved 1F1B with v chunks per rank (Narayanan et al. 2021).
Writes <out>/<date>-<host>-pipeline-bubble-pp<p>.jsonl (the rows), .md (table) and .svg (plot): new files
for each run (a second run on the same day and machine gets a numbered name; results are never edited).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.runner import free_port, free_stem, result_stem
from project.model.config import LlamaConfig
from project.model.llama import Llama
from project.parallel.mesh import MeshShape
from project.parallel.pipeline import SCHEDULES, build_schedule, split_into_stages
from project.parallel.pipeline_layout import check_pipeline, default_virtual_stages
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError, exit_on_config_error

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {
    "pp": "2",
    "schedules": "gpipe,1f1b,interleaved_1f1b",
    "microbatches": "1,2,4,8,16",
    "dim": "512",
    "layers": "8",
    "seq_len": "256",
    "steps": "3",
    "out": "experiments/benchmarks",
}


def parse(argv: list[str]) -> dict[str, str]:
    args = parse_key_values(argv, DEFAULTS)
    for name in args["schedules"].split(","):
        if name not in SCHEDULES:
            raise ConfigError(f"schedules: {name!r} is not one of {list(SCHEDULES)}.")
    return args


def model_config(args: dict[str, str]) -> LlamaConfig:
    dim = int(args["dim"])
    return LlamaConfig(
        vocab_size=512,
        dim=dim,
        n_layers=int(args["layers"]),
        n_heads=dim // 64,
        multiple_of=64,
        max_seq_len=int(args["seq_len"]),
    )


def batch(config: LlamaConfig, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, config.vocab_size, (m, config.max_seq_len + 1), generator=torch.Generator().manual_seed(0)
    )
    return tokens[:, :-1], tokens[:, 1:]


def reference_seconds(config: LlamaConfig, m: int, steps: int) -> float:
    """One thread, the whole model, m microbatches of one sequence: forward and backward each."""
    torch.manual_seed(0)
    model, (inputs, targets) = Llama(config), batch(config, m)

    def step() -> None:
        for i in range(m):
            (model(inputs[i : i + 1], targets=targets[i : i + 1]) / m).backward()

    return timed(step, steps)


def timed(step, steps: int, barrier=lambda: None) -> float:
    step()  # warm-up
    times = []
    for _ in range(steps):
        barrier()
        start = time.perf_counter()
        step()
        barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pipeline_rank(
    rank: int, pp: int, port: int, config: LlamaConfig, schedule: str, m: int, steps: int, result
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=pp)
    try:
        torch.manual_seed(0)
        model, v = Llama(config), chunks_per_rank(schedule)
        chunks = split_into_stages(model, rank, pp, schedule, v)
        # The last stage gives the final hidden states; the model's head and loss take them from there.
        pipeline = build_schedule(chunks, pp * v, dist.group.WORLD, torch.device("cpu"), schedule, m, model.head_loss)
        inputs, targets = batch(config, m)
        args = (inputs,) if 0 in chunks else ()
        target = targets if pp * v - 1 in chunks else None
        seconds = timed(
            lambda: pipeline.step(*args, target=target, seq_len=config.max_seq_len, return_outputs=False),
            steps,
            dist.barrier,
        )
        if rank == 0:
            result.put(seconds)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo's threads now and then abort the interpreter's shutdown, which mp.spawn would report


def pipeline_seconds(config: LlamaConfig, pp: int, schedule: str, m: int, steps: int) -> float:
    port = free_port()
    result = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_pipeline_rank, args=(pp, port, config, schedule, m, steps, result), nprocs=pp)
    return result.get()


def chunks_per_rank(schedule: str) -> int:
    return (
        2
        if schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
        else default_virtual_stages(schedule)
    )


def ideal_efficiency(schedule: str, pp: int, m: int) -> float:
    """Megatron's bubble: (p - 1) / m of the ideal time, divided by v for interleaved schedules."""
    return m / (m + (pp - 1) / chunks_per_rank(schedule))


def write_plot(rows: list[dict], path: Path) -> None:
    """Efficiency against microbatches, measured (solid) and ideal (dashed), one colour per schedule: plain SVG."""
    width, height, pad = 640, 400, 60
    ms = sorted({r["microbatches"] for r in rows})
    x = lambda m: pad + (width - 2 * pad) * ms.index(m) / max(1, len(ms) - 1)  # noqa: E731
    y = lambda e: height - pad - (height - 2 * pad) * e  # noqa: E731
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle">Pipeline efficiency, p={rows[0]["pp"]} (solid: measured, '
        "dashed: ideal)</text>",
    ]
    for e in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(
            f'<line x1="{pad}" x2="{width - pad}" y1="{y(e)}" y2="{y(e)}" stroke="#ddd"/>'
            f'<text x="{pad - 8}" y="{y(e) + 4}" text-anchor="end">{e:.2f}</text>'
        )
    for m in ms:
        parts.append(f'<text x="{x(m)}" y="{height - pad + 18}" text-anchor="middle">{m}</text>')
    parts.append(f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">microbatches per step (m)</text>')
    for i, schedule in enumerate(dict.fromkeys(r["schedule"] for r in rows)):
        mine = [r for r in rows if r["schedule"] == schedule]
        for key, dash in (("efficiency", ""), ("ideal_efficiency", ' stroke-dasharray="5,4"')):
            points = " ".join(f"{x(r['microbatches']):.1f},{y(r[key]):.1f}" for r in mine)
            parts.append(
                f'<polyline points="{points}" fill="none" stroke="{colours[i % len(colours)]}" stroke-width="2"{dash}/>'
            )
        parts.append(
            f'<text x="{width - pad - 130}" y="{y(0.3) + 16 * i}" fill="{colours[i % len(colours)]}">{schedule}</text>'
        )
    path.write_text("\n".join(parts) + "\n</svg>\n")


def write_table(rows: list[dict], path: Path, command: str) -> None:
    lines = [
        f"# Pipeline bubble, p={rows[0]['pp']}, measured {rows[0]['date']} on {rows[0]['device']} (torch "
        f"{rows[0]['torch']})",
        "",
        f"`{command}`: {rows[0]['model']}. Step time of forward + backward over m microbatches of one sequence;",
        "efficiency = one-process time / (p x pipeline time); ideal m/(m+p-1), interleaved m/(m+(p-1)/v).",
        "",
        "| schedule | m | pipeline step (s) | one process (s) | efficiency | ideal | measured / ideal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['pipeline_seconds']:.3f} | {r['reference_seconds']:.3f} | "
            f"{r['efficiency']:.3f} | {r['ideal_efficiency']:.3f} | {r['efficiency'] / r['ideal_efficiency']:.2f} |"
        )
    path.write_text("\n".join(lines) + "\n")


@exit_on_config_error()
def main() -> None:
    args = parse(sys.argv[1:])
    torch.set_num_threads(1)  # the reference, like each pipeline rank, computes on one thread
    config, pp, steps = model_config(args), int(args["pp"]), int(args["steps"])
    if pp > (os.cpu_count() or 1):
        print(
            f"warning: {pp} ranks on {os.cpu_count()} cores share cores; the efficiency measured is not the "
            "schedule's.",
            file=sys.stderr,
        )
    rows, device = [], f"{platform.machine()} CPU, {os.cpu_count()} cores, 1 thread per rank"
    for m in [int(m) for m in args["microbatches"].split(",")]:
        reference = reference_seconds(config, m, steps)
        for schedule in args["schedules"].split(","):
            v = chunks_per_rank(schedule)
            try:
                check_pipeline(config, schedule, MeshShape(pp, 1, 1), v, m)
            except ConfigError as error:
                print(f"skip {schedule} m={m}: {error}", file=sys.stderr)
                continue
            seconds = pipeline_seconds(config, pp, schedule, m, steps)
            row = {
                "date": datetime.date.today().isoformat(),
                "device": device,
                "torch": torch.__version__,
                "model": f"dim {config.dim}, {config.n_layers} layers, seq {config.max_seq_len}",
                "pp": pp,
                "virtual_stages": v,
                "schedule": schedule,
                "microbatches": m,
                "pipeline_seconds": round(seconds, 4),
                "reference_seconds": round(reference, 4),
                "efficiency": round(reference / (pp * seconds), 4),
                "ideal_efficiency": round(ideal_efficiency(schedule, pp, m), 4),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    # New files for each run, named after its date and machine; a new name when today's is taken: results
    # already written (and committed) are never edited.
    out = ROOT / args["out"]  # an absolute out= stays as it is
    stem = free_stem(result_stem(out, f"-pipeline-bubble-pp{pp}"), [".jsonl", ".md", ".svg"])
    out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows.sort(key=lambda r: (r["schedule"], r["microbatches"]))
    write_table(rows, stem.with_suffix(".md"), "python -m benchmarks.pipeline " + " ".join(sys.argv[1:]))
    write_plot(rows, stem.with_suffix(".svg"))
    print(f"wrote {stem}.jsonl, .md and .svg")


if __name__ == "__main__":
    main()

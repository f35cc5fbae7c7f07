"""Initialization of a model built on the meta device, per rank: `python -m benchmarks.init
[model=llama3_2_1b] [layouts=fsdp2:1,fsdp2:2,fsdp2:4,tp:2] [out=experiments/benchmarks]`

For each layout, N gloo processes on this machine build the model on the meta device (its embedding and head
untied, as tensor parallelism needs them), shard it (FSDP2 over N ranks, or tensor parallelism over N) and fill
their shards twice, timed apart:
- before: the way project.parallel.init worked until 2026-11-25: every rank draws each whole parameter and keeps
  its slice, O(model) on every rank. It draws the same values as after, all of each parameter's tiles (until
  2026-11-27: one torch generator's stream per parameter, a generator the tiles no longer use), so that before and
  after differ in how much each rank draws and in nothing else;
- after: project.parallel.init.materialize: each rank draws only the tiles of its shard (project.model.
  initial_values), O(shard).
Times are the CPU seconds of each rank's process (one thread each), so that N ranks taking turns on fewer cores
do not count each other's time; the table gives the slowest rank's. Writes new files <date>-<host>-init.{json,md}.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchmarks.runner import (
    Benchmark,
    free_port,
    load_preset,
    main,
    out_folder,
    preset_path,
)
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError

DEFAULTS = {"model": "llama3_2_1b", "layouts": "fsdp2:1,fsdp2:2,fsdp2:4,tp:2", "out": "experiments/benchmarks"}
PLANS = ("fsdp2", "tp")


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS, doc=__doc__)
    if not preset_path(args["model"]).is_file():
        raise ConfigError(f"model={args['model']}: no such preset in conf/model.")
    layouts = []
    for item in filter(None, args["layouts"].split(",")):
        plan, _, ranks = item.partition(":")
        if plan not in PLANS or not ranks.isdigit() or int(ranks) < 1:
            raise ConfigError(f"layouts: {item!r} is not PLAN:RANKS with PLAN one of {list(PLANS)} (e.g. fsdp2:2).")
        layouts.append((plan, int(ranks)))
    return {"model": args["model"], "layouts": layouts, "out": out_folder(args["out"])}


def whole_then_slice(model, name: str, param) -> None:
    """The former materialization of one parameter: its whole value (all its tiles) drawn here, this rank's slice
    kept."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    value = model.initial_value(name)
    if isinstance(param, DTensor):
        local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(value)


def rank_main(rank: int, world: int, port: int, plan: str, model_name: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from project.model.llama import Llama
    from project.parallel.fsdp2 import apply_fsdp2
    from project.parallel.init import materialize
    from project.parallel.tensor_parallel import apply_tensor_parallel

    # Untied: tensor parallelism refuses a shared embedding and head (llama3_2_1b's); every layout alike.
    config = replace(load_preset(model_name, 4096), tie_embeddings=False)
    times = {}
    for method in ("before", "after"):
        with torch.device("meta"):
            model = Llama(config)
        mesh = init_device_mesh("cpu", (world,))
        if plan == "fsdp2":
            apply_fsdp2(model, mesh)
        else:
            apply_tensor_parallel(model, mesh)
        start = time.process_time()
        if method == "after":
            materialize(model, torch.device("cpu"))
        else:
            model.to_empty(device="cpu")
            with torch.no_grad():
                for name, param in model.named_parameters():
                    whole_then_slice(model, name, param)
        times[method] = time.process_time() - start
        del model
    results.put((rank, times))
    torch.distributed.destroy_process_group()


def measure(plan: str, world: int, model_name: str) -> dict:
    port = free_port()
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=rank_main, args=(r, world, port, plan, model_name, results)) for r in range(world)
    ]
    for process in processes:
        process.start()
    found: dict = {}
    while len(found) < world:
        try:
            rank, times = results.get(timeout=5)
            found[rank] = times
        except queue.Empty:
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a rank of {plan} x {world} failed (exit status {failed[0]}): its error is above")
    for process in processes:
        process.join()
    before = max(t["before"] for t in found.values())
    after = max(t["after"] for t in found.values())
    return {"plan": plan, "ranks": world, "before_s": round(before, 2), "after_s": round(after, 2)}


def table(report: dict) -> str:
    one = next((r for r in report["rows"] if r["ranks"] == 1), None)
    lines = [
        f"# Initialization per rank, {report['date']} on {report['host']}",
        "",
        f"`{report['command']}`: {report['model']} untied ({report['parameters'] / 1e9:.2f}B parameters) built on "
        "the meta device, sharded, then filled; CPU seconds of the slowest rank (one thread per rank). Before: every "
        "rank draws each whole parameter and keeps its slice. After: each rank draws its shard's tiles only.",
        "",
        "| layout | ranks | before (s) | after (s) | after / before | after / one rank's after |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        ratio = f"{r['after_s'] / one['after_s']:.2f}" if one else "-"
        lines.append(
            f"| {r['plan']} | {r['ranks']} | {r['before_s']} | {r['after_s']} | {r['after_s'] / r['before_s']:.2f} "
            f"| {ratio} |"
        )
    return "\n".join(lines) + "\n"


def rows(args: dict, scratch: Path) -> Iterator[dict]:
    for plan, world in args["layouts"]:
        yield measure(plan, world, args["model"])


def header(args: dict) -> dict:
    from project.model.flops import count_parameters

    untied = replace(load_preset(args["model"], 4096), tie_embeddings=False)
    return {"model": args["model"], "parameters": count_parameters(untied)}


BENCHMARK = Benchmark("benchmarks.init", "-init", parse, rows, table, header)


if __name__ == "__main__":
    main(BENCHMARK)

"""How fast are the links between the devices of one machine? An all-reduce timed on every device at once (NCCL on
GPUs, gloo on the CPU's stand-in processes), as NCCL's own tests report it: the bus bandwidth, the bytes each
device's links carry (2 (n - 1) / n times the buffer, the ring algorithm's) over the time, beside the link figure
the planner times collectives with (`intra_node_gbps` of the conf/cluster preset for this device) and the time it
predicts for the same call.

Run in processes of their own (`python -m tools.gpu_check.links SETTINGS_JSON`, rank 0 writing the result), so
that their process group lives and dies with them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml

from benchmarks.runner import ROOT, free_port
from project.planning.cluster import Cluster
from project.planning.communication import Collective

# conf/cluster presets by a word of the device's name (the planner's figures for it); none: the planner has none.
PRESETS = {"H200": "h200", "H100": "h100_80gb", "A100": "a100_80gb", "V100": "v100_32gb"}


def cluster_for(device_name: str, device_type: str) -> Cluster | None:
    """The planner's preset for this device (conf/cluster), or None where it has none."""
    name = "cpu" if device_type == "cpu" else next((p for word, p in PRESETS.items() if word in device_name), None)
    if name is None:
        return None
    return Cluster.from_config(yaml.safe_load((ROOT / "conf" / "cluster" / f"{name}.yaml").read_text()))


def bus_bandwidth(seconds: float, megabytes: float, devices: int) -> float:
    """GB/s each device's links carried during one all-reduce of `megabytes` on `devices` devices (NCCL's busbw)."""
    return 2 * (devices - 1) / devices * megabytes * 2**20 / seconds / 1e9


def planned_seconds(cluster: Cluster, megabytes: float, devices: int) -> float:
    """The planner's time for the same all-reduce inside one node."""
    call = Collective("all_reduce", "data", devices, devices, 1, megabytes * 2**20, "data_parallel")
    return call.seconds(cluster.bandwidth(devices), cluster.collective_latency_us * 1e-6)


def measure(devices: int, device_type: str, megabytes: float, iterations: int, env: dict, timeout: float) -> dict:
    """Time the all-reduce on `devices` processes; the median over `iterations` after two warm-up calls."""
    import subprocess
    import tempfile

    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="gpu-check-links-"))
    out = work / "result.json"
    setting = {"device": device_type, "megabytes": megabytes, "iterations": iterations, "out": str(out)}
    children, logs = [], []
    for r in range(devices):
        logs.append(open(work / f"rank{r}.log", "w"))  # files, not pipes: a chatty NCCL never blocks a rank
        rank_env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": str(devices)}
        children.append(
            subprocess.Popen(
                [sys.executable, "-m", "tools.gpu_check.links", json.dumps(setting)],
                cwd=ROOT,
                env={**env, **rank_env},
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + timeout
    try:
        for process in children:  # one deadline for all of them
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        for process in children:
            process.kill()
        return {"ok": False, "skipped": True, "error": "out of time (minutes=)"}
    finally:
        for log in logs:
            log.close()
    if any(process.returncode for process in children) or not out.is_file():
        said = [(work / f"rank{r}.log").read_text() for r in range(devices)]
        return {"ok": False, "error": next((text for text in said if text.strip()), "no result")[-2000:]}
    return {"ok": True, **json.loads(out.read_text())}


def row(facts: dict, megabytes: float, outcome: dict) -> dict:
    """The report's row: measured bus bandwidth and time, beside the planner's link figure and time."""
    devices = facts["devices"]
    cluster = cluster_for(facts["device_name"], facts["device_type"])
    status = "measured" if outcome["ok"] else "skipped" if outcome.get("skipped") else "failed"
    found = {"devices": devices, "megabytes": megabytes, "status": status, "error": outcome.get("error")}
    if outcome["ok"]:
        found["seconds"] = outcome["seconds"]
        found["bus_gbps"] = round(bus_bandwidth(outcome["seconds"], megabytes, devices), 2)
    if cluster is not None:
        found["preset"] = cluster.name
        found["planner_gbps"] = cluster.intra_node_gbps
        found["planner_seconds"] = planned_seconds(cluster, megabytes, devices)
    return found


def child(setting: dict) -> None:
    """One rank: join the group, all-reduce the buffer, time it; rank 0 writes the median."""
    import torch
    import torch.distributed as dist

    rank, devices = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = setting["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=devices)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32  # gloo's sums take float32
    buffer = torch.ones(int(setting["megabytes"] * 2**20) // dtype.itemsize, dtype=dtype, device=device)
    times = []
    for i in range(setting["iterations"] + 2):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:  # the first two set up the communicator's connections
            times.append(time.perf_counter() - start)
    if rank == 0:
        Path(setting["out"]).write_text(json.dumps({"seconds": sorted(times)[len(times) // 2]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))

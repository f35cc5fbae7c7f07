"""What the check runs on: versions, the devices, their memory and peak FLOP/s."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import yaml

from benchmarks.runner import ROOT
from benchmarks.train_step import matmul_peak


def nvidia_smi() -> dict:
    """The driver's version and each GPU's name and memory as nvidia-smi reports them; {} without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return {}
    query = ["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    except (subprocess.SubprocessError, OSError):
        return {}
    rows = [[field.strip() for field in line.split(",")] for line in lines if line.strip()]
    return {"driver": rows[0][0], "gpus": [{"name": r[1], "memory": r[2]} for r in rows]} if rows else {}


# GPU names (lower case, as torch gives them) to the conf/cluster preset holding their datasheet peaks.
CLUSTER_PRESETS = (("h200", "h200"), ("h100", "h100_80gb"), ("a100", "a100_80gb"), ("v100", "v100_32gb"))


def cluster_preset(gpu_name: str) -> Path | None:
    name = gpu_name.lower()
    return next((ROOT / "conf" / "cluster" / f"{p}.yaml" for key, p in CLUSTER_PRESETS if key in name), None)


def nccl_version() -> str | None:
    """NCCL's version as torch was built with it: a tuple in recent torch, one integer (2.18.3 as 21803) in older."""
    import torch

    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return None
    version = torch.cuda.nccl.version()
    if isinstance(version, int):
        version = (version // 10000, version // 100 % 100, version % 100)
    return ".".join(map(str, version))


def describe(device_type: str, devices: int, threads: int) -> dict:
    """The environment of a check on `devices` devices of `device_type` (cuda or cpu), `threads` per process.

    Peaks are Lightning's table for a GPU (`get_available_flops`, dense, per device); a CPU has no entry
    there, so its fp32 matrix-product rate is measured here, at the thread count of each process of a run."""
    import lightning
    import torch
    from lightning.fabric.utilities.throughput import get_available_flops

    facts: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "device_type": device_type,
        "devices": devices,
    }
    if device_type == "cuda":
        device = torch.device("cuda", 0)
        properties = [torch.cuda.get_device_properties(i) for i in range(devices)]
        facts |= {
            "cuda": torch.version.cuda,
            "driver": nvidia_smi().get("driver"),
            "nccl": nccl_version(),
            "gpus": [
                {
                    "name": p.name,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "multiprocessors": p.multi_processor_count,
                }
                for p in properties
            ],
            "device_name": properties[0].name,
            "memory_bytes": properties[0].total_memory,
            "peak_flops": {
                "bf16": get_available_flops(device, torch.bfloat16),
                "fp32": get_available_flops(device, torch.float32),
            },
            "peak_source": "Lightning's table of dense peaks (lightning.fabric.utilities.throughput)",
        }
        preset = cluster_preset(properties[0].name)
        if preset is not None:  # float8's peak and the memory bandwidth (the planner's float8 prediction)
            figures = yaml.safe_load(preset.read_text())
            if figures["peak_tflops"].get("fp8"):
                facts["peak_flops"]["fp8"] = figures["peak_tflops"]["fp8"] * 1e12
            facts["memory_gbps"] = figures.get("memory_gbps")
        if not facts["peak_flops"]["bf16"] and preset is not None:
            # Lightning's table misses some names ("NVIDIA H200", say): the cluster preset's datasheet figures.
            peaks = yaml.safe_load(preset.read_text())["peak_tflops"]
            facts["peak_flops"] |= {dtype: peaks[dtype] * 1e12 for dtype in ("bf16", "fp32")}
            facts["peak_source"] = f"dense datasheet peaks of conf/cluster/{preset.name} (Lightning has none for it)"
    else:
        torch.set_num_threads(threads)
        measured = matmul_peak()["flops_per_sec"]
        facts |= {
            "device_name": f"{platform.processor() or platform.machine()} CPU, {threads} thread(s)",
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            # bf16 matrix products run about 100x slower than fp32 on most CPUs: the CPU check trains in fp32.
            "peak_flops": {"fp32": measured, "bf16": None},
            "peak_source": f"fp32 2048^3 matrix product measured here, {threads} thread(s)",
        }
    return facts


def lines(facts: dict) -> list[str]:
    """The environment as the report's first lines."""
    peaks = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" if v else f"{k} unknown" for k, v in facts["peak_flops"].items())
    out = [
        f"- host {facts['host']}, {facts['cpu_count']} CPUs, Python {facts['python']}, torch {facts['torch']}, "
        f"Lightning {facts['lightning']}",
        f"- device: {facts['devices']} x {facts['device_name']}, {facts['memory_bytes'] / 2**30:.1f} GiB each",
        f"- peak per device: {peaks} ({facts['peak_source']})",
    ]
    if facts["device_type"] == "cuda":
        out.insert(1, f"- CUDA {facts['cuda']}, driver {facts['driver'] or 'unknown'}, NCCL {facts['nccl'] or 'none'}")
    return out

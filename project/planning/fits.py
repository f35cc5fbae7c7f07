"""Whether a run fits the memory it will have, before it starts: the planner's estimate of the rank that needs the
most (project.planning.memory) against a device's memory, or on a CPU the host's, which the processes started on
it share. A run that cannot fit is refused with what it needs, what is there and the planner's best layout that
fits on the same devices; `memory_check=false` starts it anyway.

project.train asks before the imports on a CPU (check_host_memory), and on GPUs once torch is imported
(check_gpu_memory); the arithmetic is torch-free.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from project.config.command_line import CONF
from project.config.layout import Layout
from project.config.values import model_config
from project.model.flops import count_parameters
from project.planning.cluster import GIB, Cluster
from project.planning.memory import Allowance, MemoryEstimate
from project.runtime.console import launch_rank
from project.runtime.errors import ConfigError

# A training process on a CPU holds Python, torch and Lightning besides its tensors (about 0.5 GiB resident, measured
# with `ps` on make train's run); a GPU process holds the CUDA context and NCCL's buffers (the planner's default).
CPU_ALLOWANCE = Allowance(reserve_gib=0.5)


def host_memory_available() -> float | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(cfg: DictConfig, layout: Layout) -> None:
    """On a CPU, the processes this machine starts must fit its available memory together. Only where the run
    starts: a rank started later would see the memory the first ones already took."""
    devices_per_node = layout.shape.world_size // max(1, int(cfg.trainer.get("num_nodes", 1) or 1))
    if str(cfg.trainer.get("accelerator", "auto")) != "cpu" or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    if launch_rank(cfg.trainer.get("num_nodes", 1)) % max(1, devices_per_node):
        return
    available = host_memory_available()
    if available is not None:
        check_fits(cfg, layout, available, devices_per_node, "cpu", "this machine's available memory (MemAvailable)")


def trains_on_gpus(cfg: DictConfig) -> bool:
    """The run will take CUDA GPUs (asked for, or found by `auto`); imports torch."""
    import torch

    return str(cfg.trainer.get("accelerator", "auto")) in ("gpu", "cuda", "auto") and torch.cuda.is_available()


def check_gpu_memory(cfg: DictConfig, layout: Layout) -> None:
    """On GPUs, each process must fit one: the first visible GPU's memory, as torch reads it (a node's GPUs are
    taken to be alike)."""
    import torch

    memory = torch.cuda.get_device_properties(0).total_memory
    check_fits(cfg, layout, memory, 1, "gpu", f"one {torch.cuda.get_device_name(0)}'s memory")


def planned_need(cfg: DictConfig, layout: Layout, strategy_name: str, accelerator: str) -> MemoryEstimate | None:
    """The planner's estimate for the pipeline rank that needs the most, None for a strategy it does not model."""
    from project.planning.dry_run import planned_memory

    allowance = CPU_ALLOWANCE if accelerator == "cpu" else Allowance()
    ranks = range(layout.shape.pipeline_parallel)
    estimates = [planned_memory(cfg, layout, strategy_name, rank, allowance) for rank in ranks]
    known = [e for e in estimates if e is not None]
    return max(known, key=lambda e: e.total) if known else None


def check_fits(
    cfg: DictConfig,
    layout: Layout,
    capacity_bytes: float,
    processes_sharing: int,
    accelerator: str,
    where: str,
) -> None:
    """Refuse a run whose planned memory exceeds `capacity_bytes`, which `processes_sharing` processes share (the
    host's, on a CPU; 1 for a GPU's own). `where` says what the capacity is ("this machine's available memory")."""
    if not cfg.get("memory_check", True):
        return
    strategy_name = HydraConfig.get().runtime.choices.get("strategy", "") if HydraConfig.initialized() else ""
    need = planned_need(cfg, layout, strategy_name or "single", accelerator)
    if need is None or need.total * processes_sharing <= capacity_bytes:
        return
    per_process = capacity_bytes / processes_sharing
    parts = {"model states": need.states, "activations": need.activations, "working copies": need.working}
    shown = ", ".join(f"{name} {value / GIB:.1f}" for name, value in parts.items() if value)
    model = HydraConfig.get().runtime.choices.get("model", "") if HydraConfig.initialized() else ""
    named = f"model={model}" if model else "the model"
    shares = f" x {processes(processes_sharing)} on this machine" if processes_sharing > 1 else ""
    raise ConfigError(
        f"{named} ({count_parameters(model_config(cfg)) / 1e9:.2f}B parameters) does not fit: as laid out "
        f"(strategy={strategy_name or 'single'} over {processes(layout.shape.world_size)}, micro batch "
        f"{layout.plan.micro_batch_size}, trainer.precision={cfg.trainer.get('precision', '32-true')}) the planner "
        f"puts a process at {need.total / GIB:.1f} GiB ({shown}, allowance {need.overhead / GIB:.1f}){shares}, and "
        f"{where} is {capacity_bytes / GIB:.1f} GiB. {best_fitting_layout(cfg, layout, per_process, accelerator)} "
        "To start anyway (the planner's figures are estimates: docs/planning.md), set memory_check=false."
    )


def processes(count: int) -> str:
    return f"{count} process{'es' if count != 1 else ''}"


def best_fitting_layout(cfg: DictConfig, layout: Layout, per_device_bytes: float, accelerator: str) -> str:
    """The planner's fastest layout of the same devices that fits `per_device_bytes`, as a sentence."""
    from project.planning.candidates import SearchSpace
    from project.planning.planner import Workload, plan
    from project.planning.render import model_arguments, train_overrides

    devices = layout.shape.world_size
    nodes = int(cfg.trainer.get("num_nodes", 1) or 1)
    # The links and peaks of a preset of the same kind: they rank the layouts that fit, the memory decides which do.
    preset_name = "cpu" if accelerator == "cpu" else "h100_80gb"
    preset = OmegaConf.to_container(OmegaConf.load(CONF / "cluster" / f"{preset_name}.yaml"))
    cluster = replace(
        Cluster.from_config(preset),  # type: ignore[arg-type]
        name="here",
        nodes=nodes,
        gpus_per_node=max(1, devices // nodes),
        memory_gib=per_device_bytes / GIB,
    )
    precision = str(cfg.trainer.get("precision", "32-true"))
    workload = Workload(model_config(cfg), int(cfg.data.seq_len), int(cfg.global_batch_size), 1.0, precision)
    try:
        outcomes = plan(workload, cluster, SearchSpace(), 0.5, CPU_ALLOWANCE if accelerator == "cpu" else Allowance())
    except ConfigError:
        outcomes = []
    fitting = [o for o in outcomes if o.prediction.fits]
    if not fitting:
        smallest = min((o.prediction.memory.total for o in outcomes), default=None)
        least = f" (the smallest needs {smallest / GIB:.1f} GiB per device)" if smallest else ""
        return (
            f"No layout of the {devices} device(s) here fits it{least}: `python -m project.plan` sizes the cluster it "
            "needs (docs/planning.md), or choose a smaller model."
        )
    choice = HydraConfig.get().runtime.choices.get("model") if HydraConfig.initialized() else None
    model = model_arguments(choice, OmegaConf.to_container(cfg.model, resolve=True))  # type: ignore[arg-type]
    overrides = changed(train_overrides(fitting[0].prediction.candidate, workload, cluster, model), cfg)
    return (
        f"The planner's best layout of the {devices} device(s) here that fits "
        f"({fitting[0].prediction.memory.total / GIB:.1f} GiB per device): the same command with "
        f"{' '.join(overrides)}."
    )


def changed(overrides: list[str], cfg: DictConfig) -> list[str]:
    """The overrides that change something in `cfg`: a group the run did not choose, or a value it does not have.
    A strategy's own settings follow a change of strategy as they are."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    new_strategy = False
    kept = []
    for override in overrides:
        key, value = override.split("=", 1)
        if key in choices:  # a config group: trainer=cpu, strategy=fsdp2
            current = choices.get(key)
            new_strategy |= key == "strategy" and current != value
        else:
            current = OmegaConf.select(cfg, key)
            current = str(current).lower() if isinstance(current, bool) else str(current)
        if current != value or key.startswith("strategy.") and new_strategy:
            kept.append(override)
    return kept

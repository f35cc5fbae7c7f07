"""The run's layout (mesh degrees and batch plan) planned from its settings before any process starts, refusing
what cannot be built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from project.config.values import model_config
from project.model.config import LlamaConfig
from project.model.families import family_of
from project.parallel.batch import BatchPlan, plan_batches, plan_pipeline_batches
from project.parallel.kinds import mesh_settings, strategy_kind
from project.parallel.mesh import (
    MeshShape,
    check_context_parallel_degree,
    check_context_parallel_kv,
    check_tensor_parallel_degree,
    mesh_shape,
)
from project.parallel.pipeline_layout import check_pipeline, default_virtual_stages
from project.runtime.errors import ConfigError


@dataclass(frozen=True)
class Layout:
    """How a run spreads over its devices: the mesh degrees and the batch plan."""

    shape: MeshShape
    plan: BatchPlan

    def name(self, model: str, strategy: str) -> str:
        """`small10m_dp2-tp2-pp1_mb4_fsdp2`: the model preset, the degrees (`-cp2` where sequences are split, `-ep2`
        where experts are, `-shard2` where HSDP shards within groups), the micro batch and the strategy."""
        shape = self.shape
        degrees = f"dp{shape.data_parallel}-tp{shape.tensor_parallel}-pp{shape.pipeline_parallel}"
        for short, degree in (("cp", shape.context_parallel), ("ep", shape.expert_parallel)):
            degrees += f"-{short}{degree}" if degree > 1 else ""
        degrees += f"-shard{shape.shard_ranks}" if shape.hybrid else ""
        return f"{model}_{degrees}_mb{self.plan.micro_batch_size}_{strategy}"

    def facts(self) -> dict[str, int]:
        """The layout as numbers, logged beside the metrics so that runs can be compared by them."""
        shape = self.shape
        return {
            "layout/world_size": shape.world_size,
            "layout/data_parallel": shape.data_parallel,
            "layout/context_parallel": shape.context_parallel,
            "layout/tensor_parallel": shape.tensor_parallel,
            "layout/pipeline_parallel": shape.pipeline_parallel,
            "layout/expert_parallel": shape.expert_parallel,
            "layout/data_parallel_shard": shape.shard_ranks,  # the ranks FSDP2 shards a weight over (HSDP: fewer)
            "layout/micro_batch_size": self.plan.micro_batch_size,
            "layout/accumulation": self.plan.accumulate_grad_batches,
            "layout/pipeline_microbatches": self.plan.pipeline_microbatches,
            "layout/global_batch_size": self.plan.global_batch_size,
        }


def horovod_devices(cfg: DictConfig, dry_run: bool) -> int:
    """The processes horovodrun started: Horovod's launcher, not the trainer settings, says how many."""
    if dry_run:
        raise ConfigError(
            "dry_run=true does not model strategy=horovod: dry-run strategy=ddp with trainer.devices and "
            "trainer.num_nodes of your job instead (the same replicas, memory and batch plan)."
        )
    if cfg.trainer.get("devices", 1) != 1 or cfg.trainer.get("num_nodes", 1) != 1:
        raise ConfigError(
            f"strategy=horovod runs one process per device and horovodrun starts them (-np N -H host:slots,...): "
            f"leave trainer.devices=1 and trainer.num_nodes=1 (they are {cfg.trainer.get('devices')} and "
            f"{cfg.trainer.get('num_nodes', 1)})."
        )
    if str(cfg.trainer.get("precision")) == "bf16-true":  # Lightning reads "bf16" as bf16-mixed
        raise ConfigError(
            f"strategy=horovod with trainer.precision={cfg.trainer.precision}: Horovod 0.28's PyTorch operations have "
            "no bfloat16, and weights and gradients would be bfloat16. Use trainer.precision=bf16-mixed (bfloat16 "
            "compute, float32 weights and gradients) or 32-true."
        )
    from project.parallel.strategies.horovod import horovod_world  # imports torch and Horovod: only for Horovod runs

    processes = horovod_world(OmegaConf.to_container(cfg.strategy, resolve=True))
    overrides = HydraConfig.get().overrides.hydra if HydraConfig.initialized() else []
    if processes > 1 and not any(o.lstrip("+").startswith("hydra.run.dir=") for o in overrides):
        raise ConfigError(
            f"strategy=horovod with {processes} processes needs one run directory for all of them: add "
            "hydra.run.dir=outputs/runs/NAME (on a file system every node shares); each would otherwise name its own "
            "from its clock."
        )
    return processes


def strategy_name(cfg: DictConfig) -> str:
    """The strategy as the user chose it (`ddp`, the conf group's option), else its class."""
    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get("strategy"))
    return str(cfg.strategy.get("_target_", "?")).rsplit(".", 1)[-1]


def check_family_layout(model: LlamaConfig, shape: MeshShape, pipeline: bool) -> None:
    """Refuse the dimensions the model's family cannot be split over (project.model.families)."""
    family = family_of(model)
    used = {
        "tensor": f"strategy.tensor_parallel_size={shape.tensor_parallel}" if shape.tensor_parallel > 1 else "",
        "context": f"strategy.context_parallel_size={shape.context_parallel}" if shape.context_parallel > 1 else "",
        "pipeline": "a pipeline of stages (strategy=pipeline)" if pipeline else "",
    }
    refused = [used[name] for name in family.refuses if used[name]]
    if refused:
        raise ConfigError(
            f"{' and '.join(refused)}: model.family={family.name} ({family.summary}) cannot be split that way yet. "
            "Train it without that dimension (docs/strategies.md lists the strategies)."
        )


def check_expert_parallel(model: LlamaConfig, ep: Any) -> None:
    """Refuse an expert-parallel degree the model cannot be split by (the mesh refuses what is no degree or does not
    divide the ranks: mesh_shape)."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep <= 1:
        return
    experts = {mixture.experts for i in range(model.n_layers) if (mixture := model.mixture(i)) is not None}
    if not experts:
        raise ConfigError(
            f"strategy.expert_parallel_size={ep} splits a mixture's experts, and model.family={model.family} has "
            "none: choose a mixture of experts (model=moe_debug, mixtral_8x7b, or model.family=moe) or set "
            "strategy.expert_parallel_size=1."
        )
    if uneven := sorted(n for n in experts if n % ep):
        raise ConfigError(
            f"model.n_experts={uneven[0]} is not divisible by strategy.expert_parallel_size={ep}: each rank "
            f"of an expert group holds an equal number of whole experts. Choose a divisor of {uneven[0]}."
        )


def plan_layout(cfg: DictConfig, num_nodes: int, devices_per_node: int) -> Layout:
    """Degrees and batch plan of the run on `num_nodes x devices_per_node` devices, refusing what
    cannot be built: degrees that do not divide the devices or the model, batches that do not split,
    pipelines that cannot be scheduled."""
    strategy_cfg = mesh_settings(OmegaConf.to_container(cfg.strategy, resolve=True))
    model = model_config(cfg)
    check_expert_parallel(model, strategy_cfg.get("expert_parallel_size", 1))  # a model without experts first
    shape = mesh_shape(strategy_cfg, num_nodes * devices_per_node, devices_per_node)
    kind = strategy_kind(strategy_cfg)
    check_family_layout(model, shape, kind.pipeline)
    check_context_parallel_degree(shape.context_parallel, cfg.data.seq_len, strategy_name(cfg), kind.context_parallel)
    # On GPUs, FlexAttention's block masks: of documents, and of a family's attention in chunks (Llama 4).
    set_to = {n: OmegaConf.select(cfg, n) for n in ("document_mask", "model.attention_chunk_size")}
    masks = [f"{n}={str(v).lower() if isinstance(v, bool) else v}" for n, v in set_to.items() if v]
    on_gpus = cfg.trainer.get("accelerator") in ("gpu", "cuda")
    check_context_parallel_kv(
        cfg.strategy.get("context_parallel_kv", "gather"),
        bool(cfg.strategy.get("regather_kv")),
        masks if on_gpus else [],
    )
    if shape.tensor_parallel > 1:
        sequence_parallel = strategy_cfg.get("sequence_parallel", False)
        split = cfg.data.seq_len // shape.context_parallel if sequence_parallel else None  # each rank's part
        check_tensor_parallel_degree(model, shape.tensor_parallel, split)
    if not kind.pipeline:
        return Layout(shape, plan_batches(cfg.global_batch_size, shape.data_parallel, cfg.micro_batch_size))
    plan = plan_pipeline_batches(
        cfg.global_batch_size, shape.data_parallel, cfg.micro_batch_size, strategy_cfg.get("n_microbatches")
    )
    schedule = strategy_cfg.get("schedule", "1f1b")
    check_pipeline(
        model,
        schedule,
        shape,
        strategy_cfg.get("virtual_stages") or default_virtual_stages(schedule),
        plan.pipeline_microbatches,
        strategy_cfg.get("stage_layers"),
        strategy_cfg.get("compile", False),
        strategy_cfg.get("param_dtype"),
    )
    return Layout(shape, plan)

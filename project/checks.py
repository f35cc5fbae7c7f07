"""Checks of a training run's settings that need no process group, no model and no Lightning.

`project.train` runs `preflight` before it imports torch or Lightning, so a typo is answered in about
a second instead of after the imports; the same functions run again once the Trainer has resolved
what the config left open (`trainer.devices: auto`, data prepared on the way). Nothing here imports
torch: keep it so (tests/test_checks.py watches it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from project.errors import ConfigError
from project.model.config import LlamaConfig
from project.parallel.batch import BatchPlan, plan_batches, plan_pipeline_batches
from project.parallel.mesh import MeshShape, check_tensor_parallel_degree, mesh_shape
from project.parallel.pipeline_layout import check_pipeline, default_virtual_stages

# Derived from the batch plan and the step-based schedule; a value set by hand would silently disagree.
COMPUTED_TRAINER_KEYS = {
    "accumulate_grad_batches": "set global_batch_size and micro_batch_size instead",
    "val_check_interval": "set val_every_n_steps instead",
    "check_val_every_n_epoch": "set val_every_n_steps instead",
    "gradient_clip_val": "set optim.grad_clip instead (the module clips and logs the norm)",
    "use_distributed_sampler": "the data module splits the data by data-parallel replica itself",
}


@dataclass(frozen=True)
class Layout:
    """How a run spreads over its devices: the mesh degrees and the batch plan."""

    shape: MeshShape
    plan: BatchPlan

    def name(self, model: str, strategy: str) -> str:
        """`small10m_dp2-tp2-pp1_mb4_fsdp2`: the model preset, the degrees, the micro batch and the strategy."""
        pp, dp, tp = self.shape
        return f"{model}_dp{dp}-tp{tp}-pp{pp}_mb{self.plan.micro_batch_size}_{strategy}"

    def facts(self) -> dict[str, int]:
        """The layout as numbers, logged beside the metrics so that runs can be compared by them."""
        pp, dp, tp = self.shape
        return {
            "layout/world_size": pp * dp * tp,
            "layout/data_parallel": dp,
            "layout/tensor_parallel": tp,
            "layout/pipeline_parallel": pp,
            "layout/micro_batch_size": self.plan.micro_batch_size,
            "layout/accumulation": self.plan.accumulate_grad_batches,
            "layout/pipeline_microbatches": self.plan.pipeline_microbatches,
            "layout/global_batch_size": self.plan.global_batch_size,
        }


def is_pipeline(strategy_cfg: Mapping[str, Any]) -> bool:
    return str(strategy_cfg.get("_target_", "")).endswith("LlamaPipelineStrategy")


def check_trainer(cfg: DictConfig) -> None:
    if cfg.trainer.get("max_steps", -1) in (None, -1):
        raise ConfigError("trainer.max_steps must be set: training length is counted in optimizer steps.")
    for key, fix in COMPUTED_TRAINER_KEYS.items():
        if key in cfg.trainer:
            raise ConfigError(f"trainer.{key} is computed by project.train: {fix}.")
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda"):
        import torch  # only here: a CPU run's settings check should not wait for it

        if not torch.cuda.is_available():
            reason = (
                f"this torch ({torch.__version__}) is a CPU build: on a GPU machine install a CUDA build, e.g. "
                '`make install TORCH="torch==2.11.0"`'
                if torch.version.cuda is None
                else f"this torch (CUDA {torch.version.cuda}) sees no GPU: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
            )
            raise ConfigError(
                f"trainer.accelerator={accelerator} (trainer=gpu) needs a CUDA GPU, but {reason}; or train on the CPU with trainer=cpu."
            )


def plan_layout(cfg: DictConfig, num_nodes: int, devices_per_node: int) -> Layout:
    """Degrees and batch plan of the run on `num_nodes x devices_per_node` devices, refusing what
    cannot be built: degrees that do not divide the devices or the model, batches that do not split,
    pipelines that cannot be scheduled."""
    strategy_cfg = OmegaConf.to_container(cfg.strategy, resolve=True)
    model = LlamaConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    shape = mesh_shape(strategy_cfg, num_nodes * devices_per_node, devices_per_node)
    if shape.tensor_parallel > 1:
        sequence_parallel = strategy_cfg.get("sequence_parallel", False)
        check_tensor_parallel_degree(model, shape.tensor_parallel, cfg.data.seq_len if sequence_parallel else None)
    if not is_pipeline(strategy_cfg):
        return Layout(shape, plan_batches(cfg.global_batch_size, shape.data_parallel, cfg.micro_batch_size))
    plan = plan_pipeline_batches(cfg.global_batch_size, shape.data_parallel, cfg.micro_batch_size, strategy_cfg.get("n_microbatches"))
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


def check_data(cfg: DictConfig) -> None:
    """The model against the prepared shards, when they exist (they may yet be prepared by the run)."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}.")
    manifest = Path(cfg.data.dir) / "manifest.json"
    if not manifest.is_file():
        return
    tokenizer_vocab = int(json.loads(manifest.read_text())["tokenizer"]["vocab_size"])
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} "
            f"(shards in {cfg.data.dir}): set model.vocab_size={tokenizer_vocab} or more."
        )


def preflight(cfg: DictConfig) -> Layout | None:
    """Every check that the config alone allows; the layout too when the device count is explicit."""
    check_trainer(cfg)
    check_data(cfg)
    nodes, devices = cfg.trainer.get("num_nodes", 1), cfg.trainer.get("devices", "auto")
    if isinstance(nodes, int) and isinstance(devices, int):
        return plan_layout(cfg, nodes, devices)
    return None

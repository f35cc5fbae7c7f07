"""trainer.* settings: what project.train computes itself, and what lightning.Trainer accepts."""

from __future__ import annotations

import difflib
import inspect

from omegaconf import DictConfig

from project.runtime.errors import ConfigError

# Derived from the batch plan and the step-based schedule; a value set by hand would silently disagree.
COMPUTED_TRAINER_KEYS = {
    "accumulate_grad_batches": "set global_batch_size and micro_batch_size instead",
    "val_check_interval": "set val_every_n_steps instead",
    "check_val_every_n_epoch": "set val_every_n_steps instead",
    "gradient_clip_val": "set optim.grad_clip instead (the module clips and logs the norm)",
    "use_distributed_sampler": "the data module splits the data by data-parallel replica itself",
}


# trainer.precision values Lightning's Trainer takes (its plugins' names and their short forms), and what each is for.
PRECISIONS = {
    "32-true": "float32, the CPU's",
    "bf16-mixed": "float32 weights, bfloat16 compute: GPUs",
    "bf16-true": "bfloat16 weights and optimizer state",
    "16-mixed": "float16 compute with loss scaling: GPUs without bfloat16",
    "16-true": "float16 weights",
    "64-true": "float64",
}
PRECISION_ALIASES = {"32", "16", "64", "bf16", 32, 16, 64}


def check_precision(precision: object) -> None:
    """Lightning answers a precision it does not know after its imports, with its raw list: say ours first."""
    if precision in PRECISIONS or precision in PRECISION_ALIASES or precision is None:
        return
    choices = "; ".join(f"{name} ({use})" for name, use in PRECISIONS.items())
    float8 = (
        " float8 is not a trainer precision: train in bf16-mixed with the blocks' linear layers in float8, "
        "strategy.float8=tensorwise (or rowwise)."
        if "8" in str(precision)
        else ""
    )
    raise ConfigError(
        f"trainer.precision={precision} is not a precision a run trains in. Choose one of: {choices}.{float8}"
    )


def check_trainer(cfg: DictConfig, here: bool = True) -> None:
    """`here`: the run is to start on this machine (not a dry run of a job for another), so a GPU it asks for must be
    here."""
    if cfg.trainer.get("max_steps", -1) in (None, -1):
        raise ConfigError("trainer.max_steps must be set: training length is counted in optimizer steps.")
    for key, fix in COMPUTED_TRAINER_KEYS.items():
        if key in cfg.trainer:
            raise ConfigError(f"trainer.{key} is computed by project.train: {fix}.")
    check_precision(cfg.trainer.get("precision"))
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and here:
        import torch  # only here: a CPU run's settings check should not wait for it

        if not torch.cuda.is_available():
            reason = (
                f"this torch ({torch.__version__}) is a CPU build: on a GPU machine install a CUDA build, e.g. "
                '`make install TORCH="torch==2.13.0"`'
                if torch.version.cuda is None
                else f"this torch (CUDA {torch.version.cuda}) sees no GPU: check the driver (nvidia-smi) and "
                "CUDA_VISIBLE_DEVICES"
            )
            raise ConfigError(
                f"trainer.accelerator={accelerator} (trainer=gpu) needs a CUDA GPU, but {reason}; or train on the CPU "
                "with trainer=cpu."
            )


def check_trainer_arguments(cfg: DictConfig) -> None:
    """Every trainer.* setting is an argument of lightning.Trainer (a key added with +trainer.KEY=... may not be).
    Imports Lightning: a real start checks this once it has, a dry run with its other checks."""
    import lightning

    accepted = set(inspect.signature(lightning.Trainer.__init__).parameters) - {"self"}
    for key in sorted(cfg.trainer.keys() - accepted - {"_target_"}):
        match = difflib.get_close_matches(str(key), sorted(accepted), n=1)
        hint = f" Did you mean trainer.{match[0]}?" if match else ""
        raise ConfigError(f"trainer.{key} is not an argument of lightning.Trainer.{hint}")

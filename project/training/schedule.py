"""The learning-rate schedule (linear warm-up, then a cosine to min_lr) and what a resume that changes it says."""

from __future__ import annotations

import math
from typing import Mapping

from project.config.optim import OptimConfig

# What shapes the schedule, as checkpoints record it (`schedule`): the settings named as a user sets them, and its
# length, optim.decay_steps, which is trainer.max_steps where the setting is null.
SCHEDULE_SETTINGS = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.decay_steps")


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) in a run of `total_steps`.

    Linear warmup: steps 0 .. warmup-1 use lr * (step + 1) / warmup, reaching lr at the last one;
    then a cosine from there down to min_lr, which the final step (total_steps - 1) uses.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step + 1 - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def schedule_record(cfg: OptimConfig, max_steps: int) -> dict[str, float]:
    """The schedule as a checkpoint keeps it."""
    values = (cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.decay_steps or max_steps)
    return dict(zip(SCHEDULE_SETTINGS, values))


def schedule_change(saved: Mapping[str, float], now: Mapping[str, float], step: int) -> str | None:
    """What a resume at optimizer step `step` changes in the schedule, with that step's learning rate on the
    checkpoint's schedule and on this run's, as one warning; None where nothing changes."""
    changed = [key for key in SCHEDULE_SETTINGS if key in saved and saved[key] != now[key]]
    if not changed:
        return None

    def rate(schedule: Mapping[str, float]) -> float:
        merged = {**now, **schedule}
        cfg = OptimConfig(
            lr=merged["optim.lr"], min_lr=merged["optim.min_lr"], warmup_steps=int(merged["optim.warmup_steps"])
        )
        return lr_at(step, cfg, int(merged["optim.decay_steps"]))

    said = "; ".join(f"{key}: {saved[key]:g} there, {now[key]:g} here" for key in changed)
    length = " (the schedule's length: trainer.max_steps where it is null)" if "optim.decay_steps" in changed else ""
    settings = " ".join(f"{key}={saved[key]:g}" for key in changed)
    return (
        f"resuming on another learning-rate schedule than the checkpoint's: {said}{length}. Step {step}'s learning "
        f"rate is {rate(saved):.6f} on the checkpoint's schedule and {rate(now):.6f} on this one. To continue the "
        f"checkpoint's schedule, set {settings}; to stop a run early and resume it on one schedule, give both runs "
        "the schedule's full length as optim.decay_steps."
    )

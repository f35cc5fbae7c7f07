"""OptimConfig: the optimizer schedule's settings (conf/train.yaml's optim), each with what it accepts.

Here rather than beside the module (project.training.lit_module), so that the settings check reads the same
rules before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass

from project.runtime.settings import above, at_least, check_fields, or_null, setting, whole

STEPS = "a whole number of steps, 0 or more"


@dataclass
class OptimConfig:
    lr: float = setting(3e-4, above(0), "above 0, e.g. 3e-4")
    min_lr: float = setting(3e-5, at_least(0), "0 or more (the cosine's floor)")  # the cosine decays to this
    warmup_steps: int = setting(100, whole(0), STEPS)
    # Warmup + cosine length in optimizer steps; None: trainer.max_steps.
    decay_steps: int | None = setting(None, or_null(whole(1)), "null (trainer.max_steps) or a number of steps above 0")
    weight_decay: float = setting(0.1, at_least(0), "0 or more")
    betas: tuple[float, float] = setting(
        (0.9, 0.95), lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two numbers in [0, 1), e.g. [0.9, 0.95]"
    )
    eps: float = setting(1e-8, above(0), "above 0, e.g. 1e-8")
    # The largest global gradient norm; None or 0 disables clipping.
    grad_clip: float | None = setting(1.0, or_null(at_least(0)), "null or 0 (no clipping), or a norm above 0")
    # Steps with a non-finite gradient norm to skip before the run stops.
    max_skipped_steps: int = setting(0, whole(0), "a whole number of steps, 0 (stop at the first) or more")

    def __post_init__(self) -> None:
        check_fields(self, "optim")
        if self.min_lr > self.lr:
            raise ValueError(
                f"optim.min_lr={self.min_lr} is above optim.lr={self.lr}: the cosine decays from lr down to min_lr."
            )

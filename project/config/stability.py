"""StabilityConfig: what a run does about loss spikes, per-layer numerics and slow ranks (conf/stability), each
setting with what it accepts.

Here rather than beside the code that acts on it (project.training.stability), so that the settings check reads
the same rules before torch is imported."""

from __future__ import annotations

from dataclasses import dataclass

from project.runtime.settings import above, at_least, check_fields, setting, switch, whole

ACTIONS = ("log", "skip", "rollback")


@dataclass
class StabilityConfig:
    # What a spike does: log (z-scores and spikes logged, training untouched), skip (its update withheld),
    # rollback (the run restarts from its last checkpoint with the spike's batches left out).
    action: str = setting("log", lambda v: v in ACTIONS, "log, skip or rollback")
    window: int = setting(100, whole(2), "a whole number of steps, 2 or more (the running statistics' length)")
    # Steps whose loss and gradient norm enter the statistics before any step is judged against them (and none is
    # judged before the learning rate's warm-up, optim.warmup_steps, is over).
    warmup_steps: int = setting(100, whole(2), "a whole number of steps, 2 or more")
    # A step is out of its band when the logarithm of its loss (or gradient norm) lies this many units of step noise
    # (1.4826 / sqrt(2) x the median absolute difference of successive steps) above its recent level (the median of
    # the window's last tenth).
    threshold: float = setting(6.0, above(0), "standard deviations above 0, e.g. 6")
    # A gradient norm out of its band with the loss in its own is logged only (clipping bounds the update); true:
    # the action acts on it too.
    act_on_grad_norm: bool = switch(False)
    # A rise lasting longer than this many steps is the loss's new level, not a spike: from then on its steps are
    # applied and enter the statistics (so that a lasting shift cannot withhold every later update under skip).
    max_consecutive_spikes: int = setting(10, whole(1), "a whole number of steps, 1 or more")
    # rollback: global batches after the spike's own to leave out as well (PaLM skipped 200 to 500).
    skip_batches: int = setting(0, whole(0), "a whole number of batches, 0 or more")
    # rollback: optimizer steps after the restart whose learning rate is scaled by cooldown_lr_scale.
    cooldown_steps: int = setting(0, whole(0), "a whole number of steps, 0 or more")
    cooldown_lr_scale: float = setting(0.1, lambda v: 0 < v <= 1, "a factor in (0, 1]")
    # rollback: incidents allowed in a run (an incident: the rollbacks to one checkpoint in a row); the next stops it.
    max_rollbacks: int = setting(10, whole(0), "a whole number, 0 or more")
    # rollback: rollbacks to one checkpoint before the run stops; each leaves out four times the batches of the one
    # before, and from the third the learning rate is cooled down (project.training.stability.escalate).
    max_attempts: int = setting(3, whole(1), "a whole number, 1 or more")
    # Per-layer gradient and parameter norms, update ratios and output RMS every N steps; 0: never.
    numerics_every_n_steps: int = setting(0, whole(0), "a whole number of steps, 0 (never) or more")
    # A rank slower than this many times the median step time is named in a warning.
    straggler_factor: float = setting(2.0, at_least(1), "a factor of 1 or more, e.g. 2")
    # Copies of a parameter on several ranks compared every N steps (and before each save); 0: before saves only.
    replica_check_every_n_steps: int = setting(100, whole(0), "a whole number of steps, 0 (before saves only) or more")

    def __post_init__(self) -> None:
        check_fields(self, "stability")
        if self.warmup_steps > self.window:
            raise ValueError(
                f"stability.warmup_steps={self.warmup_steps} is more than stability.window={self.window}: the "
                "statistics hold the last `window` steps, so they never reach the warm-up. Raise the window or lower "
                "the warm-up."
            )

"""Loss spikes: each step's loss and gradient norm judged against running statistics of the steps before it, decided
on the device (conf/stability, project.config.stability).

A step is a spike when, after `warmup_steps` steps have entered the statistics, its loss or its gradient norm lies
more than `threshold` standard deviations above the mean of the last `window` steps (only steps that were not
spikes, and finite, enter them: a spike does not widen the band that judges the next). A rise that lasts more than
`max_consecutive_spikes` steps is a shift of the loss's level, not a spike: from then on its steps count as any
other (applied, and entered into the statistics, which follow the new level), and the shift is recorded. Every rank
judges the same values (the loss averaged over the ranks, the global gradient norm), so every rank decides alike.

What a spike does (`action`):
- log: `stability/loss_z`, `stability/grad_norm_z` and `stability/spikes` are logged (always), and the spike is
  recorded; training is untouched.
- skip: its update is withheld on the device, as a non-finite step's is (project.training.nonfinite: weights,
  AdamW's moments and step counts as before it); the data moves on, and the learning-rate schedule follows the
  step count.
- rollback: the run restarts from its last checkpoint, written before the spike, and reads on past the spike's
  batch and `skip_batches` more, optionally at `cooldown_lr_scale` times the learning rate for `cooldown_steps`
  (project.training.run). The host must learn of the spike in the same step, so it reads the decision every step.

Each spike is recorded in the run directory's `stability.jsonl` (one JSON object per line) and said in a warning.
Under log and skip the host reads the records only where it waits for the device anyway (logging steps, a
checkpoint, the end), as the non-finite guard does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from project.config.stability import StabilityConfig
from project.runtime.errors import TrainingStopped

RECORD_FILE = "stability.jsonl"
EVENT_FIELDS = ("step", "loss", "grad_norm", "loss_z", "grad_norm_z", "shift")
MAX_EVENTS = 64  # spikes kept on the device between two reads of the host; more are counted, not detailed
# A window flatter than this fraction of its mean is taken to spread that much: a perfectly flat loss would make
# any rise, however small, a spike.
RELATIVE_SPREAD_FLOOR = 1e-3


@dataclass
class Rollback:
    """One restart after a spike: what was left out, and the learning rate after it."""

    spike_step: int
    restart_step: int  # the checkpoint's step, from which the run went on
    resume_sample: int  # the data position it went on from (sequences of the global stream)
    left_out_from: int = 0  # the data position of the checkpoint: sequences left_out_from .. resume_sample were dropped
    lr_scale: float = 1.0
    cooldown_until: int = 0  # the first step after the cooldown

    def lr_scale_at(self, step: int) -> float:
        return self.lr_scale if self.restart_step <= step < self.cooldown_until else 1.0


class RollbackRequested(Exception):
    """A spike under stability.action=rollback: raised out of the fit on every rank alike, for the run to restart
    (project.training.run). Not an error: nothing was written since the last checkpoint."""

    def __init__(
        self,
        event: dict[str, float],
        samples_consumed: int,
        global_batch_size: int,
        checkpoint_steps: set[int],
        detector: "SpikeDetector",
    ):
        self.kind = spike_kind(event, detector.config.threshold)
        super().__init__(f"{self.kind} at step {int(event['step'])}: rolling back")
        self.event, self.samples_consumed, self.global_batch_size = event, samples_consumed, global_batch_size
        self.checkpoint_steps = checkpoint_steps  # of the checkpoints this fit loaded or saved: its own trajectory's
        self.rollbacks = list(detector.rollbacks)  # every rollback so far, those of the runs it resumed included
        self.record = detector.record


def describe(event: dict[str, Any]) -> str:
    return (
        f"step {int(event['step'])}: loss {event['loss']:.4g} ({event['loss_z']:+.1f} sd), gradient norm "
        f"{event['grad_norm']:.4g} ({event['grad_norm_z']:+.1f} sd)"
    )


def spike_kind(event: dict[str, Any], threshold: float) -> str:
    """Which of the two lies above the band, as the warnings say it: a step whose gradient norm alone is out is
    no loss spike."""
    loss, norm = event["loss_z"] > threshold, event["grad_norm_z"] > threshold
    if loss and norm:
        return "a spike of the loss and the gradient norm"
    return "a gradient-norm spike (the loss within its band)" if norm else "a loss spike"


class SpikeDetector:
    """The running statistics and the spikes found, on the device; their record on the host."""

    def __init__(self, config: StabilityConfig, rollbacks: list[Rollback | dict] | None = None):
        self.config = config
        self.rollbacks = [r if isinstance(r, Rollback) else Rollback(**r) for r in rollbacks or []]
        self.spikes = 0  # spikes the host has recorded (or that the checkpoint counted)
        self._consecutive = 0  # a checkpoint's steps in a row above the threshold
        self._history: list[list[float]] = []  # a checkpoint's (loss, norm) of the last accepted steps, oldest first
        self._state: dict[str, torch.Tensor] | None = None
        self.record_dir: Path | None = None  # where stability.jsonl goes (rank 0 only); None: not written

    def _device_state(self, like: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        if self._state is None:  # once per run (and after loading a checkpoint): no copy to the device per step
            window, device = self.config.window, like.device
            values = torch.zeros(2, window, device=device, dtype=torch.float32)
            valid = torch.zeros(window, device=device, dtype=torch.bool)
            kept = self._history[-window:]
            if kept:
                values[:, : len(kept)] = torch.tensor(kept, dtype=torch.float32, device=device).T
                valid[: len(kept)] = True
            self._state = {
                "values": values,  # the window's (loss, norm) of accepted steps, a ring
                "valid": valid,
                "accepted": torch.tensor(len(kept), device=device),  # steps entered: the ring's next slot, mod window
                "z": torch.zeros(2, device=device),  # the latest step's z-scores
                "events": torch.zeros(MAX_EVENTS, len(EVENT_FIELDS), device=device, dtype=torch.float64),
                "found": torch.tensor(self.spikes, device=device),  # spikes (and shifts) found so far
                "run": torch.tensor(self._consecutive, device=device),  # steps in a row above the threshold
                "step": torch.tensor(float(step), device=device, dtype=torch.float64),  # counted on the device
            }
        return self._state

    def observe(self, loss: torch.Tensor, norm: torch.Tensor, step: int) -> torch.Tensor:
        """Judge step `step`'s loss and global gradient norm (0-d tensors, the same on every rank); enter them
        into the statistics unless they are a spike or not finite. The spike flag, on the device."""
        s = self._device_state(norm, step)
        x = torch.stack([loss.detach().float().reshape(()), norm.detach().float().reshape(())])
        valid = s["valid"]
        n = valid.sum()
        mean = torch.where(valid, s["values"], 0).sum(dim=1) / n.clamp(min=1)
        spread = torch.where(valid, s["values"] - mean[:, None], 0).square().sum(dim=1) / (n - 1).clamp(min=1)
        std = torch.maximum(spread.sqrt(), RELATIVE_SPREAD_FLOOR * mean.abs()).clamp(min=torch.finfo(x.dtype).tiny)
        warm = n >= self.config.warmup_steps
        z = torch.where(warm, (x - mean) / std, 0.0)
        finite = torch.isfinite(x).all()
        above = warm & finite & (z > self.config.threshold).any()
        shifted = above & (s["run"] >= self.config.max_consecutive_spikes)  # a new level, not a spike
        spike = above & ~shifted
        s["run"] = torch.where(above, s["run"] + 1, 0)
        enter = finite & ~spike
        slot = (s["accepted"] % self.config.window).reshape(1)
        s["values"].index_copy_(1, slot, torch.where(enter, x, s["values"].index_select(1, slot).squeeze(1))[:, None])
        s["valid"].index_copy_(0, slot, valid.index_select(0, slot) | enter)
        s["accepted"] += enter
        s["z"] = torch.where(finite, z, 0.0)
        new_level = shifted & (s["run"] == self.config.max_consecutive_spikes + 1)  # the shift's first step
        row = torch.cat([s["step"].reshape(1), torch.cat([x, z]).double(), new_level.double().reshape(1)])
        s["step"] += 1
        recorded = spike | new_level
        unread = (s["found"] - self.spikes).clamp(max=MAX_EVENTS - 1).reshape(1)
        kept = s["events"].index_select(0, unread).squeeze(0)
        s["events"].index_copy_(0, unread, torch.where(recorded, row, kept)[None])
        s["found"] += recorded
        return spike

    def metrics(self) -> dict[str, torch.Tensor]:
        """What a logging step logs (device tensors: read at logging only)."""
        if self._state is None:
            return {}
        s = self._state
        z, found = s["z"], s["found"].float()
        return {"stability/loss_z": z[0], "stability/grad_norm_z": z[1], "stability/spikes": found}

    def read_events(self) -> list[dict[str, float]]:
        """On the host: the spikes found since the last read, in order (at most MAX_EVENTS detailed)."""
        if self._state is None:
            return []
        found = int(self._state["found"])
        new = found - self.spikes
        if new <= 0:
            return []
        rows = self._state["events"][: min(new, MAX_EVENTS)].tolist()
        self.spikes = found
        events = [dict(zip(EVENT_FIELDS, row)) for row in rows]
        if new > MAX_EVENTS:
            rank_zero_warn(f"{new - MAX_EVENTS} more loss spikes since the last logging step, not detailed.")
        return events

    def report(self, action: str) -> None:
        """On the host: warn of and record the spikes and shifts found since the last report."""
        for event in self.read_events():
            if event.pop("shift"):
                rank_zero_warn(
                    f"{describe(event)}: above the band for more than stability.max_consecutive_spikes="
                    f"{self.config.max_consecutive_spikes} steps in a row: a new level, not a spike; its steps are "
                    "applied and enter the statistics from here."
                )
                self.record({**event, "action": "new level"})
                continue
            done = {"log": "training goes on (stability.action=log)", "skip": "its update skipped"}.get(action, action)
            rank_zero_warn(f"{describe(event)}: {spike_kind(event, self.config.threshold)}; {done}.")
            self.record({**event, "action": action})

    def record(self, entry: dict[str, Any]) -> None:
        if self.record_dir is None:
            return
        entry = {k: int(v) if k.endswith("step") else v for k, v in entry.items()}
        with open(self.record_dir / RECORD_FILE, "a") as file:
            file.write(json.dumps(entry) + "\n")

    def lr_scale(self, step: int) -> float:
        """The cooldown's factor at `step`: the smallest of the rollbacks' whose cooldown covers it (two that overlap
        do not compound)."""
        return min((rollback.lr_scale_at(step) for rollback in self.rollbacks), default=1.0)

    def stop_past_budget(self, event: dict[str, float]) -> None:
        """Refuse a rollback beyond stability.max_rollbacks, naming every spike that caused one."""
        if len(self.rollbacks) < self.config.max_rollbacks:
            return
        self.record({**event, "action": "stopped"})
        earlier = ", ".join(str(r.spike_step) for r in self.rollbacks) or "none"
        raise TrainingStopped(
            f"{describe(event)}: {spike_kind(event, self.config.threshold)}, after {len(self.rollbacks)} rollbacks "
            f"(stability.max_rollbacks={self.config.max_rollbacks}; spikes at steps {earlier}): training stopped, the "
            "checkpoints written so far are untouched. Resume from last.ckpt (ckpt_path=last) with a lower optim.lr or "
            "more stability.skip_batches, or allow more with stability.max_rollbacks=N."
        )

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain values (any layout reads them): the statistics' steps in order, the spikes, the rollbacks."""
        history = self._history
        if self._state is not None:
            s, window = self._state, self.config.window
            accepted = int(s["accepted"])
            order = [(accepted - k) % window for k in range(min(accepted, window), 0, -1)]
            history = s["values"][:, order].T.tolist()
        return {
            "history": history,
            "spikes": self.spikes,
            "consecutive": int(self._state["run"]) if self._state is not None else self._consecutive,
            "rollbacks": [vars(r) for r in self.rollbacks],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = [list(pair) for pair in state.get("history", [])]
        self.spikes = int(state.get("spikes", 0))
        self._consecutive = int(state.get("consecutive", 0))
        # The checkpoint's rollbacks and those this process made since (it restarted from an older checkpoint): each
        # once, in the order they were made (each read on further into the data).
        known = {(r.spike_step, r.resume_sample): r for r in [Rollback(**r) for r in state.get("rollbacks", [])]}
        known.update({(r.spike_step, r.resume_sample): r for r in self.rollbacks})
        self.rollbacks = sorted(known.values(), key=lambda r: r.resume_sample)
        self._state = None

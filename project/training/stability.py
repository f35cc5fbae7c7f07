"""Loss spikes: each step's loss and gradient norm judged against running statistics of the steps before it, decided
on the device (conf/stability, project.config.stability).

In logarithms, a step's loss and gradient norm are judged against their level (the median of the window's last
tenth) in units of the step noise (from the median absolute difference of successive steps, at least 1%), once the
window holds `warmup_steps` steps and the learning rate's warm-up is over. A loss more than `threshold` units above
its level is a spike, which the action acts on (a gradient norm too with `act_on_grad_norm`; otherwise a gradient
norm out of its band is an excursion, only logged). Finite steps that are not spikes enter the statistics: a spike
does not widen the band that judges the next. A rise that lasts more than
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
  (project.training.run); a spike met again before a new checkpoint escalates (`escalate`). The host learns of the
  spike where it waits for the device anyway (a logging step, before a checkpoint is written or a validation runs,
  the end), at most trainer.log_every_n_steps - 1 steps after it: its update is withheld on the device meanwhile,
  and no checkpoint is written in between, so the restart is the one an immediate read would make; the steps
  between are dropped with those since the checkpoint (project.training.lit_module).

Each spike is recorded in the run directory's `stability.jsonl` (one JSON object per line) and said in a warning.
Under every action the host reads the records only where it waits for the device anyway (logging steps, a
checkpoint, the end), as the non-finite guard does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from project.config.stability import StabilityConfig
from project.runtime.errors import TrainingStopped

RECORD_FILE = "stability.jsonl"
EVENT_FIELDS = ("step", "loss", "grad_norm", "loss_z", "grad_norm_z", "shift", "acted")
MAX_EVENTS = 64  # spikes kept on the device between two reads of the host; more are counted, not detailed
# A window flatter than this (in natural logarithms: 1%) is taken to spread that much: a flat loss, or one whose values
# repeat (half the deviations zero makes the median deviation zero), would make any rise, however small, a spike. At
# the default threshold a step must then lie at least 6% above the window's median.
RELATIVE_SPREAD_FLOOR = 1e-2
MAD_TO_SD = 1.4826  # the median absolute deviation of normal values times this is their standard deviation
LEVEL_FRACTION = 10  # the level a step is judged against: the median of the window's last tenth (at least 3 steps)


@dataclass
class Rollback:
    """One restart after a spike: what was left out, and the learning rate after it."""

    spike_step: int
    restart_step: int  # the checkpoint's step, from which the run went on
    resume_sample: int  # the data position it went on from (sequences of the global stream)
    left_out_from: int = 0  # the data position of the checkpoint: sequences left_out_from .. resume_sample were dropped
    lr_scale: float = 1.0
    cooldown_until: int = 0  # the first step after the cooldown
    attempt: int = 1  # of the rollbacks to this checkpoint in a row (an incident): each leaves out more (escalate)

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
        self.config = detector.config
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

    def __init__(
        self, config: StabilityConfig, rollbacks: list[Rollback | dict] | None = None, lr_warmup_steps: int = 0
    ):
        """`lr_warmup_steps`: the learning rate's warm-up (optim.warmup_steps), before whose end nothing is judged:
        the gradient norm and the loss's pace change with the rate there."""
        self.config = config
        self.lr_warmup_steps = lr_warmup_steps
        self.level_steps = max(3, config.window // LEVEL_FRACTION)  # the recent steps whose median is the level
        self.acted = 0  # spikes the action acted on, of those recorded
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
            if kept:  # checkpoints keep the values themselves; the ring holds their logarithms
                values[:, : len(kept)] = torch.tensor(kept, dtype=torch.float32, device=device).T.log()
                valid[: len(kept)] = True
            self._state = {
                "values": values,  # the window's (loss, norm) of accepted steps, a ring
                "valid": valid,
                "accepted": torch.tensor(len(kept), device=device),  # steps entered: the ring's next slot, mod window
                "z": torch.zeros(2, device=device),  # the latest step's z-scores
                "events": torch.zeros(MAX_EVENTS, len(EVENT_FIELDS), device=device, dtype=torch.float64),
                "found": torch.tensor(self.spikes, device=device),  # events recorded so far: spikes, shifts, excursions
                "acted": torch.tensor(self.acted, device=device),  # spikes the action acts on
                "run": torch.tensor(self._consecutive, device=device),  # steps in a row above the threshold
                "step": torch.tensor(float(step), device=device, dtype=torch.float64),  # counted on the device
            }
        return self._state

    def observe(self, loss: torch.Tensor, norm: torch.Tensor, step: int) -> torch.Tensor:
        """Judge step `step`'s loss and global gradient norm (0-d tensors, the same on every rank); enter them
        into the statistics unless they are a spike the action handles, or not finite. The spike flag, on the
        device: what the action acts on (a loss spike; a gradient-norm one too with stability.act_on_grad_norm)."""
        s = self._device_state(norm, step)
        x = torch.stack([loss.detach().float().reshape(()), norm.detach().float().reshape(())])
        # Logarithms: a loss or a norm that doubles is as far out from 1 as from 10, and their heavy upper tails
        # (a gradient norm that grows several-fold as the learning rate warms up) become nearly symmetric.
        logs = x.clamp(min=torch.finfo(x.dtype).tiny).log()
        valid = s["valid"]
        n = valid.sum()
        size = self.config.window
        # The window's accepted steps in the order they came, oldest first (unfilled slots first, as NaN).
        order = (s["accepted"] - size + torch.arange(size, device=valid.device)) % size
        history = torch.where(valid[order], s["values"][:, order], torch.nan)
        # The level: the median of the last few steps, which follows a falling loss; the noise: from the differences
        # of successive steps, which a trend over the window hardly moves (a window's own spread would be mostly
        # trend on a falling loss, and hide a spike on it). The median |difference| of two draws of spread sd is
        # 0.6745 x sd x sqrt(2): sd = 1.4826 / sqrt(2) x that median.
        level = history[:, -self.level_steps :].nanmedian(dim=1).values
        step_noise = (history[:, 1:] - history[:, :-1]).abs().nanmedian(dim=1).values * (MAD_TO_SD / math.sqrt(2))
        spread = torch.nan_to_num(step_noise, nan=0.0).clamp(min=RELATIVE_SPREAD_FLOOR)
        judged = (n >= self.config.warmup_steps) & (s["step"] >= self.lr_warmup_steps)
        z = torch.where(judged, (logs - torch.nan_to_num(level)) / spread, 0.0)
        finite = torch.isfinite(x).all()
        out = judged & finite & (z > self.config.threshold)
        acts = out[0] | (out[1] & self.config.act_on_grad_norm)
        shifted = acts & (s["run"] >= self.config.max_consecutive_spikes)  # a new level, not a spike
        spike = acts & ~shifted
        excursion = out[1] & ~acts  # a gradient norm alone out of its band: logged, clipping bounds its update
        s["run"] = torch.where(acts, s["run"] + 1, 0)
        enter = finite & ~spike
        slot = (s["accepted"] % self.config.window).reshape(1)
        s["values"].index_copy_(
            1, slot, torch.where(enter, logs, s["values"].index_select(1, slot).squeeze(1))[:, None]
        )
        s["valid"].index_copy_(0, slot, valid.index_select(0, slot) | enter)
        s["accepted"] += enter
        s["z"] = torch.where(finite, z, 0.0)
        new_level = shifted & (s["run"] == self.config.max_consecutive_spikes + 1)  # the shift's first step
        row = torch.cat([s["step"].reshape(1), torch.cat([x, z]).double(), new_level.double().reshape(1)])
        row = torch.cat([row, spike.double().reshape(1)])
        s["step"] += 1
        recorded = spike | new_level | excursion
        if self.config.action == "rollback":  # after a spike the run rolls back: what follows it is dropped with it
            recorded = recorded & (s["acted"] == self.acted)
        unread = (s["found"] - self.spikes).clamp(max=MAX_EVENTS - 1).reshape(1)
        kept = s["events"].index_select(0, unread).squeeze(0)
        s["events"].index_copy_(0, unread, torch.where(recorded, row, kept)[None])
        s["found"] += recorded
        s["acted"] += spike
        return spike

    def metrics(self) -> dict[str, torch.Tensor]:
        """What a logging step logs (device tensors: read at logging only)."""
        if self._state is None:
            return {}
        s = self._state
        z = s["z"]
        excursions = (s["found"] - s["acted"]).float()  # and new levels, which are rare
        return {
            "stability/loss_z": z[0],
            "stability/grad_norm_z": z[1],
            "stability/spikes": s["acted"].float(),
            "stability/excursions": excursions,
        }

    def read_events(self) -> list[dict[str, float]]:
        """On the host: the spikes found since the last read, in order (at most MAX_EVENTS detailed)."""
        if self._state is None:
            return []
        found = int(self._state["found"])
        new = found - self.spikes
        if new <= 0:
            return []
        rows = self._state["events"][: min(new, MAX_EVENTS)].tolist()
        self.spikes, self.acted = found, int(self._state["acted"])
        events = [dict(zip(EVENT_FIELDS, row)) for row in rows]
        if new > MAX_EVENTS:
            rank_zero_warn(f"{new - MAX_EVENTS} more loss spikes since the last logging step, not detailed.")
        return events

    def report(self, action: str, events: list[dict[str, float]] | None = None) -> None:
        """On the host: warn of and record the spikes, shifts and gradient-norm excursions found since the last report
        (the excursions in one warning); `events`: those read_events has just read, else read now."""
        excursions = []
        for event in self.read_events() if events is None else events:
            if not event.pop("acted") and not event["shift"]:
                event.pop("shift")
                excursions.append(event)
                self.record({**event, "action": "logged"})
                continue
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
        if excursions:
            steps = ", ".join(str(int(e["step"])) for e in excursions[:5]) + (", ..." if len(excursions) > 5 else "")
            rank_zero_warn(
                f"{describe(excursions[-1])}: the gradient norm above its band, the loss within its own, at "
                f"{len(excursions)} step(s) since the last report ({steps}): logged only, as clipping bounds the "
                "update (stability.act_on_grad_norm=true acts on such steps too)."
            )

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

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain values (any layout reads them): the statistics' steps in order, the spikes, the rollbacks."""
        history = self._history
        if self._state is not None:
            s, window = self._state, self.config.window
            accepted = int(s["accepted"])
            order = [(accepted - k) % window for k in range(min(accepted, window), 0, -1)]
            history = s["values"][:, order].T.double().exp().tolist()
        return {
            "history": history,
            "spikes": self.spikes,
            "acted": int(self._state["acted"]) if self._state is not None else self.acted,
            "consecutive": int(self._state["run"]) if self._state is not None else self._consecutive,
            "rollbacks": [vars(r) for r in self.rollbacks],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = [list(pair) for pair in state.get("history", [])]
        self.spikes = int(state.get("spikes", 0))
        self.acted = int(state.get("acted", self.spikes))  # before excursions were recorded, every event acted
        self._consecutive = int(state.get("consecutive", 0))
        # The checkpoint's rollbacks and those this process made since (it restarted from an older checkpoint): each
        # once, in the order they were made (each read on further into the data).
        known = {(r.spike_step, r.resume_sample): r for r in [Rollback(**r) for r in state.get("rollbacks", [])]}
        known.update({(r.spike_step, r.resume_sample): r for r in self.rollbacks})
        self.rollbacks = sorted(known.values(), key=lambda r: r.resume_sample)
        self._state = None


@dataclass
class RollbackPlan:
    """What a rollback does: which attempt at its checkpoint it is, the batches after the spike's it leaves out,
    and its learning-rate cooldown."""

    attempt: int
    skip_batches: int
    lr_scale: float
    cooldown_steps: int


def escalate(
    config: StabilityConfig, rollbacks: list[Rollback], event: dict[str, Any], restart_step: int, record: Any
) -> RollbackPlan:
    """The next rollback, to the checkpoint of `restart_step`, after `rollbacks`. A spike met again before a new
    checkpoint (the last rollback went back to the same one) is the same incident, and its rollback escalates: the
    first leaves out stability.skip_batches batches after the spike's, each next one four times as many (counting
    the spike's own), and from the third on the learning rate is cooled down (cooldown_lr_scale, for
    cooldown_steps or twice the steps from the checkpoint to the spike, whichever is more). Past
    stability.max_attempts rollbacks in one incident, or a new incident past stability.max_rollbacks, the run stops
    with one paragraph (TrainingStopped), the spike recorded as `stopped`."""
    spike_step = int(event["step"])
    previous = rollbacks[-1] if rollbacks else None
    attempt = previous.attempt + 1 if previous is not None and previous.restart_step == restart_step else 1
    incidents = sum(r.attempt == 1 for r in rollbacks)
    kind = spike_kind(event, config.threshold)
    stop = None
    if attempt > config.max_attempts:
        tries = [r for r in rollbacks if r.restart_step == restart_step][-config.max_attempts :]
        done = ", then ".join(f"{r.resume_sample - r.left_out_from} sequences" for r in tries)
        stop = (
            f"{describe(event)}: {kind}, met again after {len(tries)} rollbacks to the checkpoint of step "
            f"{restart_step} (stability.max_attempts={config.max_attempts}; they left out {done}, the last with the "
            f"learning rate cooled down): training stopped, the checkpoints written so far are untouched. Look at the "
            "data the spikes came from (stability.jsonl), lower optim.lr, or allow more with stability.max_attempts=N."
        )
    elif attempt == 1 and incidents >= config.max_rollbacks:
        earlier = ", ".join(str(r.spike_step) for r in rollbacks if r.attempt == 1) or "none"
        stop = (
            f"{describe(event)}: {kind}, a new incident after {incidents} (stability.max_rollbacks="
            f"{config.max_rollbacks}; incidents from the spikes at steps {earlier}): training stopped, the checkpoints "
            "written so far are untouched. Resume from last.ckpt (ckpt_path=last) with a lower optim.lr or more "
            "stability.skip_batches, or allow more with stability.max_rollbacks=N."
        )
    if stop is not None:
        record({**event, "action": "stopped"})
        raise TrainingStopped(stop)
    skip = (config.skip_batches + 1) * 4 ** (attempt - 1) - 1
    if attempt >= 3:
        steps = max(config.cooldown_steps, 2 * (spike_step - restart_step))
        return RollbackPlan(attempt, skip, config.cooldown_lr_scale, steps)
    scale = config.cooldown_lr_scale if config.cooldown_steps else 1.0
    return RollbackPlan(attempt, skip, scale, config.cooldown_steps)

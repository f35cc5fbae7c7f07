"""The guard against a non-finite gradient norm (`optim.max_skipped_steps`), decided on the device.

A step whose global gradient norm is NaN or Inf is not applied: up to `max_skipped_steps` such steps are skipped
and training goes on; the next one stops the run with the weights, and the checkpoints, of before it. Reading the
norm in Python every step would make the host wait for the device every step, so the decision is taken where the
norm is: on the device, as a flag that torch's fused Adam and AdamW take in place of their update
(`found_inf`, the flag torch's GradScaler gives them: the parameters, moments and step counts stay exactly as they
were). Past the budget every later update is withheld too, so the weights stay those of before the step until the
host looks. The host reads the counts only where it waits for the device anyway (`check`: at logging steps,
before a checkpoint is written, when training ends), then warns of the steps skipped since, or stops the run.

An optimizer that cannot take the flag (any but fused Adam or AdamW, or one under a gradient scaler) is guarded
as before: the flag is read on the host every step, and a skipped step's gradients are dropped.
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_warn

from project.runtime.errors import TrainingStopped


def takes_the_flag_on_the_device(optimizer: torch.optim.Optimizer, scaled: bool) -> bool:
    """Whether `optimizer` skips its update on the device when given the flag: torch's Adam and AdamW (whose
    subclasses, e.g. Horovod's wrapper, keep their step) built with fused=True, outside a gradient scaler (which
    sets the flag itself)."""
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return fused and isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and not scaled


class NonFiniteGuard:
    def __init__(self, max_skipped: int, skipped: int = 0):
        self.max_skipped = max_skipped
        self.reported = skipped  # non-finite steps the host has warned of (or that the checkpoint counted)
        self._state: dict[str, torch.Tensor] | None = None

    def _device_state(self, norm: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        if self._state is None:  # once per run: the counts move to the device with the first norm
            device = norm.device
            self._state = {
                "count": torch.tensor(self.reported, device=device),  # non-finite steps, the one past the budget too
                "step": torch.tensor(step, device=device),  # this step's index, counted on the device
                "last_bad": torch.tensor(-1, device=device),  # the latest non-finite step
                "last_norm": torch.zeros((), device=device, dtype=norm.dtype),  # and its norm
                "stopped_at": torch.tensor(-1, device=device),  # the non-finite step past the budget
            }
        return self._state

    def before_update(
        self,
        norm: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        step: int,
        on_device: bool,
        withhold: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """After the step's global gradient norm is known, before its update: withhold the update when the norm
        is not finite or the budget is spent, or `withhold` (a flag on the device: a loss spike) says so.
        `on_device`: the optimizer takes the flag (takes_the_flag_on_the_device); otherwise the flag is read here,
        and the run stops or the gradients are dropped at once. Returns the flag (on the device: true where the
        update is withheld)."""
        s = self._device_state(norm, step)
        bad = ~torch.isfinite(norm)
        s["count"] += bad
        past_budget = s["count"] > self.max_skipped
        s["stopped_at"] = torch.where(past_budget & (s["stopped_at"] < 0), s["step"], s["stopped_at"])
        s["last_bad"] = torch.where(bad, s["step"], s["last_bad"])
        s["last_norm"] = torch.where(bad, norm.detach(), s["last_norm"])
        s["step"] += 1
        withheld = bad | past_budget if withhold is None else bad | past_budget | withhold
        if on_device:
            optimizer.found_inf = withheld.float()  # type: ignore[attr-defined]  # read by torch's fused step
            return withheld
        if withheld:  # the host waits for the device here, every step
            self.check()
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # AdamW leaves a parameter without a gradient untouched: no update, no moments
        return withheld

    def check(self) -> None:
        """On the host: warn of the steps skipped since the last check; stop the run if one was past the budget.
        Every rank holds the same counts (from the same global norm), so every rank decides alike."""
        if self._state is None:
            return
        s = self._state
        count, last_bad, stopped_at = (int(v) for v in torch.stack([s["count"], s["last_bad"], s["stopped_at"]]))
        norm = float(s["last_norm"])
        if stopped_at >= 0:
            raise TrainingStopped(
                f"step {stopped_at}: the gradient norm is {norm if last_bad == stopped_at else 'not finite'} (a "
                "non-finite loss or gradient): training stopped, its update and any after it withheld; the checkpoints "
                "written so far are untouched. Resume from last.ckpt (ckpt_path=last) with a lower optim.lr or a "
                "tighter optim.grad_clip, or let such steps be skipped with optim.max_skipped_steps=N."
            )
        if count > self.reported:
            more = count - self.reported - 1
            since = f"; {more} more since the last report." if more else "."
            rank_zero_warn(
                f"step {last_bad}: gradient norm {norm}, update skipped ({count} of "
                f"optim.max_skipped_steps={self.max_skipped})" + since
            )
            self.reported = count

    @property
    def skipped(self) -> int:
        """Updates skipped so far (read on the host: where it waits for the device anyway)."""
        return self.reported

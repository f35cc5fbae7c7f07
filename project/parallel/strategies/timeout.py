"""How long a rank waits in a collective before giving up: the bound on a job whose other rank died. Two bounds: one
for start-up (the ranks meeting, a checkpoint's load, compilation, the first batch: up to the end of the first
optimizer step), which may take long on a large job, and a shorter one for the steady state after it, so that a rank
that stops answering mid-run ends the job soon (project.training.callbacks.timeouts switches between them)."""

from __future__ import annotations

from datetime import timedelta

from project.runtime.errors import ConfigError


def collective_timeout(minutes: float | None) -> timedelta | None:
    """`strategy.collective_timeout_minutes` as the timeout of the run's process groups.

    Gloo and NCCL raise in the waiting ranks once a collective takes longer, so a job with a hung or
    dead rank ends instead of holding its nodes. The first collectives of a run (model broadcast, a
    checkpoint's conversion) must fit within it too. None: torch's default (30 minutes, 10 for NCCL).
    """
    if minutes is None:
        return None
    if not minutes > 0:
        raise ConfigError(
            f"strategy.collective_timeout_minutes={minutes} must be above 0: it bounds how long a rank waits for the "
            "others (a few minutes suits most runs; raise it if the first step or a checkpoint takes longer)."
        )
    return timedelta(minutes=minutes)


def startup_timeout(startup_minutes: float | None, collective_minutes: float | None) -> timedelta | None:
    """The timeout the run's process groups are made with: `strategy.startup_timeout_minutes`, or the collective
    timeout where that is longer (a start never has less time than a step); None (torch's default throughout) where
    the collective timeout is null."""
    if startup_minutes is not None and not startup_minutes > 0:
        raise ConfigError(
            f"strategy.startup_timeout_minutes={startup_minutes} must be above 0: it bounds how long a rank waits "
            "for the others until the first optimizer step has ended (the ranks meeting, a checkpoint's load, "
            "compilation); 30 suits most jobs, more where a large checkpoint loads from slow storage."
        )
    steady = collective_timeout(collective_minutes)
    if startup_minutes is None or steady is None:
        return steady
    return max(timedelta(minutes=startup_minutes), steady)

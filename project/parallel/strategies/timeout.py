"""How long a rank waits in a collective before giving up: the bound on a job whose other rank died."""

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

"""How many ranks hold one model replica."""

from __future__ import annotations

from typing import Any, Mapping


def model_parallel_size(strategy_cfg: Mapping[str, Any]) -> int:
    """Ranks that together hold one model replica (tensor x pipeline); 1 for pure data parallelism."""
    return int(strategy_cfg.get("tensor_parallel_size", 1) or 1) * int(strategy_cfg.get("pipeline_parallel_size", 1) or 1)

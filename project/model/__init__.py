"""The Llama model and its arithmetic. `Llama` (torch) is imported on first use, so the config and
the parameter and FLOP counts stay importable by settings checks that must not wait for torch."""

from importlib import import_module

from project.model.config import LlamaConfig
from project.model.flops import count_parameters, training_flops_per_token

_LAZY = {"Llama": "project.model.llama"}

__all__ = ["Llama", "LlamaConfig", "count_parameters", "training_flops_per_token"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'project.model' has no attribute {name!r}")

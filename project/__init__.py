"""Pretrain Llama-style models with PyTorch Lightning.

Public API: LlamaConfig, Llama, LlamaLitModule, TokenShardDataModule. Imported lazily so that
`project.model` stays a plain PyTorch import.
"""

from importlib import import_module

_EXPORTS = {
    "LlamaConfig": "project.model",
    "Llama": "project.model",
    "LlamaLitModule": "project.lit_module",
    "TokenShardDataModule": "project.data.datamodule",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'project' has no attribute {name!r}")

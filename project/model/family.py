"""A model family's entry in the registry (project.model.families): what the rest of the platform asks of a family
beyond its config's list of tensors (project.model.spec). torchtitan's ModelSpec is the shape.

Torch-free: the settings check reads it before torch is imported; the model classes are imported on first build.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from project.model.config import LlamaConfig

if TYPE_CHECKING:
    from project.model.llama import Llama


@dataclass(frozen=True)
class ModelFamily:
    name: str
    config: type[LlamaConfig]
    model: str  # "module:Class", imported when a model is built
    summary: str  # what the family is, in the words of an error or the docs
    label: str  # its name in a run's summary line ("model: LABEL, 4.0 M parameters, ...")
    # Its Hugging Face format, "module:NAME" (families/llama/hf.py: the architecture project.export writes and
    # init_from reads, config.json, the feed-forward's names), imported when converting; None: not yet.
    hf_format: str | None = None
    # The dimensions this family's model cannot be split over yet ("tensor", "context", "pipeline"; none today):
    # the settings check refuses them by name (project.config.layout.check_family_layout).
    refuses: tuple[str, ...] = ()

    def model_class(self) -> type[Llama]:
        return _imported(self.model)

    def format(self) -> Any:
        """Its Hugging Face format (a project.model.families.llama.hf.LlamaFormat); ValueError where it has none."""
        if self.hf_format is None:
            raise ValueError(f"model.family={self.name} ({self.summary}) has no Hugging Face format here.")
        return _imported(self.hf_format)


def _imported(target: str) -> Any:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)

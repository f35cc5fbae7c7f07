"""The model families this platform trains, one entry each: the config a family's settings build, its model class,
the Hugging Face architecture it converts to, and what the strategies can do with it (torchtitan's ModelSpec is the
shape). Everything that builds or sizes a model asks here (`model_config`, `build_model`), never a family's class.

Torch-free: the settings check reads it before torch is imported; the model classes are imported on first build.
A new family is a folder here: a config class (with its list of tensors, project.model.spec, and `mixture` for the
planner), a model class with the dense Llama's interface (`run_layers`, `head_loss`, `initial_value`,
`init_weights`, `to_empty`), a Hugging Face format (llama/hf.py says what one is) where it has one, its blocks'
tensor-parallel plan where a Llama block's is not theirs (project.parallel.tensor_parallel), and its entry
(`FAMILY`, a project.model.family.ModelFamily) named in FAMILIES below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from project.model.config import LlamaConfig
from project.model.families import llama, llama4, moe, qwen3
from project.model.family import ModelFamily

if TYPE_CHECKING:
    from project.model.llama import Llama


FAMILIES: dict[str, ModelFamily] = {
    family.name: family for family in (llama.FAMILY, moe.FAMILY, qwen3.FAMILY, llama4.FAMILY)
}


def family_of(fields: Mapping[str, Any] | LlamaConfig) -> ModelFamily:
    """The family of a model config, or of its fields as a dict (no `family` key: a dense Llama, as every
    checkpoint written before families existed)."""
    name = fields.family if isinstance(fields, LlamaConfig) else fields.get("family", "llama")
    if name not in FAMILIES:
        raise ValueError(f"model.family={name} is not a model family: it is one of {', '.join(FAMILIES)}.")
    return FAMILIES[name]


def without_hf_format(config: LlamaConfig, what: str) -> str | None:
    """Why `what` (project.export) cannot write a model of this config in its family's Hugging Face format, or
    None where it can."""
    family = family_of(config)
    if family.hf_format is None:
        return f"{what}: model.family={family.name} ({family.summary}) has no Hugging Face format here."
    if differences := config.hf_format_differences():
        return (
            f"{what} writes a model.family={family.name} checkpoint as {family.format().architecture}, which cannot "
            f"hold {', '.join(differences)} (docs/moe.md): the exported model would compute something else. Keep the "
            "checkpoint (it resumes, and project.generate reads it)."
        )
    return None


def model_config(fields: Mapping[str, Any] | LlamaConfig) -> LlamaConfig:
    """The config of a model's family from its fields (ValueError or TypeError for fields it cannot take)."""
    if isinstance(fields, LlamaConfig):
        return fields
    return family_of(fields).config(**fields)


def build_model(config: LlamaConfig | Mapping[str, Any], init_seed: int = 0) -> Llama:
    """The single-device model of `config` (built where torch's default device says, as the model classes are):
    a Llama, or a family's subclass of it with the same interface."""
    config = model_config(config)
    return family_of(config).model_class()(config, init_seed)

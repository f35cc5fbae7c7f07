"""The dense Llama (Llama 2, Llama 3): the decoder every family here builds on (project.model.llama, its config
project.model.config), with its Hugging Face format (hf.py)."""

from project.model.config import LlamaConfig
from project.model.family import ModelFamily

FAMILY = ModelFamily(
    "llama",
    LlamaConfig,
    "project.model.llama:Llama",
    "dense Llama (Llama 2, Llama 3)",
    "Llama",
    hf_format="project.model.families.llama.hf:LLAMA",
)

"""A Llama whose feed-forward is a mixture of experts (Mixtral, DeepSeek-style routing): its config (config.py), its
modules (model.py) and its Hugging Face format, Mixtral's (hf.py)."""

from project.model.families.moe.config import MoEConfig
from project.model.family import ModelFamily

FAMILY = ModelFamily(
    "moe",
    MoEConfig,
    "project.model.families.moe.model:MoELlama",
    "Llama with a mixture of experts as feed-forward (Mixtral, Llama 4)",
    "Llama mixture of experts",
    hf_format="project.model.families.moe.hf:MIXTRAL",
)

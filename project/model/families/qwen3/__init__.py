"""Qwen3 (dense): a Llama whose attention normalizes each head's queries and keys (RMSNorm over head_dim, before the
rotary embedding), whose heads may be wider than dim / n_heads, and whose small sizes tie the head to the embedding.
Its config (config.py), its attention (model.py), its Hugging Face format, Qwen3ForCausalLM's (hf.py)."""

from project.model.families.qwen3.config import Qwen3Config
from project.model.family import ModelFamily

FAMILY = ModelFamily(
    "qwen3",
    Qwen3Config,
    "project.model.families.qwen3.model:Qwen3",
    "Qwen3 (dense): per-head query and key norms",
    "Qwen3",
    hf_format="project.model.families.qwen3.hf:QWEN3",
)

"""Llama 4 (text), as Meta published it: a mixture of experts (project.model.families.moe) whose attention interleaves
rotary layers that attend within chunks of the sequence and every fourth layer without rotary embedding that attends
to every earlier position (iRoPE), with an L2 norm of queries and keys in the rotary layers and a temperature of the
queries in the others. Its config (config.py), its attention (model.py), its Hugging Face format, Llama4ForCausalLM's
(hf.py)."""

from project.model.families.llama4.config import Llama4Config
from project.model.family import ModelFamily

FAMILY = ModelFamily(
    "llama4",
    Llama4Config,
    "project.model.families.llama4.model:Llama4",
    "Llama 4 (text): chunked rotary and global rope-free attention layers, a mixture of experts",
    "Llama 4",
    hf_format="project.model.families.llama4.hf:LLAMA4",
)

"""Qwen3's Hugging Face format: Qwen3ForCausalLM, a Llama's names and the per-head norms (families/llama/hf.py says
what a format is). Torch-free."""

from __future__ import annotations

from typing import Any

from project.model.config import LlamaConfig
from project.model.families.llama.hf import LlamaFormat


class Qwen3Format(LlamaFormat):
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    BLOCK = LlamaFormat.BLOCK | {
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    }
    FIXED = LlamaFormat.FIXED | {"head_dim": "head_dim"}

    def config_dict(self, config: LlamaConfig, llama: dict[str, Any]) -> dict[str, Any]:
        qwen3 = {key: value for key, value in llama.items() if key != "mlp_bias"}
        return qwen3 | {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "use_sliding_window": False,  # every layer attends to every earlier position
            "sliding_window": None,
        }

    def unsupported(self, hf: dict[str, Any]) -> list[str]:
        # Any head width (head_dim is Qwen3's own setting); no sliding window.
        llama = [key for key in super().unsupported(hf) if key != "head_dim"]
        return llama + (["use_sliding_window"] if hf.get("use_sliding_window") else [])

    def settings(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {"head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]}


QWEN3 = Qwen3Format()

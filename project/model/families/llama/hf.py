"""The dense Llama's Hugging Face format, LlamaForCausalLM, and the base of every family's: what a family's config.json
adds to a Llama's, and the HF tensors of its feed-forward weights (the rest of a block, the embedding, the final norm
and the head are a Llama's in every family; the shapes are the family's tensors', project.model.spec). A family names
its format in its registry entry (`hf_format`); project.hf.conversion asks the entry, never a config's class.

Torch-free, like project.hf.conversion.
"""

from __future__ import annotations

from typing import Any

from project.model.config import LlamaConfig

Pieces = list[tuple[str, int | None]]  # (an HF tensor's name, the slice [j] of our weight it is, or None: all of it)


class LlamaFormat:
    """LlamaForCausalLM: a SwiGLU feed-forward of three matrices."""

    architecture = "LlamaForCausalLM"
    # Ours -> HF's, under model.layers.{i}.: w1 gates, w3 is the up projection, w2 projects down.
    FEED_FORWARD = {
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
    }

    def config_dict(self, config: LlamaConfig, llama: dict[str, Any]) -> dict[str, Any]:
        """The family's config.json from the Llama one describing `config`'s attention, norms and sizes."""
        return llama

    def feed_forward_pieces(self, layer: str, name: str, config: LlamaConfig) -> Pieces:
        """The HF tensors our feed-forward weight `name` of block `layer` is."""
        return [(f"model.layers.{layer}.{self.FEED_FORWARD[name]}", None)]


LLAMA = LlamaFormat()

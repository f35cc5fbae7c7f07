"""Llama4Config: the shape of Llama 4's text model, as plain data (no torch).

A mixture of experts (MoEConfig) routed as Meta's: one expert per token by its sigmoid score, which scales the expert's
input, beside a shared expert; `moe_every` interleaves dense blocks of `ffn_dim` (Maverick) with mixtures of experts of
`expert_ffn_dim`. Its attention differs by layer: block i with (i + 1) % nope_every == 0 has no rotary embedding and
attends to every earlier position, its queries scaled up with their position (temperature tuning); the others rotate
their queries and keys (channels paired side by side, Meta's layout), normalize them (qk_norm) and attend within
chunks of `attention_chunk_size` positions.
"""

from __future__ import annotations

from dataclasses import dataclass

from project.model.config import WHOLE, HeadNorms
from project.model.families.moe.config import MoEConfig
from project.runtime.settings import above, at_least, or_null, setting, switch, whole

# How Llama 4 routes (Llama4ForCausalLM): what a mixture must have to be written in its format, and what a Llama 4
# folder's model is given (project.hf.folder).
LLAMA4_ROUTING = {
    "shared_expert": True,
    "score_func": "sigmoid",
    "normalize_top_k": False,
    "weigh_inputs": True,
    "bias_update_rate": 0.0,
}


@dataclass
class Llama4Config(MoEConfig):
    family: str = "llama4"
    n_experts: int = setting(16, whole(2), "a whole number of experts, at least 2")
    top_k: int = setting(1, whole(1), "a whole number of experts per token, at least 1")
    shared_expert: bool = switch(True)
    score_func: str = setting("sigmoid", lambda v: v in ("softmax", "sigmoid"), "softmax or sigmoid")
    normalize_top_k: bool = switch(False)
    weigh_inputs: bool = switch(True)
    aux_loss_coef: float = setting(0.001, at_least(0), "at least 0, e.g. 0.001 (0: no auxiliary loss)")
    # Block i with (i + 1) % nope_every == 0 has no rotary embedding and attends globally (HF's
    # no_rope_layer_interval); the others rotate and attend within chunks.
    nope_every: int = setting(4, whole(1), WHOLE)
    # The positions a rotary layer's chunk spans: a query attends to the earlier keys of its own chunk. None: all.
    attention_chunk_size: int | None = setting(8192, or_null(whole(1)), "null (no chunks) or a whole number of tokens")
    # The rotary layers' queries and keys divided by their root mean square over head_dim (no gain), after rotation.
    qk_norm: bool = switch(True)
    # The rope-free layers' queries times 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)): sharper
    # attention far into long contexts.
    temperature_tuning: bool = switch(True)
    floor_scale: int = setting(8192, whole(1), WHOLE)
    attn_scale: float = setting(0.1, above(0), "above 0, e.g. 0.1")

    def rotates(self, index: int) -> bool:
        """Whether block `index` has a rotary embedding (and chunked attention); else it attends globally."""
        return (index + 1) % self.nope_every != 0

    def hf_format_differences(self) -> list[str]:
        """The settings that Llama 4's format (Llama4ForCausalLM) cannot hold, as `model.KEY=VALUE`."""
        return [
            f"model.{key}={getattr(self, key)}" for key, value in LLAMA4_ROUTING.items() if getattr(self, key) != value
        ]

    def head_norms(self, index: int) -> HeadNorms | None:
        return HeadNorms(gain=False) if self.qk_norm and self.rotates(index) else None

    def attention_span(self, index: int, seq_len: int) -> int:
        """A rotary layer's queries are scored against their chunk's keys only."""
        chunk = self.attention_chunk_size
        return min(seq_len, chunk) if chunk is not None and self.rotates(index) else seq_len

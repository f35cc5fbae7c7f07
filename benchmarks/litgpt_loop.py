"""litgpt's `GPT` shaped like one of our presets, for benchmarks.train_step only (never a runtime dependency).

`make bench` installs litgpt beside the environment, in <venv>/litgpt-reference (as transformers is for the
tests); `reference_path()` is where this looks for it. The twin has our parameter count exactly: the same
widths, grouped-query heads, RMSNorm, full-head RoPE and SwiGLU (litgpt's LLaMAMLP), no biases; litgpt fuses
the query, key and value projections into one matrix, which changes the shapes, not the count or the FLOPs.
Weights are drawn with our scheme (Normal(0, init_std), residual projections scaled by 1/sqrt(2 n_layers)):
litgpt's `GPT()` leaves torch's defaults, and the speed of a step does not depend on the values.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from project.model.config import LlamaConfig

LITGPT = "litgpt==0.5.13"


def reference_path() -> Path:
    return Path(sys.prefix) / "litgpt-reference"


def available() -> bool:
    return (reference_path() / "litgpt" / "model.py").is_file()


def litgpt_twin(config: LlamaConfig, seq_len: int):
    """A litgpt GPT with `config`'s architecture, for sequences up to `seq_len`."""
    if str(reference_path()) not in sys.path:
        sys.path.append(str(reference_path()))
    import torch
    from litgpt.config import Config
    from litgpt.model import GPT

    if config.rope_scaling is not None:
        raise ValueError("the litgpt twin is built for plain RoPE presets (rope_scaling=null)")
    twin = GPT(
        Config(
            name="project-llama",  # litgpt changes its norms for names with "Gemma" or "OLMo" in them
            block_size=seq_len,
            vocab_size=config.vocab_size,
            padded_vocab_size=config.vocab_size,
            n_layer=config.n_layers,
            n_embd=config.dim,
            n_head=config.n_heads,
            head_size=config.head_dim,
            n_query_groups=config.n_kv_heads,
            intermediate_size=config.ffn_hidden_dim,
            norm_class_name="RMSNorm",
            norm_eps=config.norm_eps,
            rotary_percentage=1.0,
            rope_base=int(config.rope_theta),
            bias=False,
            lm_head_bias=False,
            mlp_class_name="LLaMAMLP",
            parallel_residual=False,
        )
    )
    with torch.no_grad():
        for name, module in twin.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                residual = name.endswith(("attn.proj", "mlp.proj"))
                module.weight.normal_(0.0, config.init_std / (math.sqrt(2 * config.n_layers) if residual else 1.0))
    if config.tie_embeddings:  # litgpt's Config has no such field; its pretrain script ties them so
        twin.transformer.wte.weight = twin.lm_head.weight
    return twin


def twin_blocks(twin) -> list:
    return list(twin.transformer.h)

"""Tensor (and sequence) parallelism for Llama: the plan, applied to a single-device model from outside."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from project.errors import ConfigError
from project.model.llama import Llama, LlamaConfig


def check_tensor_parallel_degree(config: LlamaConfig, tp: int, sequence_parallel_seq_len: int | None = None) -> None:
    """Refuse, before any process starts, a degree that cannot split the model (or the sequence) evenly."""
    sizes = [("n_heads", config.n_heads), ("n_kv_heads", config.n_kv_heads), ("ffn hidden size", config.ffn_hidden_dim), ("vocab_size", config.vocab_size)]
    for name, value in sizes:
        if value % tp:
            raise ConfigError(
                f"model {name}={value} is not divisible by strategy.tensor_parallel_size={tp}: each tensor-parallel rank "
                f"holds an equal slice of it. Choose a tensor-parallel size that divides it."
            )
    if sequence_parallel_seq_len is not None and sequence_parallel_seq_len % tp:
        raise ConfigError(
            f"data.seq_len={sequence_parallel_seq_len} is not divisible by strategy.tensor_parallel_size={tp}: sequence "
            "parallelism splits each sequence evenly across the tensor-parallel ranks. Choose a divisible data.seq_len "
            "or set strategy.sequence_parallel=false."
        )
    if config.tie_embeddings:
        raise ConfigError("model.tie_embeddings=true is not supported with tensor parallelism yet: set model.tie_embeddings=false.")


def apply_tensor_parallel(model: Llama, mesh: DeviceMesh, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """Megatron-style plan (torchtitan's layout) on the `tensor_parallel` mesh.

    q/k/v and w1/w3 split column-wise (heads and hidden units per rank), wo and w2 row-wise, so
    each block needs one all-reduce in attention and one in the feed-forward. Embedding and output
    head split over the vocabulary. With sequence parallelism the norms and residual stream are
    split over the sequence instead of replicated, which divides their activation memory by the
    degree; the all-reduces become reduce-scatter + all-gather pairs. With `loss_parallel` the
    logits stay split over the vocabulary (a DTensor), never gathered whole on one rank: the loss
    must then be computed, and backpropagated, inside torch's `loss_parallel()` context.
    """
    check_tensor_parallel_degree(model.config, mesh.size())
    residual = Shard(1) if sequence_parallel else Replicate()  # layout of [B, T, dim] between blocks
    if loss_parallel:
        output = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    else:
        output = ColwiseParallel(input_layouts=residual, output_layouts=Replicate())
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": output,
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    }
    # A pipeline stage keeps only some of these (the embedding on the first, norm and head on the last).
    parallelize_module(model, mesh, {name: plan for name, plan in root_plan.items() if getattr(model, name) is not None})
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            plan |= {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                # gather the sequence before the projections; rotary tables and mask pass through
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
                ),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, mesh, plan)

"""Tensor (and sequence) parallelism for Llama: the plan, applied to a single-device model from outside."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from project.model.config import LlamaConfig
from project.model.llama import Llama
from project.model.spec import TensorSpec
from project.parallel.float8 import tensor_parallel_styles
from project.parallel.float8_rules import sub_layer_in_float8
from project.parallel.mesh import check_tensor_parallel_degree


def apply_tensor_parallel(
    model: Llama,
    mesh: DeviceMesh,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    float8: str | None = None,
) -> None:
    """Megatron-style plan (torchtitan's layout) on the `tensor_parallel` mesh.

    q/k/v and w1/w3 split column-wise (heads and hidden units per rank), wo and w2 row-wise, so
    each block needs one all-reduce in attention and one in the feed-forward. Embedding and output
    head split over the vocabulary. With sequence parallelism the norms and residual stream are
    split over the sequence instead of replicated, which divides their activation memory by the
    degree; the all-reduces become reduce-scatter + all-gather pairs. With `loss_parallel` the
    logits stay split over the vocabulary (a DTensor), never gathered whole on one rank: the loss
    must then be computed, and backpropagated, inside torch's `loss_parallel()` context.
    `float8`: the blocks' recipe (project.parallel.float8); with `tensorwise`, a sub-layer whose projections are all
    float8 (project.parallel.float8_rules) takes torchao's float8 styles, which cast its input once and gather it in
    float8.
    """
    check_tensor_parallel_degree(model.config, mesh.size())
    residual = Shard(1) if sequence_parallel else Replicate()  # layout of [B, T, dim] between blocks
    if loss_parallel:
        output = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    else:
        output = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": output,
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    }
    # A pipeline stage keeps only some of these (the embedding on the first, norm and head on the last).
    parallelize_module(
        model, mesh, {name: plan for name, plan in root_plan.items() if getattr(model, name) is not None}
    )
    if model.config.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # The embedding (rowwise: its rows, the vocabulary, split) and the head (colwise: its output rows, the
        # vocabulary, split) lay the matrix out alike, so the head takes the embedding's sharded parameter again:
        # each style made one of its own, and the model would otherwise train two.
        model.output.weight = model.tok_embeddings.weight
    if model.norm is not None:
        # The head runs over spans of positions (project.model.loss), so it takes the final hidden states as
        # one replicated DTensor (gathered once, with sequence parallelism) that each span is cut from locally:
        # their gradients are then reduced once, not span by span.
        whole = PrepareModuleOutput(output_layouts=residual, desired_output_layouts=Replicate(), use_local_output=False)
        parallelize_module(model.norm, mesh, whole)
    for index, block in model.layers.items():  # a pipeline stage's blocks keep their indices in the whole model
        parallelize_module(block, mesh, block_plan(model.config, int(index), sequence_parallel, float8, mesh.size()))


def block_plan(config: LlamaConfig, index: int, sequence_parallel: bool, float8: str | None, tp: int) -> dict:
    """Block `index`'s plan, from its family's tensors (project.model.spec): each sub-layer (`attention`,
    `feed_forward`) split as its tensors say (`_sub_layer`), a mixture of experts as `mixture_plan` says,
    the norms of the residual stream (the block's own gains) over the sequence with sequence parallelism, and the
    tensors applied to each head over the heads."""
    tensors = config.block_tensors(index)
    plan: dict = {}
    for sub_layer in dict.fromkeys(t.name.split(".")[0] for t in tensors):  # in the block's order
        own = [t for t in tensors if t.name.split(".")[0] == sub_layer]
        if len(own) == 1 and own[0].name == f"{sub_layer}.weight":  # a gain on the residual stream
            plan |= {sub_layer: SequenceParallel()} if sequence_parallel else {}
        elif any(t.mixture for t in own):
            plan |= mixture_plan(config, sub_layer, own, sequence_parallel, tp)
        else:
            plan |= _sub_layer(config, sub_layer, own, sequence_parallel, float8, tp)
    return plan


def _sub_layer(
    config: LlamaConfig, name: str, tensors: list[TensorSpec], sequence_parallel: bool, float8: str | None, tp: int
) -> dict:
    """A sub-layer's projections split column-wise ("rows") and then row-wise ("cols") into the residual stream; its
    tensors applied to each head ("heads") over the heads, as torch's SequenceParallel does over dim 2 (each rank
    holds some heads, [B, T, heads / tp, head_dim]), which sums their gradients over the ranks."""
    residual = Shard(1) if sequence_parallel else Replicate()
    modules = {t.name.removesuffix(".weight"): t for t in tensors}
    float8_styles = float8 == "tensorwise" and sub_layer_in_float8(config, name, tp)
    colwise, rowwise, prepare = tensor_parallel_styles(float8_styles)
    plan: dict = {}
    for module, tensor in modules.items():
        if tensor.split == "rows":
            plan[module] = colwise()
        elif tensor.split == "cols":
            plan[module] = rowwise(output_layouts=residual)
        elif tensor.split == "heads":
            plan[module] = SequenceParallel(sequence_dim=2, use_local_output=True)
    # With sequence parallelism the sequence is gathered before the projections; otherwise the input is made a
    # DTensor once for q, k and v (once for w1 and w3), not by each projection: its gradient is then all-reduced once
    # per sub-layer, not once per projection (measured: tests/test_comms.py). Attention's other inputs (rotary
    # tables, mask) pass through.
    others = (None, None, None) if name == "attention" else ()
    plan[name] = prepare(input_layouts=(residual, *others), desired_input_layouts=(Replicate(), *others))
    return plan


def mixture_plan(config: LlamaConfig, name: str, tensors: list[TensorSpec], sequence_parallel: bool, tp: int) -> dict:
    """A mixture of experts' feed-forward under tensor parallelism: every rank of the group routes every token of the
    group's sequences alike (the router whole on each), and computes its part of each expert's hidden units, its
    stacked experts split by project.parallel.expert_parallel (which the strategy applies with expert parallelism's
    split, if any) and its shared expert, a SwiGLU, split as a dense one (`_sub_layer`). Without sequence parallelism
    its input and output are the replicated residual stream already; with it, the sequence is gathered before it and
    each rank keeps its part of the output (whose gradient is gathered again in the backward)."""
    swiglus = [t for t in tensors if t.split and t.experts is None]  # the shared expert's matrices
    plan: dict = {}
    for module in dict.fromkeys(t.name.rsplit(".", 2)[0] for t in swiglus):
        own = [t for t in swiglus if t.name.startswith(f"{module}.")]
        plan |= _sub_layer(config, module, own, False, None, tp)  # its input is the mixture's: whole on every rank
    if not sequence_parallel:
        return plan
    return {
        name: PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        ),
        **plan,
    }

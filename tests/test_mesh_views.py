"""The run's one mesh of named dimensions (project.parallel.mesh.MeshShape): its coordinates, groups and views are
those torch's own device meshes give the same ranks, and every process mesh a strategy builds is one of its views."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from project.model.families.moe.config import MoEConfig
from project.parallel.mesh import DENSE, MeshShape
from project.parallel.strategies.model_parallel import LlamaParallelStrategy
from project.parallel.strategies.pipeline import LlamaPipelineStrategy

# (pipeline, data, tensor, context, expert): every dimension split, expert groups inside and across data x context.
SHAPES = [MeshShape(2, 2, 2, 2, 2), MeshShape(1, 2, 1, 2, 4), MeshShape(2, 3, 1, 1, 3), MeshShape(1, 4, 2, 1, 2)]
SHAPES += [MeshShape(2, 4, 2, data_shard=2), MeshShape(1, 2, 2, 2, data_shard=2)]  # HSDP, across context too
# The views the strategies build (LlamaParallelStrategy.set_up_meshes), a pipeline's stages outermost.
VIEWS = [
    ("pipeline", "data_parallel", "tensor"),
    ("pipeline", "data", "context", "tensor"),
    ("pipeline", "expert_data", "expert", "tensor"),
    ("pipeline", "data_replicate", "data_shard", "tensor"),
]


@pytest.fixture
def fake_rank():
    """Join torch's fake process group (collectives do nothing) as one rank of a world, left at the end."""

    def join(rank: int, world_size: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_coordinates_and_groups_are_those_of_torchs_device_mesh_on_the_same_ranks(shape, fake_rank):
    world = shape.world_size
    for rank in {0, 1, world // 2 + 1, world - 1}:
        fake_rank(rank, world)
        for names in VIEWS:
            mesh = init_device_mesh("cpu", shape.sizes(names), mesh_dim_names=names)
            for name in names:
                assert shape.coordinate(rank, name) == mesh[name].get_local_rank(), (rank, name)
                assert shape.group(rank, (name,)) == mesh[name].mesh.tolist(), (rank, name)
            inner = names[1:]  # a group along two dimensions: torch's sub-mesh of both
            assert shape.group(rank, inner[:2]) == sorted(mesh[inner[:2]].mesh.flatten().tolist()), (rank, names)
            assert shape.rank_at(**{n: shape.coordinate(rank, n) for n in names}) == rank


def test_a_view_must_cover_every_rank_in_the_meshs_order():
    shape = MeshShape(2, 2, 2, 2, 2)
    assert shape.sizes(DENSE) == (2, 2, 2, 2) and shape.sizes(("pipeline", "data_parallel", "tensor")) == (2, 4, 2)
    assert MeshShape(1, 2, 2, 2).sizes(("data_parallel", "tensor")) == (4, 2)  # a stage of one: left out
    with pytest.raises(ValueError, match="do not tile"):
        shape.sizes(("pipeline", "tensor", "data_parallel"))  # tensor is innermost
    with pytest.raises(ValueError, match="hold 8 of its 16 ranks"):
        shape.sizes(("data_parallel", "tensor"))  # the stages left out
    with pytest.raises(ValueError, match="does not divide"):
        MeshShape(1, 3, 1, 1, 2)


def test_the_strategies_meshes_are_the_shapes_views(fake_rank):
    """The process meshes a strategy sets up (Lightning's, and the groups its experts are split over) hold the ranks
    of the shape's groups: the experts' DTensors of a sharded mixture lie on `expert` (and `tensor`, where tensor
    parallelism splits each expert), FSDP2's on `expert_data`."""
    config = MoEConfig(
        dim=16, n_layers=2, n_heads=2, vocab_size=32, max_seq_len=16, n_experts=4, top_k=2, expert_ffn_dim=8
    )
    for strategy, shape in [
        (LlamaParallelStrategy(tensor_parallel_size=1, expert_parallel_size=2), MeshShape(1, 4, 1, 1, 2)),
        (
            LlamaPipelineStrategy(pipeline_parallel_size=2, data_parallel_size=2, expert_parallel_size=2),
            MeshShape(2, 2, 1, 1, 2),
        ),
        (
            LlamaParallelStrategy(tensor_parallel_size=2, context_parallel_size=2, expert_parallel_size=2),
            MeshShape(1, 2, 2, context_parallel=2, expert_parallel=2),
        ),
        (  # each stage's experts split over its expert group, each one's hidden units over its tensor group
            LlamaPipelineStrategy(
                pipeline_parallel_size=2, data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2
            ),
            MeshShape(2, 2, 2, 1, 2),
        ),
    ]:
        for rank in range(shape.world_size):
            fake_rank(rank, shape.world_size)
            strategy.set_up_meshes(shape, "cpu")
            mesh = strategy.device_mesh
            assert mesh["data_parallel"].mesh.tolist() == shape.group(rank, ("data_parallel",))
            assert mesh["tensor_parallel"].mesh.tolist() == shape.group(rank, ("tensor",))
            if shape.pipeline_parallel > 1:
                assert mesh["pipeline"].mesh.tolist() == shape.group(rank, ("pipeline",))
            if shape.context_parallel > 1:  # the ranks that split a sequence, and which replica reads it
                context = dist.get_process_group_ranks(strategy._context_group)
                assert context == shape.group(rank, ("context",))
                assert strategy.data_parallel_coords(None) == (shape.coordinate(rank, "data"), shape.data_parallel)
            model = build_meta_mixture(config)
            if isinstance(strategy, LlamaPipelineStrategy):
                strategy.n_microbatches, strategy.micro_batch_size = 2, 1
            strategy.shard(model)
            experts = [p for n, p in model.named_parameters() if ".experts." in n]
            assert experts, "no mixture kept on this rank"
            # Sharded by FSDP2 over expert_data, split by expert parallelism over expert, each expert's hidden units
            # over the tensor-parallel ranks.
            split = [("expert_data",), ("expert",), *([("tensor",)] if shape.tensor_parallel > 1 else [])]
            for weight in experts:
                groups = [weight.device_mesh[n].mesh.tolist() for n in weight.device_mesh.mesh_dim_names]
                assert groups == [shape.group(rank, names) for names in split], rank


def build_meta_mixture(config: MoEConfig):
    import torch

    from project.model.families import build_model

    with torch.device("meta"):
        return build_model(config)


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_hsdp_replicates_each_weights_shards_across_groups_of_neighbouring_ranks(fake_rank, tensor_parallel):
    """strategy.data_parallel_shard_size=2 on 4 data-parallel ranks: each weight is split within pairs of
    neighbouring data-parallel ranks (the shape's `data_shard` groups) and the pairs hold the same shards
    (`data_replicate`), where plain FSDP2 splits it over all four."""
    from lightning.fabric.plugins.precision import Precision
    from torch.distributed.tensor import Replicate

    from project.model.config import LlamaConfig
    from project.model.llama import Llama

    config = LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=32, max_seq_len=16)
    shape = MeshShape(1, 4, tensor_parallel, data_shard=2)
    assert shape.describe().endswith("(HSDP: data_replicate 2 x data_shard 2)")
    for rank in range(shape.world_size):
        fake_rank(rank, shape.world_size)
        strategy = LlamaParallelStrategy(tensor_parallel_size=tensor_parallel, data_parallel_shard_size=2)
        strategy.precision_plugin = Precision()
        strategy.set_up_meshes(shape, "cpu")
        with torch.device("meta"):
            model = Llama(config)
        strategy.shard(model)
        for name, weight in model.named_parameters():
            mesh = weight.device_mesh
            assert mesh.mesh_dim_names[:2] == ("data_replicate", "data_shard"), name
            replicated, split = weight.placements[:2]  # a tensor-parallel row split nests FSDP2's in its own (strided)
            assert replicated == Replicate() and not (split.is_replicate() or split.is_partial()), name
            assert mesh["data_shard"].mesh.tolist() == shape.group(rank, ("data_shard",)), (rank, name)
            assert mesh["data_replicate"].mesh.tolist() == shape.group(rank, ("data_replicate",)), (rank, name)
    tp = tensor_parallel  # neighbouring data-parallel ranks shard together: a node's, where one holds 2 x tp GPUs
    assert shape.group(0, ("data_shard",)) == [0, tp] and shape.group(0, ("data_replicate",)) == [0, 2 * tp]


# Shapes no other test here uses, on one rank each: torch caches sliced meshes by value, and a fake process group made
# again leaves a cached mesh of the same shape pointing at the groups of the one before.
@pytest.mark.parametrize(
    "settings, shape, over",
    [
        ({"tensor_parallel_size": 2}, MeshShape(1, 3, 2), "tensor"),  # norms left whole by tensor parallelism
        ({"tensor_parallel_size": 2, "sequence_parallel": True}, MeshShape(1, 1, 2), "tensor"),  # Replicate there
        (
            {"tensor_parallel_size": 1, "data_parallel_shard_size": 3},
            MeshShape(1, 6, 1, data_shard=3),
            "data_replicate",
        ),
        ({"tensor_parallel_size": 1}, MeshShape(1, 5, 1), None),  # FSDP2 alone: every part on one rank
    ],
    ids=["tp", "tp-sequence-parallel", "hsdp", "fsdp2"],
)
def test_the_copies_a_strategy_lists_are_those_its_layout_repeats(fake_rank, settings, shape, over):
    """The parts of parameters that ReplicaCheck compares, and over which ranks: the shape's groups."""
    from lightning.fabric.plugins.precision import Precision

    from project.model.config import LlamaConfig
    from project.model.llama import Llama

    config = LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=32, max_seq_len=16)
    rank = shape.world_size - 1  # one rank: the same shape again would meet torch's cached mesh (above)
    fake_rank(rank, shape.world_size)
    strategy = LlamaParallelStrategy(**settings)
    strategy.precision_plugin = Precision()
    strategy.set_up_meshes(shape, "cpu")
    with torch.device("meta"):
        model = Llama(config)
    strategy.shard(model)
    listed = {r.name: dist.get_process_group_ranks(r.group) for r in strategy.replicas(model)}
    if over is None:
        assert listed == {}
    elif over == "tensor":
        norms = [n for n, _ in model.named_parameters() if n.endswith("norm.weight")]
        assert listed == {name: shape.group(rank, ("tensor",)) for name in norms}, rank
    else:
        everything = [n for n, _ in model.named_parameters()]
        assert listed == {name: shape.group(rank, (over,)) for name in everything}, rank


@pytest.mark.parametrize(
    "shape, per_node, said",
    [
        (MeshShape(1, 64, 8), 8, "groups: tensor 8 (in 1 node), data 64 (across 64 nodes)"),
        (
            MeshShape(1, 512, 1, data_shard=8),
            8,
            "groups: data_shard 8 (in 1 node), data_replicate 64 (across 64 nodes)",
        ),
        # Expert groups are strided by the tensor-parallel degree: with 8-way tensor parallelism, across nodes.
        (
            MeshShape(1, 16, 8, expert_parallel=4),
            8,
            "groups: tensor 8 (in 1 node), data 16 (across 16 nodes), expert 4 (across 4 nodes), "
            "expert_data 4 (across 4 nodes)",
        ),
        # Shard groups of 3 on nodes of 4: the second, ranks 3 to 5, straddles two nodes.
        (
            MeshShape(1, 12, 1, data_shard=3),
            4,
            "groups: data_shard 3 (across 2 nodes), data_replicate 4 (across 3 nodes)",
        ),
        (
            MeshShape(2, 2, 2, 2),
            4,
            "groups: tensor 2 (in 1 node), context 2 (in 1 node), data x context 4 (across 2 "
            "nodes), pipeline 2 (across 2 nodes)",
        ),  # fmt: skip
    ],
)
def test_the_groups_that_cross_nodes_are_named_with_the_nodes_they_span(shape, per_node, said):
    from project.planning.placement import placement_line

    assert placement_line(shape, per_node) == said

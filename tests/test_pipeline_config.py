"""Pipeline layouts: how the model is cut and placed, and the settings refused before any process starts."""

import copy

import pytest
import torch
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from project.model.config import LlamaConfig
from project.model.llama import Llama
from project.parallel import MeshShape, mesh_shape, plan_pipeline_batches
from project.parallel.pipeline import SCHEDULES, split_into_stages
from project.parallel.pipeline_layout import (
    SCHEDULE_NAMES,
    SINGLE_STAGE,
    check_pipeline,
    chunk_ranks,
    stage_layer_counts,
)
from project.runtime.errors import ConfigError

CONFIG = LlamaConfig(vocab_size=96, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, multiple_of=32)


def test_the_settings_checks_know_torchs_schedules_as_they_are():
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    assert list(SCHEDULES) == list(SCHEDULE_NAMES)
    assert {name for name, cls in SCHEDULES.items() if issubclass(cls, PipelineScheduleSingle)} == SINGLE_STAGE


def test_layers_split_evenly_with_leftovers_in_the_middle_chunks_first():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(10, 4) == [2, 3, 3, 2]  # the middle chunks have neither embedding nor head
    assert stage_layer_counts(11, 4) == [3, 3, 3, 2]  # then the first; the last (output head) gets the fewest
    assert stage_layer_counts(5, 2) == [3, 2]
    assert stage_layer_counts(5, 2, [1, 4]) == [1, 4]


@pytest.mark.parametrize("schedule, style", [("1f1b", "loop"), ("interleaved_1f1b", "loop"), ("zbv", "v")])
def test_chunks_are_placed_where_torch_schedules_expect_them(schedule, style):
    for pp, chunks in ((2, 4), (4, 8), (3, 6)):
        assert chunk_ranks(schedule, pp, chunks) == [
            generate_stage_to_rank_mapping(pp, chunks, style)[s] for s in range(chunks)
        ]


def test_each_rank_keeps_only_its_chunks_under_the_plain_models_names():
    model = Llama(CONFIG)
    names = dict(model.named_parameters())
    chunks = split_into_stages(model, pipeline_rank=1, pipeline_parallel_size=2, schedule="zbv", virtual_stages=2)
    # V placement over 4 chunks of 2 layers: rank 1 runs chunks 1 and 2, i.e. layers 2-5, no embedding or head.
    assert sorted(chunks) == [1, 2]
    assert list(model.layers) == ["2", "3", "4", "5"] and list(chunks[2].layers) == ["4", "5"]
    assert model.tok_embeddings is None and model.output is None and model.norm is None
    kept = dict(model.named_parameters())
    assert kept and all(kept[name] is names[name] for name in kept)  # the same parameters under the same names

    first_and_last = split_into_stages(
        Llama(CONFIG), pipeline_rank=0, pipeline_parallel_size=2, schedule="zbv", virtual_stages=2
    )
    assert sorted(first_and_last) == [0, 3]
    assert first_and_last[0].tok_embeddings is not None and first_and_last[3].output is not None


def test_the_chain_of_stage_chunks_and_the_head_compute_the_models_logits():
    torch.manual_seed(0)
    model = Llama(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 12))
    chunks = {}
    for rank in range(2):
        chunks |= split_into_stages(copy.deepcopy(model), rank, 2, "interleaved_1f1b", 2)
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])  # packed documents, masked apart
    for kwargs in ({}, {"document_ids": documents}):
        h = tokens
        for stage in range(4):
            h = chunks[stage](h, seq_len=tokens.shape[1], **kwargs)
        # The last chunk ends with the final norm: the head and loss are applied to it (Llama.head_loss).
        torch.testing.assert_close(chunks[3].output(h), model(tokens, **kwargs))


def test_pipeline_degree_fills_the_mesh_with_tensor_parallelism_innermost():
    assert mesh_shape(
        {"pipeline_parallel_size": "auto", "data_parallel_size": 1, "tensor_parallel_size": 1}, 4, 4
    ) == MeshShape(4, 1, 1)
    assert mesh_shape(
        {"pipeline_parallel_size": "auto", "data_parallel_size": 2, "tensor_parallel_size": 2}, 8, 8
    ) == MeshShape(2, 2, 2)
    assert mesh_shape(
        {"pipeline_parallel_size": 2, "data_parallel_size": "auto", "tensor_parallel_size": 2}, 16, 8
    ) == MeshShape(2, 4, 2)
    assert mesh_shape(
        {"pipeline_parallel_size": 4, "data_parallel_size": 1, "tensor_parallel_size": "auto"}, 8, 8
    ) == MeshShape(4, 1, 2)


@pytest.mark.parametrize(
    "strategy, message",
    [
        (
            {"pipeline_parallel_size": 3, "data_parallel_size": 1},
            "pipeline_parallel_size=3 does not divide the 8 devices",
        ),
        (
            {"pipeline_parallel_size": 2, "data_parallel_size": 2, "tensor_parallel_size": 1},
            "pipeline_parallel_size=2 x data_parallel_size=2 x tensor_parallel_size=1 must equal the 8 devices",
        ),
    ],
)
def test_pipeline_degrees_that_do_not_multiply_to_the_world_are_refused(strategy, message):
    with pytest.raises(ConfigError, match=message):
        mesh_shape(strategy, world_size=8, devices_per_node=8)


def test_microbatches_follow_from_the_micro_batch_or_their_count():
    assert plan_pipeline_batches(16, 2).micro_batch_size == 1  # torchtitan's default: one sequence each
    plan = plan_pipeline_batches(16, 2, micro_batch_size=2)
    assert (plan.pipeline_microbatches, plan.loader_batch_size, plan.accumulate_grad_batches) == (4, 8, 1)
    assert plan_pipeline_batches(16, 1, n_microbatches=4).micro_batch_size == 4


def test_a_batch_that_does_not_split_into_the_microbatches_is_refused():
    with pytest.raises(ConfigError, match="n_microbatches=3 microbatches of micro_batch_size=2"):
        plan_pipeline_batches(8, 1, n_microbatches=3)
    with pytest.raises(ConfigError, match="choose values whose product is 8"):
        plan_pipeline_batches(16, 2, micro_batch_size=2, n_microbatches=2)


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            dict(schedule="looped_bfs", pipeline_parallel_size=4, virtual_stages=2),
            "model.n_layers=4 is fewer than the 8 pipeline stage chunks",
        ),
        (dict(schedule="1f1b", n_microbatches=2), "needs at least 4 microbatches per step"),
        (dict(schedule="gpipe", virtual_stages=2), "runs one stage chunk per rank"),
        (dict(schedule="zbv", virtual_stages=1), "needs exactly 2 stage chunks per rank"),
        (dict(schedule="interleaved_1f1b", virtual_stages=1, n_microbatches=9), "not a whole number of rounds"),
        (dict(schedule="dualpipe"), "choose one of"),
        (dict(stage_layers=[1, 1, 1, 2]), "must give at least one layer to each of the 4 stage chunks"),
        (dict(schedule="zbv", virtual_stages=2, pipeline_parallel_size=2, compile=True), "torch.compile"),
    ],
)
def test_pipeline_settings_that_cannot_run_are_refused(settings, message):
    args = dict(schedule="1f1b", virtual_stages=1, n_microbatches=8) | settings
    shape = MeshShape(args.pop("pipeline_parallel_size", 4), 1, 1)
    with pytest.raises(ConfigError, match=message):
        check_pipeline(LlamaConfig(**{**vars(CONFIG), "n_layers": 4}), shape=shape, **args)


def test_pipeline_refuses_tied_embeddings():
    with pytest.raises(ConfigError, match="tie_embeddings"):
        check_pipeline(LlamaConfig(**{**vars(CONFIG), "tie_embeddings": True}), "1f1b", MeshShape(2, 1, 1), 1, 4)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv"])
def test_zero_bubble_schedules_refuse_sharded_stages(schedule):
    config = LlamaConfig(**{**vars(CONFIG), "n_layers": 4})
    settings = "strategy.data_parallel_size=1, strategy.context_parallel_size=1, strategy.tensor_parallel_size=1"
    with pytest.raises(ConfigError, match=settings):
        check_pipeline(config, schedule, MeshShape(2, 2, 1), 2, 4)
    with pytest.raises(ConfigError, match=settings):  # FSDP2 over the context ranks: each would step alone without it
        check_pipeline(config, schedule, MeshShape(2, 1, 1, 2), 2, 4)
    with pytest.raises(ConfigError, match="cannot run with tensor parallelism"):
        check_pipeline(config, schedule, MeshShape(2, 1, 2), 2, 4)
    with pytest.raises(ConfigError, match="wrong for FSDP2-sharded stages"):
        check_pipeline(config, schedule, MeshShape(2, 1, 1), 2, 4, param_dtype="bfloat16")
    check_pipeline(config, schedule, MeshShape(2, 1, 1), 2, 4)

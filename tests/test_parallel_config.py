"""Layout settings that cannot work are refused before any process starts."""

import pytest

from project.model.config import LlamaConfig
from project.parallel import mesh_shape
from project.parallel.mesh import check_tensor_parallel_degree
from project.runtime.errors import ConfigError


def llama(**overrides):
    fields = dict(vocab_size=96, dim=64, n_layers=1, n_heads=8, n_kv_heads=4, multiple_of=32)
    return LlamaConfig(**{**fields, **overrides})


@pytest.mark.parametrize(
    "overrides, setting",
    [
        (dict(n_kv_heads=2), "n_kv_heads=2"),
        (dict(n_heads=6, n_kv_heads=6, dim=48), "n_heads=6"),
        (dict(vocab_size=90), "vocab_size=90"),
    ],
)
def test_tensor_parallel_degree_must_divide_heads_and_widths(overrides, setting):
    with pytest.raises(ConfigError, match=f"{setting} is not divisible by strategy.tensor_parallel_size=4"):
        check_tensor_parallel_degree(llama(**overrides), 4)
    check_tensor_parallel_degree(llama(**overrides), 2)  # a divisor is fine


def test_sequence_parallel_needs_a_sequence_length_the_degree_divides():
    with pytest.raises(ConfigError, match="data.seq_len=30 is not divisible by strategy.tensor_parallel_size=4"):
        check_tensor_parallel_degree(llama(), 4, sequence_parallel_seq_len=30)
    check_tensor_parallel_degree(llama(), 4, sequence_parallel_seq_len=32)


def test_data_parallel_size_fills_the_mesh():
    assert mesh_shape({"_target_": "ddp"}, world_size=8, devices_per_node=8).data_parallel == 8
    assert mesh_shape({"data_parallel_size": "auto", "tensor_parallel_size": 2}, 8, 8).data_parallel == 4
    assert mesh_shape({"data_parallel_size": 1, "tensor_parallel_size": "auto"}, 8, 8).data_parallel == 1
    assert mesh_shape({"data_parallel_size": "auto", "tensor_parallel_size": "auto"}, 16, 8).data_parallel == 2


@pytest.mark.parametrize(
    "strategy, message",
    [
        (
            {"data_parallel_size": "auto", "tensor_parallel_size": 3},
            "tensor_parallel_size=3 does not divide the 8 devices",
        ),
        (
            {"data_parallel_size": 2, "tensor_parallel_size": 2},
            "data_parallel_size=2 x tensor_parallel_size=2 must equal the 8 devices",
        ),
    ],
)
def test_mesh_that_does_not_match_the_devices_is_a_clear_error(strategy, message):
    with pytest.raises(ConfigError, match=message):
        mesh_shape(strategy, world_size=8, devices_per_node=8)


@pytest.mark.parametrize("factory", ["single", "ddp"])
def test_compile_setting_compiles_every_block_where_the_model_stays_whole(factory):
    import torch

    from project.model.llama import Llama
    from project.parallel.strategies.ddp import ddp_strategy
    from project.parallel.strategies.single import single_device_strategy

    make = {"single": single_device_strategy, "ddp": ddp_strategy}[factory]
    assert not make().model_on_meta  # eager: the model is built and wrapped as Lightning does
    strategy = make(compile=True)
    strategy.parallel_devices = [torch.device("cpu")]  # what Lightning's connector sets
    config = llama(n_layers=2, tie_embeddings=True)
    torch.manual_seed(0)
    eager = Llama(config)
    torch.manual_seed(0)
    with torch.device("meta"):  # a strategy with model_on_meta gets its model built on meta
        model = Llama(config)
    strategy.parallelize(model)
    assert all(block._compiled_call_impl is not None for block in model.layers.values())
    assert model.output.weight is model.tok_embeddings.weight  # still tied once given memory
    assert model.state_dict().keys() == eager.state_dict().keys()  # checkpoints keep their names
    for name, value in eager.state_dict().items():  # and the run starts from the eager run's weights
        assert torch.equal(model.state_dict()[name], value), name


def test_single_device_runs_on_the_device_the_trainer_names_and_counts_one():
    import torch

    from project.parallel.strategies.single import single_device_strategy

    for compile in (False, True):
        strategy = single_device_strategy(compile=compile)
        strategy.parallel_devices = [torch.device("cuda", 1), torch.device("cuda", 2)]  # trainer.devices=[1, 2]
        assert strategy.root_device == torch.device("cuda", 1)
        assert strategy.parallel_devices == [torch.device("cuda", 1)]  # so the entry point refuses 2 devices


@pytest.mark.parametrize(
    "precision, param_dtype, gathered",
    [
        ("bf16-mixed", None, "bfloat16"),  # trainer=gpu: half the bytes of float32 gathers
        ("bf16-mixed", "float32", "float32"),  # an explicit setting wins
        ("32-true", None, None),
        ("32-true", "bfloat16", "bfloat16"),
        ("bf16-true", None, None),  # the parameters are bfloat16 already
    ],
)
def test_fsdp2_gathers_in_the_trainers_mixed_precision_unless_set(precision, param_dtype, gathered):
    from lightning.pytorch.plugins import HalfPrecision, MixedPrecision, Precision

    from project.parallel.strategies.model_parallel import LlamaParallelStrategy
    from project.parallel.strategies.pipeline import LlamaPipelineStrategy

    plugin = {"bf16-mixed": MixedPrecision("bf16-mixed", "cpu"), "bf16-true": HalfPrecision("bf16-true")}
    for strategy in (LlamaParallelStrategy(param_dtype=param_dtype), LlamaPipelineStrategy(param_dtype=param_dtype)):
        strategy.precision_plugin = plugin.get(precision, Precision())
        assert strategy.gather_dtype() == gathered

"""Every experiment and preset composes into a config the code accepts."""

import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from project.config.optim import OptimConfig
from project.model.config import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
STRATEGIES = sorted(p.stem for p in (CONF / "strategy").glob("*.yaml"))


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_resolves(experiment):
    cfg = compose_train(f"experiment={experiment}")
    plain = OmegaConf.to_container(cfg, resolve=True)
    LlamaConfig(**plain["model"])
    OptimConfig(**plain["optim"])
    assert plain["trainer"]["max_steps"] > 0
    assert plain["data"]["seq_len"] <= plain["model"]["max_seq_len"]


def test_experiment_values_override_the_defaults():
    cfg = compose_train("experiment=debug")
    assert cfg.global_batch_size == 8 and cfg.trainer.max_steps == 30 and cfg.model.dim == 64


@pytest.mark.parametrize("model", MODELS)
def test_every_model_preset_is_a_valid_config_of_its_family(model):
    from project.model.families import FAMILIES, model_config

    fields = OmegaConf.to_container(compose_train(f"model={model}").model, resolve=True)
    assert type(model_config(fields)) is FAMILIES[fields["family"]].config


def test_strategy_configs_build_the_strategy_they_name():
    from hydra.utils import instantiate

    from project.parallel.strategies.ddp import GlooFriendlyDDPStrategy
    from project.parallel.strategies.model_parallel import LlamaParallelStrategy

    # A new strategy config gets a line here (horovod: built by tests/test_horovod.py, which needs Horovod installed).
    assert STRATEGIES == ["ddp", "fsdp", "fsdp2", "horovod", "pipeline", "single", "tp", "tp_fsdp"]
    from project.parallel.strategies.single import TrainerDeviceStrategy, TransformedSingleDeviceStrategy
    from project.parallel.whole_model import WholeModelTransforms

    assert type(instantiate(compose_train("strategy=single").strategy)) is TrainerDeviceStrategy
    for name in ("single", "ddp", "fsdp"):  # strategy.compile=true reaches the strategy of every group
        compiled = instantiate(compose_train(f"strategy={name}", "strategy.compile=true").strategy)
        assert compiled.compile and (name == "fsdp" or isinstance(compiled, WholeModelTransforms))
    for name in ("single", "ddp", "fsdp2", "tp", "tp_fsdp", "pipeline"):  # so does strategy.float8
        assert instantiate(compose_train(f"strategy={name}", "strategy.float8=rowwise").strategy).float8 == "rowwise"
    assert isinstance(instantiate(compose_train("strategy.compile=true").strategy), TransformedSingleDeviceStrategy)
    assert instantiate(compose_train("strategy=fsdp", "strategy.compile=true").strategy).compile
    # strategy=fsdp's names, each what FSDP2 does for it: (sharding_strategy, hybrid_shard_size) -> (shard group,
    # parameters kept gathered from forward to backward).
    mapped = {
        ("FULL_SHARD", None): (None, False),
        ("SHARD_GRAD_OP", None): (None, True),
        ("HYBRID_SHARD", None): ("node", False),
        ("HYBRID_SHARD", 4): (4, False),
        ("NO_SHARD", None): (1, False),
    }
    for (sharding, size), (shard, kept) in mapped.items():
        asked = [f"strategy.sharding_strategy={sharding}", f"strategy.hybrid_shard_size={size or 'null'}"]
        fsdp = instantiate(compose_train("strategy=fsdp", *asked).strategy)
        assert isinstance(fsdp, LlamaParallelStrategy), sharding
        assert fsdp.asked_degrees()["data_parallel_shard_size"] == shard and fsdp.reshard_after_forward is not kept
    for name, dp, tp in (("fsdp2", "auto", 1), ("tp", 1, "auto"), ("tp_fsdp", "auto", 2)):
        strategy = instantiate(compose_train(f"strategy={name}").strategy)
        assert isinstance(strategy, LlamaParallelStrategy)
        asked = strategy.asked_degrees()
        assert (asked["data_parallel_size"], asked["tensor_parallel_size"]) == (dp, tp)
    from project.parallel.strategies.pipeline import LlamaPipelineStrategy

    pipeline = instantiate(compose_train("strategy=pipeline", "strategy.schedule=zbv").strategy)
    assert isinstance(pipeline, LlamaPipelineStrategy) and isinstance(pipeline, LlamaParallelStrategy)
    asked = pipeline.asked_degrees()
    degrees = ("pipeline_parallel_size", "data_parallel_size", "tensor_parallel_size")
    assert [asked[name] for name in degrees] == ["auto", 1, 1]
    assert (pipeline.schedule, pipeline.virtual_stages) == ("zbv", 2)  # the V schedule's default: two chunks per rank
    ddp = instantiate(compose_train("strategy=ddp").strategy)
    assert isinstance(ddp, GlooFriendlyDDPStrategy) and ddp.comm_hook is None
    summed = instantiate(compose_train("strategy=ddp", "strategy.grad_reduction=sum").strategy)
    assert summed._ddp_comm_hook is not None


def test_prepare_composes_the_same_data_group_as_training():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        prepare = compose(config_name="prepare", overrides=["experiment=debug"])
    train = compose_train("experiment=debug")
    assert OmegaConf.to_container(prepare.data, resolve=True) == OmegaConf.to_container(train.data, resolve=True)


def test_every_strategy_of_ours_speaks_the_contract_and_nothing_probes_for_another():
    from hydra.utils import instantiate

    from project.parallel.contract import LlamaStrategy

    for name in STRATEGIES:
        if name != "horovod":  # built by tests/test_horovod.py, which needs Horovod installed
            strategy = instantiate(compose_train(f"strategy={name}", "trainer.devices=2").strategy)
            assert isinstance(strategy, LlamaStrategy), name
    # The module and the run call the contract: no strategy found by attribute, by module table or by class name.
    probes = re.compile(
        r"(hasattr|getattr)\([^)]*strategy|sys\.modules\.get|(in |[!=]= *)type\([^)]*strateg[^)]*\)\.__name__"
        r"|type\([^)]*strateg[^)]*\)\.__name__ *[!=]="
    )
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "project").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if probes.search(line)
    ]
    assert found == []


def test_lightnings_fsdp_names_lay_out_the_mesh_fsdp2_builds_from_them():
    """The settings check reads strategy=fsdp's names as the strategy does: HYBRID_SHARD shards within a node (4
    devices each) or hybrid_shard_size ranks, NO_SHARD within groups of one; a size that does not divide is said
    by the name the user gave it."""
    from project.config.layout import plan_layout
    from project.runtime.errors import ConfigError

    def shard_groups(*overrides: str) -> int | None:
        cfg = compose_train("strategy=fsdp", "trainer.devices=4", "trainer.num_nodes=2", *overrides)
        return plan_layout(cfg, num_nodes=2, devices_per_node=4).shape.data_shard

    assert shard_groups() is None  # FULL_SHARD: over all 8
    assert shard_groups("strategy.sharding_strategy=HYBRID_SHARD") == 4
    assert shard_groups("strategy.sharding_strategy=HYBRID_SHARD", "strategy.hybrid_shard_size=2") == 2
    assert shard_groups("strategy.sharding_strategy=NO_SHARD") == 1
    with pytest.raises(ConfigError, match=r"strategy.hybrid_shard_size=3 does not divide the 8 data x context ranks"):
        shard_groups("strategy.sharding_strategy=HYBRID_SHARD", "strategy.hybrid_shard_size=3")


def test_offloaded_states_get_a_cpu_backend_beside_the_gpus_and_a_pipeline_stage_refuses_what_it_decides():
    """cpu_offload's gradients are host tensors, whose norm's collectives need gloo beside NCCL (added to a backend
    the user named); a pipeline stage keeps its gathered parameters, writes folders and keeps them on the device."""
    from project.parallel.strategies.fsdp import fsdp_strategy
    from project.parallel.strategies.model_parallel import with_cpu_backend
    from project.parallel.strategies.pipeline import LlamaPipelineStrategy
    from project.runtime.errors import ConfigError

    assert fsdp_strategy(cpu_offload=True).process_group_backend == "cuda:nccl,cpu:gloo"
    assert fsdp_strategy().process_group_backend is None  # Lightning's own choice: gloo on CPU, nccl on GPU
    assert with_cpu_backend("nccl") == "cuda:nccl,cpu:gloo"
    assert with_cpu_backend("cuda:nccl,cpu:gloo") == "cuda:nccl,cpu:gloo"
    for setting, value in (("state_dict_type", "full"), ("cpu_offload", True), ("reshard_after_forward", True)):
        with pytest.raises(ConfigError, match=f"strategy.{setting}={value}: a pipeline stage does not take it"):
            LlamaPipelineStrategy(**{setting: value})


def test_the_settings_check_knows_each_strategy_as_its_built_class_does():
    """The torch-free kinds (project.parallel.kinds) answer as the strategies' classes do, once built."""
    from hydra.utils import instantiate
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from project.parallel.kinds import strategy_kind
    from project.parallel.strategies.horovod import horovod_strategy
    from project.parallel.strategies.pipeline import LlamaPipelineStrategy

    for name in STRATEGIES:
        node = compose_train(f"strategy={name}", "trainer.devices=2").strategy
        kind = strategy_kind(node)
        if name == "horovod":  # built by tests/test_horovod.py, which needs Horovod installed
            assert node._target_ == f"{horovod_strategy.__module__}.{horovod_strategy.__name__}"
            assert kind.own_launcher and not kind.pipeline  # its strategy brings horovodrun's environment
            continue
        strategy = instantiate(node)
        assert kind.pipeline == isinstance(strategy, LlamaPipelineStrategy), name
        assert kind.single_device == isinstance(strategy, SingleDeviceStrategy), name
        assert not kind.own_launcher and getattr(strategy, "cluster_environment", None) is None, name
        assert (kind.as_fsdp2 is not None) == (name == "fsdp"), name  # Lightning's names for FSDP2's settings
    assert {n for n in STRATEGIES if strategy_kind(compose_train(f"strategy={n}").strategy).pipeline} == {"pipeline"}


def test_the_module_builds_the_optimizer_the_config_names():
    from hydra.utils import instantiate

    cfg = compose_train("experiment=debug", "optim.lr=0.02", "optim.decay_steps=10")
    optimizer = instantiate(cfg.module, _convert_="all").configure_optimizers()["optimizer"]
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["lr"] == 0.02
    assert [g["weight_decay"] for g in optimizer.param_groups] == [cfg.optim.weight_decay, 0.0]
    swapped = compose_train(
        "experiment=debug",
        "optim.decay_steps=10",
        "module.optimizer._target_=torch.optim.SGD",
        "~module.optimizer.betas",
        "~module.optimizer.eps",
    )
    assert type(instantiate(swapped.module, _convert_="all").configure_optimizers()["optimizer"]) is torch.optim.SGD


def test_the_settings_dataclasses_refuse_what_the_settings_check_refuses_with_the_same_words():
    """One rule per field (project.runtime.settings): built from Python or checked from the command line alike."""
    from project.config.optim import OptimConfig
    from project.config.values import check_values
    from project.runtime.errors import ConfigError

    for cls, prefix, bad in [(LlamaConfig, "model", {"n_layers": 0}), (OptimConfig, "optim", {"eps": 0.0})]:
        (name, value), *_ = bad.items()
        with pytest.raises(ValueError) as built:
            cls(**bad)
        with pytest.raises(ConfigError) as checked:
            check_values(compose_train("experiment=debug", f"{prefix}.{name}={value}"))
        assert (
            str(built.value)
            == str(checked.value)
            == f"{prefix}.{name}={value} is out of range: "
            + ("it must be a whole number above 0." if prefix == "model" else "it must be above 0, e.g. 1e-8.")
        )
    with pytest.raises(ValueError, match="optim.min_lr=0.1 is above optim.lr=0.01"):
        OptimConfig(lr=0.01, min_lr=0.1)


@pytest.mark.filterwarnings("ignore:The `srun` command is available")  # on a machine with SLURM installed
def test_the_ready_callbacks_add_to_the_default_ones_alone_or_several_in_any_order(tmp_path):
    """`callbacks=NAME` keeps every default callback; a progress bar among them, ready or added by name, replaces
    the default's (Lightning takes one)."""
    from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ProgressBar, TQDMProgressBar

    from project.config.layout import plan_layout
    from project.training.callbacks import LlamaModelSummary, StepProgressBar, StepRichProgressBar
    from project.training.trainer import build_callbacks

    default = list(compose_train().callbacks)
    ready = ["early_stopping", "lr_monitor", "rich_progress", "layer_summary"]
    cases = {
        "callbacks=early_stopping": (EarlyStopping, StepProgressBar, 1),
        f"callbacks=[{','.join(ready)}]": (LearningRateMonitor, StepRichProgressBar, 2),
        f"callbacks=[{','.join(reversed(ready))},default]": (EarlyStopping, StepRichProgressBar, 2),
        "+callbacks.bar._target_=lightning.pytorch.callbacks.TQDMProgressBar": (TQDMProgressBar, TQDMProgressBar, 1),
    }
    for override, (added, bar_class, depth) in cases.items():
        cfg = compose_train(override, f"paths.run_dir={tmp_path}")
        assert set(default) <= set(cfg.callbacks), override
        callbacks = build_callbacks(cfg, plan_layout(cfg, 1, 1))
        [bar] = [c for c in callbacks if isinstance(c, ProgressBar)]
        [summary] = [c for c in callbacks if isinstance(c, LlamaModelSummary)]
        assert any(isinstance(c, added) for c in callbacks) and type(bar) is bar_class, override
        assert summary.max_depth == depth, override
    early = compose_train("callbacks=early_stopping").callbacks.early_stopping
    assert (early.monitor, early.mode, early.check_on_train_epoch_end) == ("val/loss", "min", False)


def test_the_rich_progress_bar_without_rich_installed_is_one_clear_error(monkeypatch):
    import importlib.util

    from project.runtime.errors import ConfigError
    from project.training.callbacks import StepRichProgressBar

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ConfigError, match=r"callbacks=rich_progress draws its bar with the rich package, which is not"):
        StepRichProgressBar()


def test_a_strategy_not_of_ours_runs_only_where_it_keeps_the_whole_model_on_every_rank():
    """Lightning's single-device and DDP strategies take the contract's whole-model defaults; a strategy that may
    shard the model (Lightning's FSDP, DeepSpeed, ModelParallel, or a user's own of unknown kind) is refused, and
    a user's own that inherits LlamaStrategy is its own contract."""
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        ParallelStrategy,
        SingleDeviceStrategy,
    )

    from project.parallel.contract import LIGHTNING_DEFAULTS, LlamaStrategy, contract_of
    from project.runtime.errors import ConfigError

    class OwnWholeModel(LlamaStrategy, DDPStrategy):
        pass

    class OwnOfUnknownKind(ParallelStrategy):  # Lightning's abstract methods, as a user's own would define them
        root_device = property(lambda self: None)
        barrier = broadcast = reduce = model_to_device = lambda self, *args, **kwargs: None

    assert contract_of(SingleDeviceStrategy("cpu")) is LIGHTNING_DEFAULTS
    assert contract_of(DDPStrategy()) is LIGHTNING_DEFAULTS
    own = OwnWholeModel()
    assert contract_of(own) is own
    deepspeed = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # its __init__ needs deepspeed installed
    for strategy in (FSDPStrategy(), ModelParallelStrategy(), deepspeed, OwnOfUnknownKind()):
        with pytest.raises(ConfigError, match=r"is not one of this platform's strategies.*inherit .*LlamaStrategy"):
            contract_of(strategy)

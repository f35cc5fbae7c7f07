"""Every bad setting is one clear error that names it, before anything starts (issue: reliability).

The table runs the checks `python -m project.train` makes before it imports torch: the command line as
Hydra will compose it (project.config.command_line.check_command_line), then the values
(project.config.checks.preflight).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from project.config.checks import preflight
from project.config.command_line import CONF, check_command_line
from project.runtime.errors import ConfigError, exit_on_config_error
from tests.conftest import ROOT

COMMAND_LINE = [
    (
        ["experiment=shakespere"],
        r"experiment=shakespere: there is no conf/experiment/shakespere.yaml. Did you mean shakespeare\?",
    ),
    (["model=small3m"], r"model=small3m: there is no conf/model/small3m.yaml"),
    # Names near in size and family, not in spelling alone (llama3_70b is ten times larger; h200 another GPU).
    (["model=llama3_7b"], r"model=llama3_7b: .* Did you mean llama3_8b or llama2_7b\?"),
    (["cluster=h100"], r"cluster=h100: .* Did you mean h100_80gb\?"),
    (["data=shakespear"], r"data=shakespear: .* Did you mean shakespeare\?"),
    (["strategy=fsdp3"], r"strategy=fsdp3: .* Did you mean fsdp"),
    (["logger=wandbb"], r"logger=wandbb: .* Did you mean wandb\?"),
    (["trainer=gpx"], r"trainer=gpx: .* Choose one of: cpu, gpu"),
    (["trainer.max_step=10"], r"trainer.max_step: no such setting in trainer. Did you mean max_steps\?"),
    (["optim.learning_rate=1e-3"], r"optim.learning_rate: no such setting in optim"),
    # A guessed group (an optimizer by name) where the config has a mapping of settings: the keys it takes.
    (
        ["optim=muon"],
        r"optim=muon: optim is a mapping of settings in conf/train.yaml, not a config group with options to choose by "
        r"name \(there is no conf/optim/ group yet\): set its keys instead, e.g. optim.lr=\.\.\., of: "
        + ", ".join(yaml.safe_load((CONF / "train.yaml").read_text())["optim"])
        + r"\.$",
    ),
    (["globl_batch_size=8"], r"globl_batch_size: no such setting at the top level. Did you mean global_batch_size\?"),
    (["optim.lr=="], r"Error parsing override 'optim.lr=='"),
    (
        ["strategy=fsdp", "strategy.float8=tensorwise"],
        r"strategy.float8 is not a setting of strategy=fsdp: it is one of strategy=ddp, fsdp2, pipeline, single, tp, "
        r"tp_fsdp",
    ),
    (
        ["strategy=ddp", "strategy.expert_parallel_size=2"],
        r"strategy.expert_parallel_size is not a setting of strategy=ddp: it is one of strategy=fsdp2",
    ),
    # The argparse habit: answered with the override it meant.
    (
        ["--max_steps", "10"],
        r"--max_steps: settings are Hydra overrides, key=value without dashes: write trainer.max_steps=10",
    ),
    (["--max_steps=10"], r"write trainer.max_steps=10"),
    (["--global-batch-size=4"], r"write global_batch_size=4"),
    (["--lr", "1e-3"], r"write optim.lr=1e-3"),
]

# Strategy settings that take any number (or a path, a backend's name): every other setting of a strategy
# group has a closed set of values, and a value outside it must be refused before anything starts.
OPEN_STRATEGY_SETTINGS = {
    "_target_",
    "data_parallel_size",
    "tensor_parallel_size",
    "context_parallel_size",
    "pipeline_parallel_size",
    "hybrid_shard_size",
    "data_parallel_shard_size",
    "expert_parallel_size",
    "virtual_stages",
    "n_microbatches",
    "stage_layers",
    "process_group_backend",
    "collective_timeout_minutes",
    "startup_timeout_minutes",
}
CLOSED_STRATEGY_SETTINGS = [
    (path.stem, key)
    for path in sorted((CONF / "strategy").glob("*.yaml"))
    for key in yaml.safe_load(path.read_text())
    if key not in OPEN_STRATEGY_SETTINGS
]

VALUES = [
    (["optim.lr=0"], r"optim.lr=0 is out of range: it must be above 0"),
    (["strategy=fsdp", "strategy.hybrid_shard_size=1"], r"strategy.hybrid_shard_size=1 is out of range"),
    (["optim.lr=-1e-3"], r"optim.lr=-0.001 is out of range"),
    # A word where a number belongs is no number (a word among words: stability.action, tests/test_stability.py).
    (["optim.lr=abc"], r"optim.lr=abc is not a number: it must be above 0"),
    (["model.dim=wide"], r"model.dim=wide is not a number: it must be"),
    (["optim.min_lr=-1"], r"optim.min_lr=-1 is out of range"),
    (["optim.min_lr=1.0"], r"optim.min_lr=1.0 is above optim.lr"),
    (["optim.warmup_steps=-1"], r"optim.warmup_steps=-1 is out of range"),
    (["optim.warmup_steps=2.5"], r"optim.warmup_steps=2.5 is out of range: it must be a whole number"),
    (["optim.decay_steps=0"], r"optim.decay_steps=0 is out of range"),
    (["optim.weight_decay=-0.1"], r"optim.weight_decay=-0.1 is out of range"),
    (["optim.betas=[0.9,1.5]"], r"optim.betas=\[0.9, 1.5\] is out of range"),
    (["optim.betas=[0.9]"], r"optim.betas=\[0.9\] is out of range: it must be two numbers"),
    (["optim.eps=0"], r"optim.eps=0 is out of range"),
    (["optim.grad_clip=-1"], r"optim.grad_clip=-1 is out of range"),
    (["trainer.max_steps=0"], r"trainer.max_steps=0 is out of range"),
    (["trainer.max_steps=null"], r"trainer.max_steps must be set"),
    (["global_batch_size=0"], r"global_batch_size=0 is out of range"),
    (["micro_batch_size=0"], r"micro_batch_size=0 is out of range"),
    (["val_every_n_steps=0"], r"val_every_n_steps=0 is out of range"),
    (["ckpt_every_n_steps=0"], r"ckpt_every_n_steps=0 is out of range"),
    (["val_sequences=0"], r"val_sequences=0 is out of range"),
    (["ckpt_every_minutes=0"], r"ckpt_every_minutes=0 is out of range"),
    (["threads_per_process=0"], r"threads_per_process=0 is out of range"),
    (
        ["strategy=ddp", "strategy.collective_timeout_minutes=0"],
        r"strategy.collective_timeout_minutes=0 is out of range",
    ),
    (
        ["strategy=tp", "trainer.devices=2", "strategy.startup_timeout_minutes=-1"],
        r"strategy.startup_timeout_minutes=-1 is out of range: it must be minutes above 0",
    ),
    (["data.seq_len=1"], r"data.seq_len=1 is out of range"),
    (
        ["data.seq_len=4096"],
        r"data.seq_len=4096 exceeds model.max_seq_len=1024, .*: raise model.max_seq_len=4096 \(or more\), or lower "
        r"data.seq_len to 1024 or less.",
    ),
    (["model.dim=90"], r"model.dim=90 must be divisible by model.n_heads=4"),
    (
        ["model.dim=72", "model.n_heads=8", "model.n_kv_heads=8"],
        r"model.dim / model.n_heads = 9 channels per head: an odd",
    ),
    # Only the widths that fail are listed: at dim 72 (4 heads of 18, 2 of them for keys and values) the
    # feed-forward's 192 (multiple_of 32) is a multiple of 16.
    (
        ["strategy.float8=tensorwise", "model.dim=72"],
        r"strategy.float8=tensorwise: no linear layer of the blocks has sides that are multiples of 16: model.dim=72 "
        r"and the key/value heads' width 36 \(2 heads of 18\) are not, so none can train in float8: choose model.dim "
        r"and model.n_kv_heads so that these widths are multiples of 16,",
    ),
    (
        ["strategy=tp", "trainer.devices=8", "strategy.float8=rowwise", "model.n_heads=8", "model.n_kv_heads=8"],
        r"strategy.float8=rowwise: no linear layer .* multiples of 16, split over 8 tensor-parallel ranks: the query "
        r"heads' width on a rank 8, the key/value heads' width on a rank 8 \(8 heads of 8\) and the feed-forward width "
        r"on a rank 24 are not",
    ),
    (["strategy.float8=tensorwise", "data.seq_len=40"], r"data.seq_len=40 gives each rank 40 tokens of a sequence"),
    (["model.n_kv_heads=3"], r"model.n_heads=4 must be a multiple of model.n_kv_heads=3"),
    # Mixtures of experts (docs/moe.md).
    (["model.family=gpt"], r"model.family=gpt is not a model family: it is one of llama, moe"),
    (["model=moe_debug", "model.top_k=5"], r"model.top_k=5 exceeds model.n_experts=4"),
    (["model=moe_debug", "model.score_func=relu"], r"model.score_func=relu is out of range: it must be softmax or"),
    (["model=moe_debug", "model.moe_every=3"], r"model.moe_every=3 exceeds model.n_layers=2"),
    (["model=moe_debug", "model.aux_loss_coef=-1"], r"model.aux_loss_coef=-1 is out of range"),
    (
        ["model=moe_debug", "strategy=pipeline", "trainer.devices=4", "strategy.expert_parallel_size=2"],
        r"strategy.expert_parallel_size=2 does not divide the 1 data-parallel ranks of each pipeline stage",
    ),
    (
        ["strategy=fsdp2", "trainer.devices=4", "strategy.data_parallel_shard_size=3"],
        r"strategy.data_parallel_shard_size=3 does not divide the 4 data x context ranks",
    ),
    (
        [
            "strategy=fsdp2",
            "trainer.devices=2",
            "strategy.context_parallel_size=2",
            "strategy.context_parallel_kv=ring",
            "strategy.regather_kv=true",
        ],
        r"strategy.regather_kv=true gathers the keys and values again in the backward, and "
        r"strategy.context_parallel_kv=ring never gathers them",
    ),
    (
        ["strategy=fsdp2", "trainer.devices=2", "strategy.gradient_sync=replicas_at_last"],
        r"strategy.gradient_sync=replicas_at_last defers the all-reduce across HSDP's replicas, and this run has none",
    ),
    (
        ["strategy=tp_fsdp", "trainer.devices=4", "strategy.data_parallel_shard_size=two"],
        r"strategy.data_parallel_shard_size=two does not divide the 2 data x context ranks",
    ),
    (
        ["model=moe_debug", "strategy=fsdp2", "trainer.devices=2", "strategy.expert_parallel_size=4"],
        r"strategy.expert_parallel_size=4 does not divide the 2 data-parallel ranks",
    ),
    (
        [
            "model=moe_debug",
            "strategy=fsdp2",
            "trainer.devices=4",
            "strategy.expert_parallel_size=4",
            "model.n_experts=6",
        ],
        r"model.n_experts=6 is not divisible by strategy.expert_parallel_size=4",
    ),
    (
        ["strategy=fsdp2", "trainer.devices=2", "strategy.expert_parallel_size=2"],
        r"strategy.expert_parallel_size=2 splits a mixture's experts, and model.family=llama has none",
    ),
    (["strategy=fsdp2", "strategy.expert_parallel_size=0"], r"strategy.expert_parallel_size=0: give the number"),
    (
        ["model=moe_debug", "model.bias_update_rate=0.001", "trainer.precision=bf16-true"],
        r"model.bias_update_rate=0.001 with trainer.precision=bf16-true: the routing biases would be stored in "
        r"bfloat16",
    ),
    (["model.n_layers=0"], r"model.n_layers=0 is out of range"),
    (["model.norm_eps=0"], r"model.norm_eps=0 is out of range"),
    (["model.ffn_dim=0"], r"model.ffn_dim=0 is out of range"),
    (
        ["+trainer.gradient_clip_val=1.0"],
        r"trainer.gradient_clip_val is computed by project.train: set optim.grad_clip instead",
    ),
    (["strategy=tp", "trainer.devices=3"], r"model n_heads=4 is not divisible by strategy.tensor_parallel_size=3"),
    (
        ["strategy=tp_fsdp", "strategy.tensor_parallel_size=3", "trainer.devices=4"],
        r"tensor_parallel_size=3 does not divide the 4 devices",
    ),
    (
        ["strategy=tp", "trainer.devices=2", "model.vocab_size=513"],
        r"vocab_size=513 is not divisible by strategy.tensor_parallel_size=2",
    ),
    (  # each tensor-parallel rank holds half of every expert's hidden units
        ["strategy=tp", "trainer.devices=2", "model=moe_debug", "model.expert_ffn_dim=95"],
        r"model expert_ffn_dim=95 is not divisible by strategy.tensor_parallel_size=2: each tensor-parallel rank "
        r"holds an equal slice of every expert's hidden units",
    ),
    (
        ["strategy=ddp", "trainer.devices=2", "global_batch_size=7"],
        r"global_batch_size=7 does not divide over 2 data-parallel ranks",
    ),
    (
        ["strategy=ddp", "trainer.devices=2", "micro_batch_size=3"],
        r"micro_batch_size=3 does not divide the 4 sequences",
    ),
    (["strategy=pipeline", "trainer.devices=4"], r"model.n_layers=2 is fewer than the 4 pipeline stage chunks"),
    (
        ["strategy=pipeline", "trainer.devices=2", "strategy.schedule=zigzag"],
        r"strategy.schedule=zigzag is not a choice: it must be one of gpipe",
    ),
    (["seed=abc"], r"seed=abc is not a number: it must be a whole number"),
    (["seed=-1"], r"seed=-1 is out of range"),
    (["data.seed=1.5"], r"data.seed=1.5 is out of range"),
    (["document_mask=1"], r"document_mask=1 must be true or false"),
    (["data.loader_workers=-1"], r"data.loader_workers=-1 is out of range"),
    (
        ["strategy=ddp", "+strategy.grad_reduce=sum"],
        r"strategy.grad_reduce is not a setting of \S*ddp\S*. Did you mean grad_reduction\?",
    ),
    (
        ["strategy=pipeline", "trainer.devices=2", "strategy.virtual_stages=2"],
        r"strategy.schedule=1f1b runs one stage chunk per rank",
    ),
]


@pytest.mark.parametrize("overrides, message", COMMAND_LINE, ids=[" ".join(o) for o, _ in COMMAND_LINE])
def test_a_command_line_hydra_would_refuse_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_command_line(["experiment=debug", *overrides])


@pytest.mark.parametrize("dry_run", [False, True], ids=["start", "dry-run"])
@pytest.mark.parametrize("overrides, message", VALUES, ids=[" ".join(o) for o, _ in VALUES])
def test_a_setting_out_of_range_is_refused_before_training(overrides, message, dry_run):
    check_command_line(["experiment=debug", *overrides])  # the command line itself is fine ...
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=debug", *overrides])
    with pytest.raises(ConfigError, match=message):  # ... its values are not, for a dry run either
        preflight(cfg, dry_run=dry_run)


@pytest.mark.parametrize(
    "strategy, key", CLOSED_STRATEGY_SETTINGS, ids=[f"{s}.{k}" for s, k in CLOSED_STRATEGY_SETTINGS]
)
def test_every_closed_set_strategy_setting_refuses_a_value_outside_it(strategy, key):
    devices = "1" if strategy in ("single", "horovod") else "2"
    overrides = ["experiment=debug", f"strategy={strategy}", f"trainer.devices={devices}", f"strategy.{key}=bogus"]
    check_command_line(overrides)
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    with pytest.raises(ConfigError, match=rf"strategy.{key}=bogus .*must be one of"):
        preflight(cfg)


def test_a_setting_a_strategy_refuses_while_hydra_builds_it_is_one_paragraph(capsys):
    # Hydra's instantiate wraps what the strategy raises in an InstantiationException of its own.
    with pytest.raises(SystemExit) as stopped, exit_on_config_error():
        instantiate({"_target_": "project.parallel.strategies.ddp.ddp_strategy", "grad_reduction": "median"})
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "error: strategy.grad_reduction='median': choose 'mean' (default) or 'sum'.\n"


def test_the_strategy_choices_checked_early_are_those_the_strategies_take():
    import typing

    import torch

    from project.config.values import STRATEGY_CHOICES
    from project.parallel import pipeline_layout
    from project.parallel.kinds import SHARDING_STRATEGIES
    from project.parallel.strategies import ddp

    assert STRATEGY_CHOICES["sharding_strategy"] == tuple(SHARDING_STRATEGIES)
    assert set(STRATEGY_CHOICES["grad_reduction"]) == set(
        typing.get_args(typing.get_type_hints(ddp.ddp_strategy)["grad_reduction"])
    )
    assert STRATEGY_CHOICES["param_dtype"] == STRATEGY_CHOICES["reduce_dtype"]
    for name in STRATEGY_CHOICES["param_dtype"][1:]:  # after None; fsdp2 builds its policy with getattr(torch, name)
        assert getattr(torch, name).is_floating_point, name
    assert STRATEGY_CHOICES["param_dtype"][0] is None
    assert STRATEGY_CHOICES["schedule"] == pipeline_layout.SCHEDULE_NAMES


def test_the_default_settings_pass_every_check():
    check_command_line(["experiment=debug"])
    with initialize_config_dir(str(CONF), version_base="1.3"):
        assert preflight(compose("train", overrides=["experiment=debug", "trainer.devices=1"])) is not None


@pytest.mark.parametrize(
    "bad",
    [
        ["seed=abc"],
        ["strategy=ddp", "trainer.devices=2", "strategy.grad_reduction=median"],
        ["strategy=fsdp", "trainer.devices=2", "strategy.sharding_strategy=FULL"],
        ["--max_steps", "10"],
    ],
    ids=["seed", "grad_reduction", "sharding_strategy", "argparse-flag"],
)
def test_a_bad_seed_strategy_setting_or_dashed_flag_prints_one_paragraph_and_exits_2(bad, tmp_path):
    args = [sys.executable, "-m", "project.train", "experiment=debug", *bad, f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("module", ["project.train", "project.prepare"])
@pytest.mark.parametrize("bad", ["experiment=shakespere", "optim.lr=0"])
def test_the_commands_print_one_paragraph_and_exit_2(module, bad, tmp_path):
    if module == "project.prepare" and bad == "optim.lr=0":
        bad = "data.vocab_sise=300"  # prepare reads the data settings only
    args = [sys.executable, "-m", module, bad, f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing written


# A callback's mistake, as typed (issue 69): (overrides, the paragraph's text, where it is answered: "preflight" before
# the imports, "build" where the Trainer's callbacks are built, before the data is prepared and anything trains).
CALLBACK_MISTAKES = [
    (
        ["callbacks=early_stopping", "callbacks.early_stopping.patience=abc"],
        "callbacks.early_stopping.patience=abc is not a whole number, which lightning.pytorch.callbacks."
        "EarlyStopping's patience takes: give a whole number, e.g. callbacks.early_stopping.patience=3 (its default).",
        "build",
    ),
    (
        ["callbacks=early_stopping", "callbacks.early_stopping.monitor=val/los"],
        (
            "callbacks.early_stopping.monitor=val/los: the run logs no metric of that name. A callback's monitor "
            "reads what the run logs through the module, here: train/loss, ",
            "val/loss, val/ppl, ",
            ". Did you mean val/loss? Set callbacks.early_stopping.monitor=val/loss.",
        ),
        "preflight",
    ),
    (
        ["+callbacks.foo._target_=lightning.pytorch.callbacks.NoSuchThing"],
        "callbacks.foo._target_=lightning.pytorch.callbacks.NoSuchThing: lightning.pytorch.callbacks has no "
        "NoSuchThing. Its callbacks: BackboneFinetuning, ",
        "build",
    ),
    (
        ["callbacks=early_stopping", "+callbacks.early_stopping.patiense=5"],
        "callbacks.early_stopping.patiense is not an argument of lightning.pytorch.callbacks.EarlyStopping. Did you "
        "mean patience? It takes: monitor, min_delta, patience, ",
        "build",
    ),
    # And their neighbours.
    (
        ["callbacks=early_stopping", "callbacks.early_stopping.monitor=train/mfu"],  # the CPU's peak is not known
        "callbacks.early_stopping.monitor=train/mfu: it is logged by callbacks.throughput where the device's peak "
        "FLOP/s is known: on a CPU, set peak_flops_per_device=....",
        "preflight",
    ),
    (
        ["+callbacks.foo._target_=lightning.pytorch.callbacks.EarlyStoping"],
        "lightning.pytorch.callbacks has no EarlyStoping. Did you mean EarlyStopping?",
        "build",
    ),
    (
        ["+callbacks.foo._target_=lightnin.pytorch.callbacks.EarlyStopping"],
        "callbacks.foo._target_=lightnin.pytorch.callbacks.EarlyStopping: there is no package 'lightnin' here",
        "preflight",
    ),
    (["+callbacks.foo.patience=3"], "callbacks.foo has no _target_: a callback is a class with its", "preflight"),
    (
        ["+callbacks.es._target_=lightning.pytorch.callbacks.EarlyStopping"],
        "callbacks.es: lightning.pytorch.callbacks.EarlyStopping needs monitor: add +callbacks.es.monitor=VALUE.",
        "build",
    ),
    (
        ["callbacks=lr_monitor", "callbacks.lr_monitor.logging_interval=stp"],
        "callbacks.lr_monitor.logging_interval=stp is not step or epoch or null",
        "build",
    ),
    (  # refused by Lightning's own constructor
        ["callbacks=early_stopping", "callbacks.early_stopping.mode=mx"],
        "callbacks.early_stopping (lightning.pytorch.callbacks.EarlyStopping) refused its arguments: `mode` can be "
        "min, max, got mx. Fix the value in callbacks.early_stopping.",
        "build",
    ),
    (
        ["+callbacks.foo._target_=collections.OrderedDict"],
        "callbacks.foo._target_=collections.OrderedDict is not a Lightning callback",
        "build",
    ),
    (
        ["callbacks=early_stopping", "callbacks.early_stopping.monitor=eval/heldout/loss"],
        "callbacks.evaluation (HeldOutEvaluation) writes it to the loggers (metrics.csv) only",
        "preflight",
    ),
    (
        ["callbacks=early_stopping", "~callbacks.memory", "callbacks.best_checkpoint.monitor=memory/peak_bytes"],
        "callbacks.best_checkpoint.monitor=memory/peak_bytes: it is logged by callbacks.memory, which this run leaves "
        "out",
        "preflight",
    ),
]


def composed(overrides: list[str]):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=["experiment=debug", *overrides])


def built_callbacks(cfg, run_dir):
    """The callbacks of a run, built as the Trainer's are (nothing trains) once the checks before the imports passed."""
    from project.training.trainer import build_callbacks

    layout = preflight(cfg)
    cfg.paths.run_dir = cfg.ckpt_dir = str(run_dir)  # as project.training.run sets them
    return build_callbacks(cfg, layout)


@pytest.mark.parametrize(
    "overrides, message, where", CALLBACK_MISTAKES, ids=[f"{' '.join(o)}:{w}" for o, _, w in CALLBACK_MISTAKES]
)
def test_a_callback_mistake_is_one_paragraph_naming_the_setting_before_training(overrides, message, where, tmp_path):
    from project.training.trainer import build_callbacks

    cfg = composed(overrides)
    with pytest.raises(ConfigError) as refused:
        if where == "preflight":
            preflight(cfg)  # before torch and Lightning are imported
        else:
            layout = preflight(cfg)  # passes the checks before the imports, then refused where the callbacks are built
            cfg.paths.run_dir = cfg.ckpt_dir = str(tmp_path)
            build_callbacks(cfg, layout)
    said = str(refused.value)
    assert all(part in said for part in ((message,) if isinstance(message, str) else message)), said
    assert "\n" not in said


@pytest.mark.parametrize(
    "overrides",
    [
        ["callbacks=[early_stopping,lr_monitor,rich_progress,layer_summary]"],
        ["+callbacks.timer._target_=lightning.pytorch.callbacks.Timer", "+callbacks.timer.duration=00:12:00:00"],
        ["callbacks=early_stopping", "callbacks.early_stopping.monitor=moe/layer1/load_max", "model=moe_debug"],
        ["+callbacks.by_step._target_=lightning.pytorch.callbacks.ModelCheckpoint", "+callbacks.by_step.monitor=step"],
    ],
    ids=["every-option", "timer", "moe-layer", "step"],
)
def test_the_documented_callbacks_pass_the_checks_and_build(overrides, tmp_path):
    from lightning.pytorch.callbacks import Callback

    assert all(isinstance(c, Callback) for c in built_callbacks(composed(overrides), tmp_path))


def test_a_monitor_may_name_what_a_callback_of_the_users_own_logs_but_not_a_near_miss_of_a_known_name():
    from project.config.callbacks import check_monitor

    cfg = composed(["callbacks=early_stopping"])
    check_monitor(cfg, "callbacks.early_stopping.monitor", "mine/score", may_be_own=True)
    with pytest.raises(ConfigError, match="the run logs no metric of that name"):
        check_monitor(cfg, "callbacks.early_stopping.monitor", "mine/score")
    with pytest.raises(ConfigError, match="Did you mean val/loss"):
        check_monitor(cfg, "callbacks.early_stopping.monitor", "val/los", may_be_own=True)


def test_a_callback_refused_where_the_trainer_is_built_prints_one_paragraph_and_exits_2(tmp_path, capsys):
    # What project.train's main does with what build_trainer raises (run.py builds the Trainer before the data).
    from project.training.trainer import build_trainer

    cfg = composed(["callbacks=early_stopping", "callbacks.early_stopping.patience=abc"])
    layout = preflight(cfg)
    cfg.paths.run_dir = cfg.ckpt_dir = str(tmp_path)
    with pytest.raises(SystemExit) as stopped, exit_on_config_error():
        build_trainer(cfg, tmp_path, instantiate(cfg.strategy, _convert_="all"), layout)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("error: callbacks.early_stopping.patience=abc is not a whole")
    assert err.count("\n") == 1 and "Traceback" not in err

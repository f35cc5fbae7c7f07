"""A run that looks after itself (conf/stability).

Loss spikes (project.training.stability): a step whose loss or gradient norm lies many standard deviations above the
last steps' is found on the device; `skip` withholds its update exactly as the optimizer skips a non-finite step,
`rollback` restarts the run from its last checkpoint past the spike's batches, exactly as a run resumed from that
checkpoint with those batches left out; under single, ddp, fsdp2 and pipeline alike; past `max_rollbacks` the run
stops, naming the steps. Per-layer numerics (callbacks/numerics.py) are those of one device in every layout. A slow
rank is named (callbacks/stragglers.py); a hung one: tests/test_crashes.py.

Faults are injected (tests/faults.py: spike@STEP multiplies the loss of one step by 1,000, slow@STEP delays every
block's forward on a rank); the runs train in process (tests/in_process.py), one group of one rank and one of two."""

from __future__ import annotations

import csv
import faulthandler
import json
import math
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT, WEIGHT_ATOL, read_metrics, run_module, train_overrides
from in_process import train_in_process

from project.checkpoint.reshard import read_whole
from project.config.stability import StabilityConfig
from project.runtime.errors import TrainingStopped
from project.training.stability import Rollback, SpikeDetector, escalate

pytestmark = pytest.mark.slow

SPIKE, CHECKPOINT, STEPS, SKIP_BATCHES, BATCH, NUMERICS_EVERY = 5, 3, 8, 1, 8, 4
NUMERICS_STEPS = (3, 7)  # the checkpoint's step among them: a resumed run's first
# Four layers and loss chunks of 16 tokens: the pipeline's two stages split the same model (tests/test_pipeline.py).
RUN = [
    f"trainer.max_steps={STEPS}",
    f"global_batch_size={BATCH}",
    "model.n_layers=4",
    "model.loss_chunk_tokens=16",
    f"optim.decay_steps={STEPS}",  # the same learning rates in a run stopped at the checkpoint
    f"ckpt_every_n_steps={CHECKPOINT}",
    "val_every_n_steps=1000",
    "stability.window=8",
    "stability.warmup_steps=4",
    f"stability.numerics_every_n_steps={NUMERICS_EVERY}",
]
SPIKED = f"FAULT=spike@{SPIKE}"
SKIP = [*RUN, SPIKED, "stability=skip"]
ROLLBACK = [*RUN, SPIKED, "stability=rollback", f"stability.skip_batches={SKIP_BATCHES}"]
# Where the rolled-back run reads on: past the spike's batch and SKIP_BATCHES more.
RESUME_SAMPLE = (SPIKE + 1 + SKIP_BATCHES) * BATCH
LAYOUTS = {
    "single": [],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "fsdp2": ["strategy=fsdp2", "trainer.devices=2"],
    "pipeline": ["strategy=pipeline", "trainer.devices=2"],
}
# Skipped only (their numerics sum shards in other ways: tensor-parallel slices and replicated norms, copies).
SKIPPED_ONLY = {
    "tp": ["strategy=tp", "trainer.devices=2"],
    # Each rank a whole copy (FSDP2 replicating over groups of one rank): its sums are not counted twice.
    "fsdp-no-shard": ["strategy=fsdp", "trainer.devices=2", "strategy.sharding_strategy=NO_SHARD"],
}
LOG_EVERY_LATER = 4  # logging steps 3 and 7: a spike at 5 is read two steps after it
COOLDOWN = [*ROLLBACK, "stability.cooldown_steps=2", "stability.cooldown_lr_scale=0.5"]
SLOW = [*RUN, "FAULT=slow@2:rank=1", *LAYOUTS["ddp"]]
# Ten incidents, each after a newer checkpoint: a spike at each step from step 5 (each once in the process).
FIRST_OF_TEN = 5
TEN_ROLLBACKS = [
    *RUN,
    "FAULT=" + ",".join(f"spike@{FIRST_OF_TEN + i}" for i in range(10)),
    "stability=rollback",
    "stability.skip_batches=0",
    f"trainer.max_steps={FIRST_OF_TEN + 10 + 1}",
    "ckpt_every_n_steps=1",
    "stability.max_rollbacks=10",
    *LAYOUTS["fsdp2"],
]


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory) -> dict[str, object]:
    """Every run of this module, by name: the references on one rank, then the layouts on one or two."""
    names = ["skipped-nan", "to-checkpoint", "resumed-past", "slow", "cooldown", "read-later", "ten-rollbacks"]
    names += [f"{a}-{n}" for n in LAYOUTS for a in "sr"]
    dirs = {name: tmp_path_factory.mktemp(name) for name in [*names, *[f"s-{n}" for n in SKIPPED_ONLY]]}
    single = [
        # An update the optimizer skips by itself: a NaN loss at the step, one skip allowed.
        ("skipped-nan", [*RUN, f"FAULT=nan@{SPIKE}", "optim.max_skipped_steps=1"]),
        # The run stopped at its checkpoint, then resumed from it reading on past the spike's batches.
        ("to-checkpoint", [*RUN, f"trainer.max_steps={CHECKPOINT}"]),
        (
            "resumed-past",
            [
                *RUN,
                f"ckpt_path={dirs['to-checkpoint'] / 'checkpoints' / 'last.ckpt'}",
                f"+datamodule.continue_from_sample={RESUME_SAMPLE}",
            ],
        ),
        ("s-single", SKIP),
        ("r-single", ROLLBACK),
        ("cooldown", COOLDOWN),
        # Resumed from that checkpoint, saving none before the end and logging at steps 3 and 7: the spike is read at 7.
        (
            "read-later",
            [
                *ROLLBACK,
                f"ckpt_path={dirs['to-checkpoint'] / 'checkpoints' / 'last.ckpt'}",
                "ckpt_every_n_steps=1000",
                f"trainer.log_every_n_steps={LOG_EVERY_LATER}",
            ],
        ),
    ]
    parallel = [n for n in LAYOUTS if n != "single"]
    pairs = [(f"{a}-{n}", [*(SKIP if a == "s" else ROLLBACK), *LAYOUTS[n]]) for n in parallel for a in "sr"]
    pairs += [(f"s-{n}", [*SKIP, *layout]) for n, layout in SKIPPED_ONLY.items()] + [("slow", SLOW)]
    probe = "+callbacks.resources._target_=tests.resource_probe.CountResources"
    pairs += [("ten-rollbacks", [*TEN_ROLLBACKS, probe, f"+callbacks.resources.output_dir={dirs['ten-rollbacks']}"])]
    for world_size, cases in ((1, single), (2, pairs)):
        train_in_process(world_size, [(dirs[name], train_overrides(tiny_shards, dirs[name], *o)) for name, o in cases])
    return dirs


def spike_records(run_dir) -> list[dict]:
    """The spikes a run's action acted on (gradient-norm excursions are recorded too, as `logged`)."""
    records = [json.loads(line) for line in (run_dir / "stability.jsonl").read_text().splitlines()]
    return [r for r in records if r["action"] != "logged"]


def assert_same_weights(run_dir, reference_dir) -> None:
    """The final weights, to the parity tests' tolerance (tests/conftest.py: assert_reproduces)."""
    weights = read_whole(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    for name, value in read_whole(reference_dir / "checkpoints" / "last.ckpt")["state_dict"].items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("layout", [*LAYOUTS, *SKIPPED_ONLY])
def test_skip_withholds_the_spikes_update_as_the_optimizer_skips_a_non_finite_step(runs, layout):
    run_dir, reference = runs[f"s-{layout}"], runs["skipped-nan"]
    losses, reference_losses = read_metrics(run_dir, "train/loss"), read_metrics(reference, "train/loss")
    assert losses[SPIKE] > 100 * losses[SPIKE - 1] and math.isnan(reference_losses[SPIKE])  # what each step met
    assert sorted(losses) == sorted(reference_losses) == list(range(STEPS))
    for step in reference_losses:
        if step != SPIKE:
            assert losses[step] == pytest.approx(reference_losses[step], rel=1e-5), step
    assert_same_weights(run_dir, reference)
    [record] = spike_records(run_dir)
    assert record["step"] == SPIKE and record["action"] == "skip" and record["loss_z"] > 50
    assert read_metrics(run_dir, "stability/spikes")[STEPS - 1] == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rollback_trains_on_as_a_run_resumed_from_the_checkpoint_past_the_spikes_batches(runs, layout):
    run_dir = runs[f"r-{layout}"]
    before, after = read_metrics(runs["to-checkpoint"], "train/loss"), read_metrics(runs["resumed-past"], "train/loss")
    losses = read_metrics(run_dir, "train/loss")  # each step once: the steps after the checkpoint, as retrained
    assert sorted(losses) == list(range(STEPS)) and sorted(before) == list(range(CHECKPOINT))
    for step, loss in losses.items():
        assert loss == pytest.approx((before if step < CHECKPOINT else after)[step], rel=1e-5), step
    assert_same_weights(run_dir, runs["resumed-past"])
    [record] = spike_records(run_dir)
    assert record["action"] == "rollback" and record["step"] == SPIKE and record["restart_step"] == CHECKPOINT
    # Left out: every batch read since the checkpoint (up to the spike's), and SKIP_BATCHES more.
    assert record["samples_left_out"] == [CHECKPOINT * BATCH, RESUME_SAMPLE] and "shift" not in record
    # Its checkpoints know it: a run resumed from them reads on where this one would, and counts the rollback.
    checkpoint = read_whole(run_dir / "checkpoints" / "last.ckpt")
    data = next(v for k, v in checkpoint.items() if k.endswith("TokenShardDataModule"))
    assert data["samples_consumed"] == RESUME_SAMPLE + (STEPS - CHECKPOINT) * BATCH
    assert [r["spike_step"] for r in checkpoint["stability"]["rollbacks"]] == [SPIKE]
    assert read_metrics(run_dir, "stability/rollbacks")[STEPS - 1] == 1


def test_a_spike_read_steps_after_it_rolls_back_as_one_read_at_its_own_step(runs):
    """The host reads the spike flag where it waits anyway: at step 7 here, two steps after the spike. Its update was
    withheld meanwhile and step 6 is dropped with the others since the checkpoint: the run trains on exactly as the
    one resumed from the checkpoint past the spike's batches, and records the same rollback."""
    run_dir, reference = runs["read-later"], runs["resumed-past"]
    losses, expected = read_metrics(run_dir, "train/loss"), read_metrics(reference, "train/loss")
    assert sorted(losses) == [s for s in range(CHECKPOINT, STEPS) if (s + 1) % LOG_EVERY_LATER == 0] == [3, 7]
    for step, loss in losses.items():
        assert loss == pytest.approx(expected[step], rel=1e-5), step
    assert_same_weights(run_dir, reference)
    [record] = spike_records(run_dir)
    assert record["action"] == "rollback" and record["step"] == SPIKE and record["restart_step"] == CHECKPOINT
    assert record["samples_left_out"] == [CHECKPOINT * BATCH, RESUME_SAMPLE]


def test_past_max_rollbacks_the_run_stops_naming_the_spike_and_keeps_its_checkpoint(tiny_shards, tmp_path):
    args = train_overrides(tiny_shards, tmp_path, *RUN, "stability=rollback", "stability.max_rollbacks=0")
    result = run_module("tests.faults", args, env={"FAULT": f"spike@{SPIKE}"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"error: step {SPIKE}: loss " in result.stderr and "a new incident after 0 (stability.max_rollbacks=0" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert read_whole(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == CHECKPOINT


def robust_z(value: float, window: list[float], size: int) -> float:
    """The rule written out: the log of the value against the level, the median of the last tenth of the window's
    logs (at least 3; the lower middle one of an even count, as torch takes it), in units of the steps' noise,
    1.4826 / sqrt(2) x the median absolute difference of successive logs (at least 0.01)."""
    logs = [math.log(v) for v in window]
    level = statistics.median_low(logs[-max(3, size // 10) :])
    noise = 1.4826 / math.sqrt(2) * statistics.median_low(abs(b - a) for a, b in zip(logs, logs[1:]))
    return (math.log(value) - level) / max(noise, 1e-2)


def test_the_z_scores_are_robust_ones_of_the_windows_logarithms_and_a_spike_stays_out_of_it():
    """Against the recent level and the successive steps' noise of the last `window` accepted steps' logarithms."""
    detector = SpikeDetector(StabilityConfig(window=5, warmup_steps=3, threshold=5.0))
    generator = torch.Generator().manual_seed(0)
    losses = [3.0 - 0.05 * i + 0.05 * float(torch.randn((), generator=generator)) for i in range(12)]
    norms = [1.0 + 0.1 * float(torch.rand((), generator=generator)) for _ in range(12)]
    losses[8] *= 3  # a spike
    accepted: list[tuple[float, float]] = []
    for step, (loss, norm) in enumerate(zip(losses, norms)):
        spike = bool(detector.observe(torch.tensor(loss), torch.tensor(norm), step))
        z = detector.metrics()
        if len(accepted) >= 3:
            window = accepted[-5:]
            for i, name in enumerate(("stability/loss_z", "stability/grad_norm_z")):
                expected = robust_z((loss, norm)[i], [pair[i] for pair in window], 5)
                assert float(z[name]) == pytest.approx(expected, rel=1e-3, abs=1e-3), (step, name)
        else:
            assert float(z["stability/loss_z"]) == 0.0  # warming up
        assert spike == (step == 8)
        if not spike:
            accepted.append((loss, norm))
    [event] = detector.read_events()
    assert event["step"] == 8 and event["loss"] == pytest.approx(losses[8]) and event["acted"] == 1.0


def test_nothing_is_judged_before_the_learning_rate_warm_up_ends_and_the_window_holds_warmup_steps():
    """A tripled loss at step 6 is not judged while the learning rate warms up (10 steps), nor at step 12 before
    the window holds 8 steps; at step 14 it is."""
    for spike_at, expected in ((6, False), (9, False), (14, True)):
        detector = SpikeDetector(StabilityConfig(window=8, warmup_steps=8, threshold=6.0), lr_warmup_steps=10)
        flags = [
            bool(
                detector.observe(
                    torch.tensor(3.0 * (1 + 2 * (step == spike_at)) + 0.01 * (step % 3)), torch.tensor(1.0), step
                )
            )
            for step in range(16)
        ]
        assert flags[spike_at] is expected and sum(flags) == expected, spike_at


def test_a_gradient_norm_that_grows_while_the_loss_falls_is_logged_not_acted_on():
    """What the issue saw on real runs: the norm grows several-fold after the warm-up while the loss falls. Logged as
    an excursion, once per report; acted on only with act_on_grad_norm=true."""
    losses = [4.0 * 0.99**step for step in range(40)]
    norms = [1.0 + 0.01 * (step % 3) if step < 30 else 1.3 ** (step - 29) for step in range(40)]  # +30% a step
    for act_on_grad_norm in (False, True):
        config = StabilityConfig(window=20, warmup_steps=20, threshold=6.0, act_on_grad_norm=act_on_grad_norm)
        detector = SpikeDetector(config)
        flags = [
            bool(detector.observe(torch.tensor(x), torch.tensor(y), s)) for s, (x, y) in enumerate(zip(losses, norms))
        ]
        assert any(flags) is act_on_grad_norm
        if act_on_grad_norm:
            continue
        metrics = {name: float(value) for name, value in detector.metrics().items()}
        assert metrics["stability/grad_norm_z"] > 6 and metrics["stability/excursions"] == 10
        assert metrics["stability/spikes"] == 0
        with pytest.warns(UserWarning) as said:
            detector.report("rollback")
        [message] = [str(w.message) for w in said]
        assert (
            "the gradient norm above its band, the loss within its own, at 10 step(s) since the last report (30, "
            in message
        )
        assert "logged only" in message


def test_a_spike_met_after_every_rollback_escalates_and_stops_the_run_after_max_attempts(tiny_shards, tmp_path):
    """A spike at the same step after each restart (spikes@STEP): three rollbacks to the checkpoint, leaving out
    the spike's batch and 0, 3, then 15 more, the third with the learning rate cooled down; then one paragraph."""
    args = train_overrides(tiny_shards, tmp_path, *RUN, "stability=rollback", "stability.skip_batches=0")
    result = run_module("tests.faults", args, env={"FAULT": f"spikes@{SPIKE}"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"met again after 3 rollbacks to the checkpoint of step {CHECKPOINT} (stability.max_attempts=3" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    records = spike_records(tmp_path)
    assert [(r["action"], r.get("attempt")) for r in records] == [
        ("rollback", 1),
        ("rollback", 2),
        ("rollback", 3),
        ("stopped", None),
    ]
    # Each left out the batches read since the checkpoint, the spike's, and 0, 3, then 15 more.
    left_out = [(r["samples_left_out"][1] - r["samples_left_out"][0]) // BATCH for r in records[:3]]
    assert left_out == [SPIKE - CHECKPOINT + 1 + k for k in (0, 3, 15)]
    assert [r["lr_scale"] for r in records[:3]] == [1.0, 1.0, 0.1]


def test_a_spike_that_recurs_after_every_rollback_escalates_then_stops_with_one_paragraph():
    """Rollbacks to the same checkpoint are one incident: the second leaves out four times the batches, the third
    cools the learning rate down too; the fourth stops. A spike past a later checkpoint is a new incident."""
    config = StabilityConfig(skip_batches=10, max_attempts=3, max_rollbacks=2, cooldown_lr_scale=0.1)
    recorded: list[dict] = []
    event = {"step": 45.0, "loss": 9.0, "grad_norm": 3.0, "loss_z": 40.0, "grad_norm_z": 2.0}
    rollbacks: list[Rollback] = []
    plans = []
    for _ in range(3):
        plan = escalate(config, rollbacks, event, 40, recorded.append)
        plans.append((plan.attempt, plan.skip_batches, plan.lr_scale, plan.cooldown_steps))
        left_out = 16 * (5 + 1 + plan.skip_batches)
        rollbacks.append(Rollback(45, 40, 1000 + left_out, 1000, plan.lr_scale, 40 + plan.cooldown_steps, plan.attempt))
    assert plans == [(1, 10, 1.0, 0), (2, 43, 1.0, 0), (3, 175, 0.1, 10)]
    with pytest.raises(TrainingStopped) as stopped:
        escalate(config, rollbacks, event, 40, recorded.append)
    said = str(stopped.value)
    assert "met again after 3 rollbacks to the checkpoint of step 40 (stability.max_attempts=3" in said
    assert "they left out 256 sequences, then 784 sequences, then 2896 sequences" in said and "\n" not in said
    assert recorded == [{**event, "action": "stopped"}]
    # After a new checkpoint a spike is a new incident; past max_rollbacks incidents the run stops.
    assert escalate(config, rollbacks, {**event, "step": 70.0}, 60, recorded.append).attempt == 1
    rollbacks.append(Rollback(70, 60, 5000, 4000))
    with pytest.raises(
        TrainingStopped, match=r"a new incident after 2 \(stability.max_rollbacks=2; incidents from the"
    ):
        escalate(config, rollbacks, {**event, "step": 95.0}, 80, recorded.append)


def test_a_resumed_detector_judges_the_next_step_as_the_uninterrupted_one():
    config = StabilityConfig(window=5, warmup_steps=2)
    values = [(2.0 + 0.1 * (i % 3), 1.0 + 0.05 * i) for i in range(9)]
    whole, first = SpikeDetector(config), SpikeDetector(config)
    for step, (loss, norm) in enumerate(values[:7]):
        whole.observe(torch.tensor(loss), torch.tensor(norm), step)
        first.observe(torch.tensor(loss), torch.tensor(norm), step)
    first.read_events()  # as a checkpoint's save does (its report), which then counts them
    resumed = SpikeDetector(config)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # plain values, as a checkpoint holds them
    for step, (loss, norm) in enumerate(values[7:], start=7):
        whole.observe(torch.tensor(loss), torch.tensor(norm), step)
        resumed.observe(torch.tensor(loss), torch.tensor(norm), step)
        # The same values in another order of the ring: summed in another order, equal to float32's precision.
        assert {k: float(v) for k, v in resumed.metrics().items()} == pytest.approx(
            {k: float(v) for k, v in whole.metrics().items()}, rel=1e-6
        )


def test_a_cooldown_scales_the_learning_rate_of_the_steps_after_the_restart(runs):
    """From the restart's own step on (the checkpoint saved the unscaled rate), for cooldown_steps steps."""
    cooled, plain = read_metrics(runs["cooldown"], "train/lr"), read_metrics(runs["resumed-past"], "train/lr")
    for step in range(CHECKPOINT, STEPS):
        scale = 0.5 if step < CHECKPOINT + 2 else 1.0
        assert cooled[step] == pytest.approx(scale * plain[step], rel=1e-6), step
    losses = read_metrics(runs["cooldown"], "train/loss")
    assert losses[CHECKPOINT] == pytest.approx(read_metrics(runs["resumed-past"], "train/loss")[CHECKPOINT], rel=1e-6)
    assert losses[CHECKPOINT + 1] != pytest.approx(read_metrics(runs["resumed-past"], "train/loss")[CHECKPOINT + 1])


def test_a_cooldown_scales_the_learning_rate_from_the_restart_for_its_steps():
    detector = SpikeDetector(StabilityConfig(), [Rollback(30, 20, 400, lr_scale=0.1, cooldown_until=25)])
    assert [detector.lr_scale(step) for step in (19, 20, 24, 25)] == [1.0, 0.1, 0.1, 1.0]


@pytest.mark.parametrize(
    "setting, message",
    [
        ("stability.action=rewind", "stability.action=rewind is out of range: it must be log, skip or rollback"),
        ("stability.warmup_steps=200", "stability.warmup_steps=200 is more than stability.window=100"),
        ("stability.cooldown_lr_scale=0", "stability.cooldown_lr_scale=0 is out of range"),
    ],
)
def test_a_stability_setting_out_of_range_is_refused_before_the_run_starts(tiny_shards, tmp_path, setting, message):
    from hydra import compose, initialize_config_dir

    from project.config.checks import preflight
    from project.config.command_line import CONF
    from project.runtime.errors import ConfigError

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=train_overrides(tiny_shards, tmp_path, setting))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        preflight(cfg)


def numerics(run_dir) -> dict[str, dict[int, float]]:
    """{numerics/<layer>/<stat>: {step: value}} of a run."""
    with open(run_dir / "metrics.csv", newline="") as file:
        columns = [c for c in csv.DictReader(file).fieldnames or [] if c.startswith("numerics/")]
    return {column: read_metrics(run_dir, column) for column in columns}


@pytest.mark.parametrize("layout", [n for n in [*LAYOUTS, *SKIPPED_ONLY] if n != "single"])
def test_per_layer_numerics_of_a_sharded_layout_are_those_of_one_device(runs, layout):
    """Gradient and parameter norms, update ratios and output RMS of the embedding, each block and the head, at every
    numerics step: summed over shards, tensor-parallel slices and pipeline stages as one device computes them."""
    reference, figures = numerics(runs["s-single"]), numerics(runs[f"s-{layout}"])
    layers = ["embedding", "block0", "block1", "block2", "block3", "head"]
    stats = ["grad_norm", "param_norm", "update_ratio", "output_rms"]
    assert sorted(reference) == sorted(f"numerics/{layer}/{stat}" for layer in layers for stat in stats)
    assert sorted(figures) == sorted(reference)
    for column, values in reference.items():
        assert sorted(values) == sorted(figures[column]) == list(NUMERICS_STEPS), column
        for step, value in values.items():
            assert figures[column][step] == pytest.approx(value, rel=1e-4), (column, step)


def test_the_layers_gradient_norms_make_the_global_one_and_their_norms_the_checkpoints(runs):
    """Written out here: the squares of the layers' gradient norms add up to the logged global norm; the parameter
    norms at the resumed run's first step are those of the weights of the checkpoint it resumed from."""
    figures, norms = numerics(runs["s-single"]), read_metrics(runs["s-single"], "train/grad_norm")
    layers = ["embedding", *[f"block{i}" for i in range(4)], "head"]
    for step in NUMERICS_STEPS:
        total = math.sqrt(sum(figures[f"numerics/{layer}/grad_norm"][step] ** 2 for layer in layers))
        assert total == pytest.approx(norms[step], rel=1e-5), step
    weights = read_whole(runs["to-checkpoint"] / "checkpoints" / "last.ckpt")["state_dict"]

    def layer_of(name: str) -> str:
        parts = name.split(".")  # model.layers.3.attention.wq.weight, model.tok_embeddings.weight, model.norm.weight
        return {"tok_embeddings": "embedding", "layers": f"block{parts[2]}"}.get(parts[1], "head")

    squares: dict[str, float] = {}
    for name, value in weights.items():
        squares[layer_of(name)] = squares.get(layer_of(name), 0.0) + float(value.double().square().sum())
    resumed = numerics(runs["resumed-past"])
    for layer, square in squares.items():
        assert resumed[f"numerics/{layer}/param_norm"][CHECKPOINT] == pytest.approx(math.sqrt(square), rel=1e-6)


def test_a_rank_slowed_on_purpose_is_named_with_its_host_and_time(runs):
    ratios = read_metrics(runs["slow"], "train/step_time_max_over_min")
    assert ratios[STEPS - 1] > 2  # rank 1's blocks compute 20 ms more each
    log = (runs["slow"] / "train.log").read_text()
    host = re.escape(socket.gethostname())
    assert re.search(rf"rank 1 on {host} takes [\d.]+ ms per block forward", log), log[-3000:]
    assert "a straggler" in log


def test_a_rank_is_named_only_when_slow_in_two_logging_windows_in_a_row():
    """One window of jitter (a busy host tripling a tiny model's block time once) names no one; a rank slow in two
    windows in a row is named with the median of the others, and one that recovers is no longer named."""
    from project.training.callbacks.stragglers import SlowRanks

    judge, ms = SlowRanks(factor=2.0), 1e-3
    assert judge.named([1 * ms, 3.07 * ms]) == []  # the CI host's jitter of 2026-12-02, once
    assert judge.named([1 * ms, 1.1 * ms]) == []
    assert judge.named([1 * ms, 21 * ms]) == []
    assert judge.named([1 * ms, 21 * ms]) == [(1, 1 * ms)]
    assert judge.named([2 * ms, 21 * ms, 2 * ms]) == [(1, 2 * ms)]  # the median of the two others
    assert judge.named([2 * ms, 2 * ms, 2 * ms]) == []
    assert judge.named([0.1 * ms, 0.9 * ms]) == [] and judge.named([0.1 * ms, 0.9 * ms]) == []  # under 1 ms more


def test_a_stack_dump_names_the_innermost_call_of_the_main_thread(tmp_path):
    """faulthandler's own dump, taken from another thread while the main one loops in a known function."""
    from project.runtime.stacks import innermost_call

    done, dump = [], tmp_path / "dump.txt"  # a list, not an Event: its check runs no Python frame of its own,
    # so the dump always finds the main thread in looping_here (it once caught it inside Event.is_set)

    def dump_later() -> None:
        time.sleep(0.2)
        with open(dump, "w") as file:
            faulthandler.dump_traceback(file, all_threads=True)
        done.append(True)

    def looping_here() -> None:
        while not done:
            sum(range(100))

    threading.Thread(target=dump_later).start()
    looping_here()
    assert innermost_call("== a run starts\n" + dump.read_text()).startswith("looping_here (tests/test_stability.py:")


STOPPED_WHILE_THREADS_COME_AND_GO = """
import os, signal, sys, threading, time
from pathlib import Path
from project.runtime import console, stacks

console.keep_console(Path(sys.argv[1]), rank=0)
signal.signal(signal.SIGTERM, lambda *_: None)  # the run's own handler, which the dump chains to
stacks.dump_on_signal()

def come_and_go():  # threads that start, call a little and end, as a launcher's observer or a loader's do
    def nested(n):
        return n and nested(n - 1)
    while True:
        thread = threading.Thread(target=nested, args=(30,))
        thread.start()
        thread.join()

def stop_again_and_again():  # from a thread, as Lightning's observer stops the main process; the main thread waits
    while True:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.0005)

for _ in range(3):
    threading.Thread(target=come_and_go, daemon=True).start()
threading.Thread(target=stop_again_and_again, daemon=True).start()
time.sleep(1.5)  # without the interpreter's lock, as in a collective
"""


def test_a_stop_signal_writes_a_stack_without_crashing_while_other_threads_come_and_go(tmp_path):
    """A dump of every thread from inside the signal handler reads frames that other threads free meanwhile: this
    process died of SIGSEGV within a second every time that way (CPython 3.11); the main thread's alone is safe."""
    command = [sys.executable, "-c", STOPPED_WHILE_THREADS_COME_AND_GO, str(tmp_path)]
    ended = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert (tmp_path / "train.log").read_text().count("(most recent call first)") > 100


def test_a_lasting_rise_is_a_new_level_after_max_consecutive_spikes_steps_not_spikes_for_ever():
    """Under skip, a shift of the loss's level would otherwise withhold every later update."""
    detector = SpikeDetector(StabilityConfig(window=6, warmup_steps=4, threshold=5.0, max_consecutive_spikes=3))
    losses = [3.0 + 0.01 * (i % 2) for i in range(6)] + [6.0 + 0.01 * (i % 2) for i in range(10)]
    spikes = [bool(detector.observe(torch.tensor(loss), torch.tensor(1.0), step)) for step, loss in enumerate(losses)]
    assert spikes[6:9] == [True] * 3 and not any(spikes[9:])  # three spikes, then the new level's steps
    events = detector.read_events()
    assert [(int(e["step"]), e["shift"]) for e in events] == [(6, 0.0), (7, 0.0), (8, 0.0), (9, 1.0)]


def test_a_rollback_after_a_resume_counts_the_rollbacks_of_the_runs_before():
    """The resumed checkpoint's rollbacks, the one this process makes, and the checkpoint the restart loads (older
    than both, or holding the first): each rollback once, in order, and the budget counts them all."""
    from omegaconf import OmegaConf

    from project.training.run import restart_after
    from project.training.stability import RollbackRequested

    first = Rollback(spike_step=30, restart_step=20, resume_sample=320)
    detector = SpikeDetector(StabilityConfig(max_rollbacks=2), [first])  # as a resumed run's module holds it
    event = {"step": 45.0, "loss": 9.0, "grad_norm": 3.0, "loss_z": 40.0, "grad_norm_z": 2.0}
    spike = RollbackRequested(event, 456, 8, set(), detector)
    cfg = OmegaConf.create({"stability": vars(StabilityConfig(max_rollbacks=2)), "ckpt_path": None})
    restart = restart_after(cfg, Path("/nonexistent-run-dir"), spike, None)
    assert [r.spike_step for r in restart.rollbacks] == [30, 45]
    # The restarted module is given both, then loads a checkpoint that knew only the first (or none).
    resumed = SpikeDetector(StabilityConfig(max_rollbacks=2), [vars(r) for r in restart.rollbacks])
    resumed.load_state_dict({"rollbacks": [vars(first)]})
    assert [r.spike_step for r in resumed.rollbacks] == [30, 45]
    with pytest.raises(TrainingStopped, match=r"a new incident after 2 .*spikes at steps 30, 45"):
        escalate(resumed.config, resumed.rollbacks, {**event, "step": 70.0}, 60, resumed.record)


def test_a_checkpoint_mid_rise_keeps_the_count_of_steps_above_the_band():
    config = StabilityConfig(window=8, warmup_steps=4, threshold=5.0, max_consecutive_spikes=3)
    losses = [3.0 + 0.01 * (i % 2) for i in range(6)] + [6.0] * 6
    whole, first = SpikeDetector(config), SpikeDetector(config)
    flags = [bool(whole.observe(torch.tensor(loss), torch.tensor(1.0), step)) for step, loss in enumerate(losses)]
    for step, loss in enumerate(losses[:8]):  # two steps into the rise
        first.observe(torch.tensor(loss), torch.tensor(1.0), step)
    resumed = SpikeDetector(config)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    later = [bool(resumed.observe(torch.tensor(loss), torch.tensor(1.0), step)) for step, loss in enumerate(losses)][8:]
    assert later == flags[8:] and flags[6:10] == [True, True, True, False]


def test_overlapping_cooldowns_do_not_compound():
    detector = SpikeDetector(StabilityConfig(), [Rollback(30, 20, 400, 0, 0.1, 40), Rollback(35, 25, 480, 0, 0.5, 45)])
    assert [detector.lr_scale(step) for step in (22, 30, 42, 45)] == [0.1, 0.1, 0.5, 1.0]


def test_a_step_whose_gradient_norm_alone_is_out_is_called_a_gradient_norm_spike_not_a_loss_spike():
    """Acted on (act_on_grad_norm=true), the warning of each action, the rollback's and the stop say which of the two
    is out."""
    from omegaconf import OmegaConf

    from project.training.run import restart_after
    from project.training.stability import RollbackRequested

    config = StabilityConfig(window=6, warmup_steps=4, threshold=5.0, max_rollbacks=0, act_on_grad_norm=True)
    detector = SpikeDetector(config)
    for step in range(8):
        wobble = 0.01 * (step % 2)
        detector.observe(torch.tensor(3.0 + wobble), torch.tensor(1.0 + wobble + 9.0 * (step == 7)), step)
    with pytest.warns(UserWarning) as said:
        detector.report("log")
    [message] = [str(w.message) for w in said]
    assert message.startswith("step 7: loss 3.01 (") and message.endswith(
        " sd): a gradient-norm spike (the loss within its band); training goes on (stability.action=log)."
    )
    event = {"step": 7.0, "loss": 3.0, "grad_norm": 10.0, "loss_z": 0.5, "grad_norm_z": 900.0}
    spike = RollbackRequested(event, 64, 8, set(), SpikeDetector(replace(config, max_rollbacks=1)))
    cfg = OmegaConf.create({"stability": vars(replace(config, max_rollbacks=1)), "ckpt_path": None})
    with pytest.warns(UserWarning, match=r"\(\+900.0 sd\): a gradient-norm spike \(the loss within its band\); roll"):
        restart_after(cfg, Path("/nonexistent-run-dir"), spike, None)
    with pytest.raises(TrainingStopped, match=r"sd\): a gradient-norm spike \(the loss within its band\), a new "):
        escalate(config, [], event, 0, detector.record)
    both = {**event, "loss_z": 50.0}
    with pytest.raises(TrainingStopped, match=r"sd\): a spike of the loss and the gradient norm, a new incident"):
        escalate(config, [], both, 0, detector.record)


def test_ten_rollbacks_in_one_process_release_what_each_fit_held(runs):
    """Each rollback builds the strategy, its process groups and meshes, the loaders and the callbacks again in the
    same process: what the fit before it held (the groups' sockets and native threads, files, Python threads) is
    released, so that the tenth fit starts holding what the second did (the first has not yet made what every fit
    keeps for the process: the shared gloo group of the stop signal, compiled kernels' pools)."""
    run_dir = runs["ten-rollbacks"]
    assert len(spike_records(run_dir)) == 10
    for rank in range(2):
        starts = [json.loads(line) for line in (run_dir / "resources" / f"rank{rank}.jsonl").read_text().splitlines()]
        steps = [s["step"] for s in starts]  # the first fit's, then each restart's: from a newer checkpoint each
        assert len(steps) == 11 and steps[0] == 0 and all(a < b for a, b in zip(steps, steps[1:])), steps
        held = [{k: s[k] for k in ("fds", "threads", "python_threads")} for s in starts]
        assert all(h == held[1] for h in held[1:]), (rank, held)


def test_a_compiled_blocks_timing_runs_at_its_edges_without_warnings():
    """strategy.compile traces a block's hooks with its forward: the straggler watch's clock is run outside the trace
    (torch.compile would warn at each block that it cannot trace it). In a process of its own: torch warns once per
    process."""
    code = """
import warnings, torch
from project.training.callbacks.stragglers import StragglerWatch
watch = StragglerWatch()
block = torch.nn.Linear(8, 8)
block.register_forward_pre_hook(lambda *_: watch._start(False))
block.register_forward_hook(lambda *_: watch._end(False))
block.compile()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    block(torch.randn(2, 8))
    block(torch.randn(2, 8))
assert [str(w.message) for w in caught] == [] and watch._forwards == 2 and watch._seconds > 0, caught
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

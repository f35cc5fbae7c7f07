"""No step waits outside logging steps: the training path of a step that does not log converts no tensor to a Python
value (on a GPU each conversion drains the queue of launched kernels) and calls no collective from the host (each
makes every rank wait for the slowest, milliseconds at hundreds of ranks), under every strategy, with every callback
and option that acts during steps on."""

import json

import pytest
from conftest import train_overrides

pytestmark = pytest.mark.slow

# Under rollback the host reads the spike flag where it waits anyway; a threshold no step reaches keeps it training.
ROLLBACK = ["stability=rollback", "stability.threshold=1000"]
LAYOUTS = {
    "single": (1, ROLLBACK),
    "ddp": (2, ["strategy=ddp", "trainer.devices=2", *ROLLBACK]),
    "fsdp2": (2, ["strategy=fsdp2", "trainer.devices=2", *ROLLBACK]),
    "tp": (2, ["strategy=tp", "trainer.devices=2", "stability=skip"]),
    "pipeline": (
        2,
        ["strategy=pipeline", "trainer.devices=2", "model.n_layers=4", "micro_batch_size=2", "stability=skip"],
    ),
}
# Logging steps 2 and 5 (log_every_n_steps=3, and the last); checkpoints and validation only after the last. Every
# callback and option that acts during steps is on: the stop signal and the saves by time (decided at logging steps
# and every ckpt_check_every_n_steps=10), the non-finite guard, spikes (rollback or skip), numerics at step 5, slow
# ranks, early stopping, the learning-rate monitor, a loader worker.
RUN = ["trainer.max_steps=6", "trainer.log_every_n_steps=3", "ckpt_every_n_steps=100", "val_every_n_steps=100",
       "ckpt_every_minutes=1000", "global_batch_size=8", "trainer.enable_progress_bar=true",
       "optim.max_skipped_steps=1", "stability.warmup_steps=2", "stability.numerics_every_n_steps=6",
       "callbacks=[early_stopping,lr_monitor]", "data.loader_workers=1"]  # fmt: skip


@pytest.fixture(scope="module")
def counted(tiny_shards, tmp_path_factory):
    from in_process import train_in_process

    runs = {}
    for name, (devices, layout) in LAYOUTS.items():
        run_dir = tmp_path_factory.mktemp(f"conversions-{name}")
        counter = ["+callbacks.conversions._target_=benchmarks.count_conversions.CountConversions",
                   f"+callbacks.conversions.output_dir={run_dir}"]  # fmt: skip
        runs[name] = (devices, run_dir, train_overrides(tiny_shards, run_dir, *RUN, *layout, *counter))
    for devices in (1, 2):
        train_in_process(devices, [(d, o) for n, (k, d, o) in runs.items() if k == devices])
    return {name: (devices, run_dir) for name, (devices, run_dir, _) in runs.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_that_does_not_log_waits_neither_for_the_device_nor_for_the_other_ranks(counted, layout):
    devices, run_dir = counted[layout]
    for rank in range(devices):
        record = json.loads((run_dir / "conversions" / f"rank{rank}.json").read_text())
        counts = {int(step): n for step, n in record["counts"].items()}
        collectives = {int(step): n for step, n in record["collectives"].items()}
        assert sorted(counts) == sorted(collectives) == list(range(6)) and record["logging_steps"] == [2, 5]
        quiet = {step: n for step, n in counts.items() if step not in (2, 5)}
        if layout == "pipeline":  # the first step finds the stages' shapes, and torch's stages agree on them
            first_step = ("meta: list[int] = header.tolist()", "schedule.step(")
            assert all(where.endswith(first_step) for where in record["where"].get("0", [])), record
            del quiet[0]
        assert all(n == 0 for n in quiet.values()), (rank, quiet, record["where"])
        quiet_collectives = {step: n for step, n in collectives.items() if step not in (2, 5)}
        assert all(n == 0 for n in quiet_collectives.values()), (rank, quiet_collectives, record["collectives_where"])
        if rank == 0:  # the counter counts: a logging step reads the loss, the norm and the skip count
            assert counts[2] > 0 and counts[5] > 0, counts
        if devices > 1:  # and the ranks reduce the logged metrics and agree on a stop or a save
            assert collectives[2] > 0 and collectives[5] > 0, collectives

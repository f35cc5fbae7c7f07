"""No step waits for the device outside logging steps: the training path of a step that does not log converts no
tensor to a Python value (on a GPU each conversion drains the queue of launched kernels), under every strategy."""

import json

import pytest
from conftest import train_overrides

pytestmark = pytest.mark.slow

LAYOUTS = {
    "single": (1, []),
    "ddp": (2, ["strategy=ddp", "trainer.devices=2"]),
    "fsdp2": (2, ["strategy=fsdp2", "trainer.devices=2"]),
    "tp": (2, ["strategy=tp", "trainer.devices=2"]),
    "pipeline": (2, ["strategy=pipeline", "trainer.devices=2", "model.n_layers=4", "micro_batch_size=2"]),
}
# Logging steps 2 and 5 (log_every_n_steps=3, and the last); checkpoints and validation only after the last.
RUN = ["trainer.max_steps=6", "trainer.log_every_n_steps=3", "ckpt_every_n_steps=100", "val_every_n_steps=100",
       "global_batch_size=8", "trainer.enable_progress_bar=true", "optim.max_skipped_steps=1",
       "stability=skip", "stability.warmup_steps=2", "stability.numerics_every_n_steps=6"]  # fmt: skip


@pytest.fixture(scope="module")
def counted(tiny_shards, tmp_path_factory):
    from in_process import train_in_process

    runs = {}
    for name, (devices, layout) in LAYOUTS.items():
        run_dir = tmp_path_factory.mktemp(f"conversions-{name}")
        counter = ["+callbacks.conversions._target_=project.tooling.conversions.CountConversions",
                   f"+callbacks.conversions.output_dir={run_dir}"]  # fmt: skip
        runs[name] = (devices, run_dir, train_overrides(tiny_shards, run_dir, *RUN, *layout, *counter))
    for devices in (1, 2):
        train_in_process(devices, [(d, o) for n, (k, d, o) in runs.items() if k == devices])
    return {name: (devices, run_dir) for name, (devices, run_dir, _) in runs.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_step_that_does_not_log_reads_nothing_off_the_device(counted, layout):
    devices, run_dir = counted[layout]
    for rank in range(devices):
        record = json.loads((run_dir / "conversions" / f"rank{rank}.json").read_text())
        counts = {int(step): n for step, n in record["counts"].items()}
        assert sorted(counts) == list(range(6)) and record["logging_steps"] == [2, 5]
        quiet = {step: n for step, n in counts.items() if step not in (2, 5)}
        if layout == "pipeline":  # torch's schedule exchanges the stages' shapes once, in its first step
            assert all(where.endswith("self._pipeline.step(") for where in record["where"].get("0", [])), record
            del quiet[0]
        assert all(n == 0 for n in quiet.values()), (rank, quiet, record["where"])
        if rank == 0:  # the counter counts: a logging step reads the loss, the norm and the skip count
            assert counts[2] > 0 and counts[5] > 0, counts

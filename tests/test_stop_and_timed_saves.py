"""The ranks agree on a stop signal and on a save by time (ckpt_every_minutes, rank 0's clock) only at the steps where
they decide whether to save (StepCheckpoint.decides_at: every ckpt_check_every_n_steps-th step and every logging step),
so that no other step holds a collective on the host: a SIGTERM that reaches one rank still stops every rank at the same
step, saved, within ckpt_check_every_n_steps steps of the step under way, and a save by time comes on every rank at the
same step. Two ranks in process (tests/in_process.py); tests/test_faults.py proves the stop's exit status and the exact
resume end to end. A signal received before a rollback restarts the fit still stops the restarted one."""

import json

import pytest
from conftest import train_overrides

from project.checkpoint.files import checkpoint_step

pytestmark = pytest.mark.slow

CHECK_EVERY, SIGNAL_STEP, STEPS = 4, 4, 12
# Decisions at steps 3, 7 and 11 ((step + 1) a multiple of 4; the only logging step is the last, 11).
DECISION_STEPS = [s for s in range(STEPS) if (s + 1) % CHECK_EVERY == 0 or s == STEPS - 1]


@pytest.fixture(scope="module")
def stopped(tiny_shards, tmp_path_factory):
    from in_process import train_in_process

    run_dir = tmp_path_factory.mktemp("stopped")
    overrides = [
        "strategy=ddp", "trainer.devices=2", f"trainer.max_steps={STEPS}", f"trainer.log_every_n_steps={STEPS}",
        "global_batch_size=8", "ckpt_every_n_steps=1000", "val_every_n_steps=1000", "ckpt_every_minutes=1e-8",
        f"ckpt_check_every_n_steps={CHECK_EVERY}", "+callbacks.probe._target_=tests.stop_probe.StopProbe",
        f"+callbacks.probe.output_dir={run_dir}", f"+callbacks.probe.signal_step={SIGNAL_STEP}",
        "+callbacks.probe.signal_rank=1",
    ]  # fmt: skip
    train_in_process(2, [(run_dir, train_overrides(tiny_shards, run_dir, *overrides))])
    return run_dir, [json.loads((run_dir / "probe" / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_within_the_bound(stopped):
    run_dir, ranks = stopped
    last_step = next(s for s in DECISION_STEPS if s >= SIGNAL_STEP)  # the first decision from the signal's step on
    assert last_step - SIGNAL_STEP <= CHECK_EVERY
    for record in ranks:
        assert record["stopped_for_requeue"] and record["ended_at"] == last_step + 1, ranks
        assert record["saves"][-1] == last_step + 1, ranks  # saved after the stop's step, then stopped
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == last_step + 1


def test_a_save_by_time_comes_at_the_same_decision_steps_on_every_rank(stopped):
    """Every step ends long after the last save (1e-8 minutes), but the saves come at decision steps only, on rank 1
    too, whose own clock was made never due: rank 0's decides."""
    _, ranks = stopped
    expected = [s + 1 for s in DECISION_STEPS if s <= next(s for s in DECISION_STEPS if s >= SIGNAL_STEP)]
    # Steps of the saves: last.ckpt's, and the best checkpoint's after the validation that ends a stopped fit.
    assert sorted(set(ranks[0]["saves"])) == sorted(set(ranks[1]["saves"])) == expected, ranks


def test_a_signal_received_before_a_rollback_stops_the_fit_that_restarts():
    """A rollback ends the fit with an exception and builds the callbacks anew (project.training.run): a signal the
    ended fit had received, but not yet acted on, is handed on to the next one's StopOnSignal."""
    import signal

    from project.training.callbacks.preemption import StopOnSignal

    ended, restarted = StopOnSignal(checkpoint=None), StopOnSignal(checkpoint=None)  # type: ignore[arg-type]
    ended.setup(None, None, "fit")  # type: ignore[arg-type]  # the handler only: no trainer needed
    try:
        signal.raise_signal(signal.SIGTERM)
        ended.on_exception(None, None, RuntimeError("a rollback"))  # type: ignore[arg-type]
        restarted.setup(None, None, "fit")  # type: ignore[arg-type]
        assert restarted._signalled == signal.SIGTERM and StopOnSignal._handed_on is None
    finally:
        restarted.teardown(None, None, "fit")  # type: ignore[arg-type]
        ended.teardown(None, None, "fit")  # type: ignore[arg-type]


def test_a_signal_an_earlier_run_of_the_process_handed_on_does_not_stop_the_next_run(monkeypatch, tmp_path):
    """A run whose last fit ended in an exception after a signal leaves it handed on; the next run the same process
    starts (a sweep's next job, a notebook's next cell) begins without it."""
    import signal

    from project.training import run
    from project.training.callbacks.preemption import StopOnSignal

    seen = []
    monkeypatch.setattr(run, "fit_once", lambda *args: seen.append(StopOnSignal._handed_on) or {})
    monkeypatch.setattr(StopOnSignal, "_handed_on", signal.SIGTERM)  # what the earlier run left
    run.fit(None, tmp_path, None)  # type: ignore[arg-type]
    assert seen == [None]


def test_a_first_ctrl_c_asks_for_the_stop_and_a_second_stops_at_once():
    """SIGINT is a stop signal like SIGTERM (saved at the next decision step); the second SIGINT raises
    KeyboardInterrupt, which Lightning turns into an immediate stop. A repeated SIGTERM only asks again."""
    import signal

    from project.training.callbacks.preemption import StopOnSignal

    before = signal.getsignal(signal.SIGINT)
    stop = StopOnSignal(checkpoint=None, signums=(signal.SIGTERM, signal.SIGINT))  # type: ignore[arg-type]
    stop.setup(None, None, "fit")  # type: ignore[arg-type]  # the handlers only: no trainer needed
    try:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert stop._signalled == signal.SIGTERM
        signal.raise_signal(signal.SIGINT)
        assert stop._signalled == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.teardown(None, None, "fit")  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGINT) is before  # put back as it was

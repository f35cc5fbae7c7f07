"""Rank 0 names the child rank whose end broke a collective: the one a signal killed before those that failed after."""

import io
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr
from types import SimpleNamespace

from project.runtime import processes


def fake_launcher(procs):
    return SimpleNamespace(
        procs=procs, num_processes=len(procs) + 1, cluster_environment=SimpleNamespace(node_rank=lambda: 1)
    )


def test_a_child_killed_by_a_signal_is_named_before_one_that_failed_after_it(tmp_path, monkeypatch):
    monkeypatch.setattr(processes, "world", lambda: (0, 8))  # rank 0 of a 2-node, 8-rank run
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    killed = subprocess.Popen(["sleep", "30"])
    running = subprocess.Popen(["sleep", "30"])
    try:
        killed.send_signal(signal.SIGKILL)
        failed.wait(), killed.wait()
        processes.watch_children(fake_launcher([failed, running, killed]))
        # Node 1 of 4-rank nodes: local ranks 1, 2, 3 are global ranks 5, 6, 7.
        assert processes.ended_children(wait_seconds=1) == [(7, killed.pid, -9), (5, failed.pid, 1)]
        error = RuntimeError("[gloo] Connection reset by peer")
        printed = io.StringIO()
        with redirect_stderr(printed):
            processes.report_failed_rank(error, tmp_path)
        assert "because rank 7 (PID %d) ended: killed by SIGKILL" % killed.pid in printed.getvalue()
        assert "rank 5 (PID %d) exited with status 1 too" % failed.pid in printed.getvalue()
    finally:
        running.kill()
        running.wait()
        processes.watch_children(None)


def test_without_an_ended_child_it_waits_its_time_and_names_none():
    running = subprocess.Popen(["sleep", "30"])
    try:
        processes.watch_children(fake_launcher([running]))
        start = time.monotonic()
        assert processes.ended_children(wait_seconds=0.5) == []
        assert time.monotonic() - start >= 0.5
    finally:
        running.kill()
        running.wait()
        processes.watch_children(None)

"""A run that hangs under a test fails the test with the stacks of the processes it left, not a bare timeout."""

import pytest

from tests.conftest import run_module


def test_a_run_past_its_timeout_fails_with_the_python_stack_of_each_of_its_processes():
    # http.server serves until it is stopped: a stand-in for a run that stopped progressing.
    with pytest.raises(pytest.fail.Exception) as failure:
        run_module("http.server", ["0", "--bind", "127.0.0.1"], timeout=3)
    message = str(failure.value)
    assert "was still running after 3 s" in message
    assert "serve_forever" in message and "most recent call first" in message  # faulthandler's dump of the main thread

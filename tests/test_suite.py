"""The test suite's own machinery: what `make test` relies on to share runs between tests."""

import pytest


def test_the_workers_keep_each_group_of_tests_together(request):
    # tests/conftest.py gives every test a group (the shared runs it reads, else its file), so that a session's
    # runs are trained once, on one worker; pytest-xdist honours the groups only when the node id carries them.
    if not getattr(request.config.option, "loadgroup", False):  # set on the workers of --dist loadgroup
        pytest.skip("checks make test's workers (pytest-xdist with --dist loadgroup)")
    assert request.node.nodeid.endswith("@tests/test_suite.py"), request.node.nodeid

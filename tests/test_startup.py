"""project.startup: the collector pause that shortens a command's imports."""

import gc

from project.startup import collector_paused_for_imports


def test_imports_run_with_the_collector_paused_and_what_they_left_is_frozen():
    try:
        with collector_paused_for_imports():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]  # stands in for what an import leaves
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(made)
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with collector_paused_for_imports():
            pass
        assert not gc.isenabled()
    finally:
        gc.unfreeze()
        gc.enable()

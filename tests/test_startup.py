"""project.runtime.startup: the collector pause that shortens a command's imports."""

import gc
import importlib
import subprocess
import sys

import pytest
from conftest import ROOT

from project.runtime import startup


@pytest.fixture
def first_use():
    """As in a fresh process, nothing frozen yet; the collector as it was, afterwards."""
    gc.unfreeze()
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.enable() if enabled else gc.disable()


def test_imports_run_with_the_collector_paused_and_what_they_left_is_frozen(first_use):
    before = gc.get_freeze_count()
    with startup.collector_paused_for_imports():
        assert not gc.isenabled()
        made = [[] for _ in range(1000)]  # stands in for what an import leaves
    assert gc.isenabled()
    assert gc.get_freeze_count() >= before + len(made)


def test_only_the_first_use_pauses_and_freezes(first_use):
    with startup.collector_paused_for_imports():
        pass
    frozen = gc.get_freeze_count()
    with startup.collector_paused_for_imports():  # a multirun's next job
        assert gc.isenabled()
        left_by_the_last_job = [[] for _ in range(1000)]
    # Not more frozen: a second freeze would take the 1000 lists made above. (Not `==`: another thread of the
    # pytest worker, a finished run's stream reader, may free frozen objects meanwhile.)
    assert gc.get_freeze_count() <= frozen and left_by_the_last_job


def test_a_failed_import_leaves_the_collector_on_and_freezes_nothing(first_use):
    before = gc.get_freeze_count()
    with pytest.raises(ImportError):
        with startup.collector_paused_for_imports():
            importlib.import_module("no_such_module")
    assert gc.isenabled() and gc.get_freeze_count() == before


def test_a_collector_that_was_off_stays_off(first_use):
    gc.disable()
    with startup.collector_paused_for_imports():
        pass
    assert not gc.isenabled()


def test_training_module_leaves_torch_pipelining_unimported():
    """Only strategy=pipeline needs it (Hydra's instantiate imports it then): 0.05 s of every other start."""
    code = (
        "import sys, project.training.run; "
        "print('project.parallel.strategies.pipeline' in sys.modules, 'torch.distributed.pipelining' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]

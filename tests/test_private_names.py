"""The private names of other libraries the platform still depends on, each with its reason, in one place.

Each has a public alternative looked for and not found (or found wanting, as said). One test per name: a library
upgrade that renames or removes one fails the test named after it, not a training run. When an upstream API
appears, switch to it and delete the row.
"""

import importlib

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

from project.checkpoint.files import LIGHTNING_EXTRA

# (where it lives, the name, where we use it, why no public name serves)
ATTRIBUTES = [
    (
        ModelCheckpoint,
        "_save_checkpoint",
        "training/callbacks/checkpoint.py (BestCheckpoint)",
        "a best checkpoint the storage refuses (a full disk, a missing bucket) is one error paragraph with what was "
        "half written removed; the path is known only inside the write, and Lightning has no public hook around it",
    ),
    (
        ModelCheckpoint,
        "_remove_checkpoint",
        "training/callbacks/checkpoint.py",
        "the best checkpoint a better one replaces is removed only once the better one's background write has ended "
        "(ckpt_async); Lightning removes it as soon as the save returns, with no public hook between",
    ),
    (
        _TrainingEpochLoop,
        "_broadcast_sigterm_tensor",
        "training/callbacks/preemption.py",
        "Lightning broadcasts its SIGTERM flag and reads it on the host before every batch of a multi-process run, "
        "a wait for the device every step (Lightning#21487; #21640 would make it every n steps); the flag is set by "
        "Lightning's handler alone, which StopOnSignal replaces, so the broadcast is left out",
    ),
    (
        ModelParallelStrategy,
        "_setup_distributed",
        "parallel/strategies/model_parallel.py (for the pipeline's too)",
        "the process group without ModelParallelStrategy's own mesh, which it makes anew for every fit (a rollback "
        "would keep each fit's groups: parallel/groups.py), and which is 2-D (the pipeline's is 3-D)",
    ),
    (
        DTensor,
        "__create_chunk_list__",
        "checkpoint/reshard.py",
        "a rank's piece of a DTensor (offsets and sizes), as torch's distributed checkpoint reads it, to cut from a "
        "memory-mapped checkpoint file; the public distribute_tensor takes the whole tensor to the device first",
    ),
]
# Names set on instances, so checked on one.
INSTANCE_ATTRIBUTES = [
    (
        lambda: ModelParallelStrategy(),
        "_device_mesh",
        "parallel/strategies/model_parallel.py (set_up_meshes, for the pipeline and the dry run too)",
        "the strategy's device_mesh property is read-only; the strategies set the process's shared mesh "
        "(parallel/groups.py), a view of the run's MeshShape (the pipeline's 3-D), on a fake process group in a dry "
        "run",
    ),
    (
        lambda: WandbLogger(project="p", mode="disabled"),
        "_wandb_init",
        "training/loggers.py",
        "drops the `anonymous` argument Lightning always passes, which wandb 0.31 warns about on every run",
    ),
]
# Module-level functions and classes.
FUNCTIONS = [
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        "parallel/recompute.py",
        "torch's activation checkpointing of a module, as torchtitan and Lightning's FSDP apply it; its composable "
        "counterpart (torch.distributed._composable.checkpoint) is private too, and torch.utils.checkpoint is public "
        "only as a function, which would have to replace the block's forward",
    ),
    (
        "torch.utils._python_dispatch",
        "TorchDispatchMode",
        "benchmarks/count_collectives.py (beside the product, not in it)",
        "counts every collective with its bytes as it is dispatched (c10d operators, DDP's reducer from C++ and "
        "DTensor's functional collectives alike); torch's public CommDebugMode, built on it, counts calls only and "
        "leaves sends and receives out",
    ),
    (
        "torch.testing._internal.distributed.fake_pg",
        "FakeStore",
        "planning/dry_run.py",
        "importing it registers torch's 'fake' process-group backend (collectives that do nothing), which shards a "
        "model for a 512-rank job in one CPU process; torch.distributed has no public fake backend",
    ),
]


# What each callable is called with, or overrides: a release that keeps the name but changes its arguments fails
# here, not in a run. Names absent take no arguments we rely on beyond the name.
PARAMETERS = {
    "_save_checkpoint": ["self", "trainer", "filepath"],
    "_remove_checkpoint": ["self", "trainer", "filepath"],
    "_broadcast_sigterm_tensor": ["self"],
    "_setup_distributed": ["self"],
    "__create_chunk_list__": ["self"],
    "checkpoint_wrapper": ["module", "checkpoint_impl", "checkpoint_fn", "checkpoint_fn_kwargs"],
}
# What each attribute we read or set holds on a new instance.
HOLDS = {
    "_device_mesh": type(None),
}


def parameters_of(function) -> list[str]:
    import inspect

    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize(("owner", "name"), [(o, n) for o, n, *_ in ATTRIBUTES], ids=[r[1] for r in ATTRIBUTES])
def test_a_private_method_we_override_or_call_still_exists_with_its_arguments(owner, name):
    assert hasattr(owner, name), f"{owner.__module__}.{owner.__qualname__}.{name} is gone: see the row's reason"
    assert parameters_of(getattr(owner, name)) == PARAMETERS[name]


@pytest.mark.parametrize(
    ("build", "name"), [(b, n) for b, n, *_ in INSTANCE_ATTRIBUTES], ids=[r[1] for r in INSTANCE_ATTRIBUTES]
)
def test_a_private_attribute_we_read_or_set_still_exists_and_holds_what_we_expect(build, name):
    value = getattr(build(), name)
    if name in PARAMETERS:
        assert parameters_of(value) == PARAMETERS[name]
    elif name == "_wandb_init":  # the keyword arguments Lightning hands wandb.init; we drop `anonymous`
        assert isinstance(value, dict) and "anonymous" in value
    else:
        assert isinstance(value, HOLDS[name])


@pytest.mark.parametrize(("module", "name"), [(m, n) for m, n, *_ in FUNCTIONS], ids=[r[1] for r in FUNCTIONS])
def test_a_private_function_we_import_still_exists_with_its_arguments(module, name):
    found = getattr(importlib.import_module(module), name, None)
    assert found is not None
    if name in PARAMETERS:
        assert parameters_of(found) == PARAMETERS[name]


def test_litdatas_obstore_client_options_are_still_the_dict_its_s3_stores_are_built_with():
    # project/data/storage.py adds allow_http to litdata's one set of obstore client options for an http://
    # endpoint (a MinIO in a cluster, the tests' S3 server on loopback): no public option reaches obstore's client.
    import inspect

    from litdata.streaming import downloader

    assert isinstance(downloader._OBSTORE_CLIENT_OPTIONS, dict)
    assert "client_options=_OBSTORE_CLIENT_OPTIONS" in inspect.getsource(downloader)


@pytest.mark.parametrize("name", ["torch.utils._pytree", "torch.distributed.tensor._redistribute"])
def test_the_private_torch_modules_whose_loggers_we_quiet_still_log_under_their_names(name):
    # project/runtime/console.py (and parallel/float8.py) filter known noise from these modules' loggers by name:
    # a module renamed would let the noise through again, so it fails here.
    module = importlib.import_module(name)
    assert module.__name__ == name and "getLogger(__name__)" in open(module.__file__).read()


def test_the_lightning_metadata_file_of_a_sharded_checkpoint_is_named_as_we_read_it():
    # project.checkpoint.files reads the non-tensor state of a sharded folder from this file by name.
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    assert LIGHTNING_EXTRA == _METADATA_FILENAME


def test_torch_lr_schedulers_still_read_the_flag_horovod_optimizers_lack():
    # parallel/strategies/horovod.py sets _opt_called on the module's optimizer, which Horovod's optimizer wraps and
    # which never steps itself: torch's LRScheduler reads the flag, and without it every run warns that
    # scheduler.step() came before optimizer.step().
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    optimizer.step()
    assert getattr(optimizer, "_opt_called", False) is True
    scheduler.step()


def test_torch_fused_adamw_still_withholds_its_update_when_given_the_found_inf_flag():
    # training/nonfinite.py sets `found_inf` on a fused Adam(W), the flag torch's GradScaler gives it (an attribute its
    # step reads, not an argument): a step whose gradient norm is not finite is then withheld on the device, without
    # the host reading the norm. tests/test_nonfinite.py checks the whole guard; this, that torch still reads the flag.
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.full((3,), float("nan"))
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(3)) and int(optimizer.state[weight]["step"]) == 0

"""Checkpoint file handling: optimizer state keys across formats, and saves that cannot lose last.ckpt."""

import os

import pytest
import torch

from project.checkpoint.files import previous_checkpoint, resolve_ckpt_path, swap_in
from project.checkpoint.reshard import by_name, by_position, read_whole
from project.runtime.errors import ConfigError
from project.training.lit_module import LlamaLitModule
from tests.conftest import run_train

MODEL = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 16}


def stepped_module() -> tuple[LlamaLitModule, torch.optim.Optimizer]:
    module = LlamaLitModule(model=MODEL, optim={"lr": 1e-3, "warmup_steps": 0, "decay_steps": 10})
    optimizer = torch.optim.AdamW(
        [{"params": [p for _, p in group], "weight_decay": decay} for decay, group in module.decay_groups()]
    )
    module.model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    return module, optimizer


def order_of(module: LlamaLitModule) -> list[str]:
    return module.optimizer_order()


def test_optimizer_state_keyed_by_name_follows_the_optimizer_order_not_the_module_order():
    module, optimizer = stepped_module()
    named = by_name(optimizer.state_dict(), order_of(module))
    shapes = dict(module.named_parameters())
    assert set(named["state"]) == set(shapes)
    for name, state in named["state"].items():
        assert state["exp_avg"].shape == shapes[name].shape, name  # norms and matrices interleave in module order
    assert named["param_groups"][1]["params"] == [n for n in shapes if n.endswith("norm.weight")]


def test_optimizer_state_round_trips_between_name_and_position_keys():
    module, optimizer = stepped_module()
    positions = optimizer.state_dict()
    back = by_position(by_name(positions, order_of(module)), order_of(module))
    assert back["param_groups"] == positions["param_groups"]
    for i, state in positions["state"].items():
        torch.testing.assert_close(back["state"][i], state, rtol=0, atol=0)


def test_optimizer_state_of_another_model_is_refused_by_name():
    module, optimizer = stepped_module()
    with pytest.raises(ConfigError, match="holds 21 parameters, this model 3"):
        by_name(optimizer.state_dict(), order_of(module)[:3])
    with pytest.raises(ConfigError, match="holds state for model.norm.weight, which this model lacks"):
        by_position(by_name(optimizer.state_dict(), order_of(module)), order_of(module)[:-1])


def test_a_file_read_whole_gives_lightning_its_positions_whatever_the_file_keys_by(tmp_path):
    module, optimizer = stepped_module()
    path = tmp_path / "by-name.ckpt"
    named = by_name(optimizer.state_dict(), order_of(module))  # as a sharded strategy's single file keys it
    torch.save({"state_dict": module.state_dict(), "optimizer_states": [named]}, path)
    whole = read_whole(path, module.optimizer_order())
    assert whole["optimizer_states"][0]["param_groups"] == optimizer.state_dict()["param_groups"]
    torch.testing.assert_close(whole["optimizer_states"][0]["state"], optimizer.state_dict()["state"])


def test_a_saved_folder_replaces_the_previous_one_whole(tmp_path):
    target, staged = tmp_path / "last.ckpt", tmp_path / "last.ckpt.partial"
    target.mkdir()
    (target / "__2_0.distcp").write_text("a shard of the old layout")
    staged.mkdir()
    (staged / "__0_0.distcp").write_text("new")
    swap_in(staged, target)
    assert [p.name for p in target.iterdir()] == ["__0_0.distcp"]
    assert not staged.exists() and previous_checkpoint(target) is None


def test_a_saved_file_replaces_the_previous_one(tmp_path):
    target, staged = tmp_path / "last.ckpt", tmp_path / "last.ckpt.partial"
    target.write_text("old")
    staged.write_text("new")
    swap_in(staged, target)
    assert target.read_text() == "new" and not staged.exists()


def test_resume_finds_the_checkpoint_a_run_killed_mid_swap_had_moved_aside(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "last.ckpt.old").mkdir()  # renamed away; the new folder never arrived
    (checkpoints / "last.ckpt.partial").mkdir()
    assert resolve_ckpt_path("last", checkpoints) == str(checkpoints / "last.ckpt.old")
    staged = checkpoints / "last.ckpt.partial"
    (staged / "__0_0.distcp").write_text("new")
    swap_in(staged, checkpoints / "last.ckpt")  # the resumed run's first save clears it up
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]


def test_a_checkpoint_of_the_other_format_is_kept_under_another_name(tmp_path):
    target, staged = tmp_path / "last.ckpt", tmp_path / "last.ckpt.partial"
    target.mkdir()  # a sharded run's folder ...
    (target / "__0_0.distcp").write_text("sharded")
    staged.write_text("file")  # ... and now a single-device run's file
    kept = swap_in(staged, target)
    assert kept == tmp_path / "last-sharded.ckpt" and (kept / "__0_0.distcp").read_text() == "sharded"
    assert target.read_text() == "file"
    staged.mkdir()  # and back to a folder: the file is kept too, the folder's name not reused
    assert swap_in(staged, target) == tmp_path / "last-file.ckpt" and target.is_dir()


def test_a_stale_old_checkpoint_is_removed_by_the_next_file_save(tmp_path):
    target, staged = tmp_path / "last.ckpt", tmp_path / "last.ckpt.partial"
    (tmp_path / "last.ckpt.old").mkdir()
    target.write_text("old")
    staged.write_text("new")
    swap_in(staged, target)
    assert previous_checkpoint(target) is None  # a later `ckpt_path=last` cannot fall back to it


def test_a_failed_swap_on_rank_zero_is_an_error_on_every_rank(tmp_path):
    from types import SimpleNamespace

    from project.training.callbacks import StepCheckpoint

    sent = []
    strategy = SimpleNamespace(broadcast=lambda obj: sent.append(obj) or obj)  # what rank 0 tells the others
    trainer = SimpleNamespace(is_global_zero=True, strategy=strategy)
    missing = tmp_path / "never-written.partial"
    with pytest.raises(ConfigError, match="rank 0 could not put the checkpoint in place"):
        StepCheckpoint._on_rank_zero(trainer, swap_in, missing, tmp_path / "last.ckpt")
    assert sent and sent[0][0] is False  # the other ranks receive the failure rather than wait


PEAK_GROWTH = """
import io, sys, torch
from project.checkpoint.files import write_checkpoint_file

def status(field):  # kB
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))

state = {"state_dict": {f"w{i}": torch.ones(8, 1 << 20) for i in range(4)}}  # 128 MiB
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here: earlier peaks do not count
before = status("VmRSS:")
write_checkpoint_file(state, sys.argv[1]) if sys.argv[2] == "file" else torch.save(state, io.BytesIO())
print((status("VmHWM:") - before) * 1024 / (128 << 20))
"""


@pytest.mark.parametrize("how, most, least", [("file", 0.1, 0.0), ("in-memory", None, 0.9)])
def test_a_checkpoint_file_is_written_without_a_copy_of_it_in_host_memory(tmp_path, how, most, least):
    import subprocess
    import sys

    # A fresh process, whose peak resident memory then measures the save alone; serializing into memory first (what
    # Lightning's checkpoint IO does) is the reference that shows the measure sees a copy.
    done = subprocess.run(
        [sys.executable, "-c", PEAK_GROWTH, str(tmp_path / "last.ckpt"), how], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    growth = float(done.stdout.split()[-1])  # of the state's size
    assert growth >= least and (most is None or growth <= most), growth
    if how == "file":
        assert torch.load(tmp_path / "last.ckpt", weights_only=True)["state_dict"]["w3"].sum() == 8 << 20


def test_a_failed_background_write_leaves_nothing_half_written_and_is_said_on_every_rank(tmp_path):
    from concurrent.futures import Future

    from project.checkpoint.background import BackgroundWriter
    from project.parallel.strategies.saving import BackgroundSaving

    class Strategy(BackgroundSaving):
        is_global_zero = True

        def reduce_boolean_decision(self, decision, all=True):
            return decision  # one rank: its own decision

    partial = tmp_path / "best-step000004.ckpt"  # a best checkpoint's write, failed part way
    partial.write_bytes(b"half")
    failed: Future = Future()
    failed.set_exception(OSError(28, "No space left on device"))
    strategy, writer = Strategy(), BackgroundWriter(pinned=False)
    writer.in_flight, writer.path = failed, partial
    strategy._writer = writer
    with pytest.raises(ConfigError, match=r"written in the background to .*best-step000004.ckpt failed \(OSError"):
        strategy.finish_checkpoint_writes()
    assert not partial.exists()
    writer.close()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "fsdp2"])
def test_checkpoints_get_the_users_file_mode(tiny_shards, tmp_path, strategy):
    # umask 027 tells both mistakes apart: private files (0600/0700) and modes that ignore the umask (0644/0755).
    devices = ["trainer.devices=2"] if strategy != "single" else []
    previous = os.umask(0o027)
    try:
        run_train(
            tiny_shards,
            tmp_path,
            f"strategy={strategy}",
            *devices,
            "trainer.max_steps=2",
            "ckpt_every_n_steps=1",
            "val_every_n_steps=1",
        )
    finally:
        os.umask(previous)
    written = [tmp_path / "checkpoints", *(tmp_path / "checkpoints").rglob("*")]
    assert len(written) >= 3  # the folder, last.ckpt and the best
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in written}
    assert modes == {name: oct(0o750 if (tmp_path / name).is_dir() else 0o640) for name in modes}


class _RunsCode:
    def __reduce__(self):  # what a malicious pickle does: call something when loaded
        return (os.mkdir, (str(_RunsCode.marker),))


@pytest.mark.parametrize("damage", ["truncated", "runs_code", "not_a_checkpoint"])
def test_a_damaged_or_code_carrying_checkpoint_is_refused_and_nothing_runs(tmp_path, damage):
    from project.checkpoint.files import checkpoint_step
    from project.checkpoint.reshard import read_whole

    path = tmp_path / "last.ckpt"
    _RunsCode.marker = tmp_path / "code-ran"
    if damage == "truncated":
        module, _ = stepped_module()
        torch.save({"global_step": 1, "state_dict": module.state_dict()}, path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "runs_code":
        torch.save({"global_step": 1, "payload": _RunsCode()}, path)
    else:
        path.write_text("not a checkpoint")
    for read in (read_whole, checkpoint_step):
        with pytest.raises(ConfigError, match=f"{path} is not a checkpoint this platform can read"):
            read(path)
    assert not _RunsCode.marker.exists()


@pytest.mark.slow
def test_training_from_a_truncated_checkpoint_is_one_clear_error(tiny_shards, tmp_path):
    from tests.conftest import run_module, train_overrides

    broken = tmp_path / "broken.ckpt"
    broken.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    result = run_module("project.train", train_overrides(tiny_shards, tmp_path / "run", f"ckpt_path={broken}"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: {broken} is not a checkpoint this platform can read" in result.stderr


class RunsCode:
    """Unpickling this runs a shell command: what a booby-trapped checkpoint holds."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def sharded_folder(folder):
    import torch.distributed.checkpoint as dcp

    # One process writes the format too; the optimizer settings are the non-tensor entries torch pickles.
    dcp.save(
        {"weight": torch.ones(4), "optimizer": {"lr": 1e-3, "betas": (0.9, 0.95)}}, checkpoint_id=folder, no_dist=True
    )
    return folder


SINGLE_PROCESS_DCP = pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")


@SINGLE_PROCESS_DCP
def test_a_sharded_checkpoint_whose_metadata_would_run_code_is_refused(tmp_path):
    import pickle

    from project.checkpoint.files import SHARDED_METADATA, verify_sharded_checkpoint

    folder = sharded_folder(tmp_path / "last.ckpt")
    verify_sharded_checkpoint(folder)  # torch's own folders pass
    marker = tmp_path / "ran"
    (folder / SHARDED_METADATA).write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(
        ConfigError, match=r"not a sharded checkpoint this platform can read \(posix.system is not among"
    ):
        verify_sharded_checkpoint(folder)
    assert not marker.exists()


@SINGLE_PROCESS_DCP
def test_a_sharded_checkpoint_whose_entries_would_run_code_is_refused_and_torch_alone_would_run_it(tmp_path):
    import io
    import pickle
    import subprocess
    import sys

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from project.checkpoint.files import SHARDED_METADATA, verify_sharded_checkpoint

    folder, marker = sharded_folder(tmp_path / "last.ckpt"), tmp_path / "ran"
    payload = io.BytesIO()
    torch.save(RunsCode(marker), payload)
    (folder / "trap.distcp").write_bytes(payload.getvalue())
    metadata = FileSystemReader(folder).read_metadata()
    entry = metadata.storage_data[MetadataIndex("optimizer.lr")]
    entry.relative_path, entry.offset, entry.length = "trap.distcp", 0, len(payload.getvalue())
    (folder / SHARDED_METADATA).write_bytes(pickle.dumps(metadata))

    with pytest.raises(
        ConfigError, match=r"not a sharded checkpoint this platform can read \(Weights only load failed"
    ):
        verify_sharded_checkpoint(folder)
    assert not marker.exists()
    # What the check prevents: torch's loader (as Lightning calls it on resume) runs the entry's code.
    load = (
        "import torch.distributed.checkpoint as d; s={'optimizer': {'lr': 0.0}}; "
        f"d.load(s, checkpoint_id={str(folder)!r}, no_dist=True)"
    )
    subprocess.run([sys.executable, "-c", load], check=True, capture_output=True)
    assert marker.exists()


def test_a_tied_model_numbers_its_embedding_once_as_the_optimizer_does():
    """A tied output matrix is the embedding parameter: the state dict names it twice, the optimizer holds it once."""
    module = LlamaLitModule(model={**MODEL, "tie_embeddings": True}, optim={"lr": 1e-3, "warmup_steps": 0})
    optimizer = torch.optim.AdamW(
        [{"params": [p for _, p in group], "weight_decay": decay} for decay, group in module.decay_groups()]
    )
    module.model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    assert len(module.state_dict()) == len(order_of(module)) + 1
    named = by_name(optimizer.state_dict(), order_of(module))
    assert "model.tok_embeddings.weight" in named["state"] and "model.output.weight" not in named["state"]


def test_kept_checkpoints_follow_the_step_and_one_saved_again_replaces_its_namesake(tmp_path):
    """ckpt_keep_last=3: last.ckpt and the two before it as step-<N>.ckpt, ordered by step (not by name); a run
    resumed from an earlier one saves a step again, whose kept copy replaces the one of that name."""
    from project.training.callbacks import StepCheckpoint

    def replaced(step: int) -> None:
        torch.save({"global_step": step}, tmp_path / "last.ckpt.old")

    keeper = StepCheckpoint(dirpath=str(tmp_path), keep_last=3)
    for step in (999_990, 1_000_000, 1_000_010):  # past six digits, where names would sort wrongly
        replaced(step)
        keeper._keep_replaced(tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1000000.ckpt", "step-1000010.ckpt"]
    replaced(1_000_000)  # resumed from step-1000000, which it saves again
    keeper._keep_replaced(tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1000000.ckpt", "step-1000010.ckpt"]


def test_optimizer_state_numbered_in_the_models_order_is_read_by_name_too():
    """FSDP1's whole-state file numbers AdamW's state by the model's order of its parameters (torch's rekeying without
    the optimizer), where norms and matrices interleave; read by name, each moment is its own parameter's."""
    module, optimizer = stepped_module()
    positions = optimizer.state_dict()
    named = by_name(positions, order_of(module))
    model_order = [name for name, _ in module.named_parameters()]
    number = {name: i for i, name in enumerate(model_order)}
    renumbered = {
        "state": {number[n]: v for n, v in named["state"].items()},
        "param_groups": [{**g, "params": [number[n] for n in g["params"]]} for g in named["param_groups"]],
    }
    again = by_name(renumbered, order_of(module))
    assert again["param_groups"] == named["param_groups"]
    for name, state in named["state"].items():
        torch.testing.assert_close(again["state"][name], state, rtol=0, atol=0)


def test_latest_names_the_save_to_resume_and_a_killed_saves_leftovers_never_win(tmp_path):
    """Object storage's commit protocol (project.checkpoint.latest), on a local folder: the same functions."""
    from project.checkpoint.latest import latest, publish, save_name

    def save(step, complete=True, kind="folder"):
        path = tmp_path / save_name(step)
        if kind == "file":
            path.write_bytes(b"whole")
        else:
            path.mkdir()
            (path / "__0_0.distcp").write_bytes(b"shard")
            if complete:
                (path / ".metadata").write_bytes(b"written last")
        return path

    assert latest(tmp_path) is None
    publish(save(2), keep=2)
    publish(save(4, kind="file"), keep=2)
    save(6, complete=False)  # killed while its shards were written: `latest` still names step 4
    assert latest(tmp_path) == tmp_path / save_name(4)
    publish(save(8), keep=2)  # the next save: the partial one goes, and the oldest beyond keep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", save_name(4), save_name(8)]
    # A run resumed from step 4 (an earlier save) saves step 5: it becomes the one to resume; step 8, of the
    # abandoned run, is left (it is newer) until saves overtake it.
    publish(save(5), keep=2)
    assert latest(tmp_path) == tmp_path / save_name(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", save_name(4), save_name(5), save_name(8)]
    (tmp_path / "latest").unlink()  # lost (or never written: killed between the save and it)
    assert latest(tmp_path) == tmp_path / save_name(8), "the newest complete save"

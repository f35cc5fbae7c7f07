"""Sharded checkpoints: resume under the same or another layout, and export to Hugging Face."""

from pathlib import Path

import pytest
import torch
from conftest import RESUME_RUN, assert_continues, read_metrics, run_module, run_train

from project.checkpoint.files import checkpoint_step

pytestmark = pytest.mark.slow
FSDP1_CHECKPOINT = Path(__file__).parent / "fsdp1_checkpoint" / "step4.ckpt"  # read, never written


def test_run_moves_from_tensor_parallel_to_hsdp_to_one_device(tiny_shards, uninterrupted_reference, tmp_path):
    keep = "ckpt_keep_last=2"  # and the checkpoint before last.ckpt is kept, as step-<N>.ckpt
    run_train(tiny_shards, tmp_path, *RESUME_RUN, "trainer.max_steps=7", "strategy=tp", "trainer.devices=2", keep)
    assert (tmp_path / "checkpoints" / "last.ckpt").is_dir()  # a distributed checkpoint
    assert checkpoint_step(tmp_path / "checkpoints" / "step-000005.ckpt") == 5  # saved at 5, then 7 (the last)
    run_train(
        tiny_shards,
        tmp_path,
        *RESUME_RUN,
        "trainer.max_steps=14",
        "strategy=fsdp2",
        "trainer.devices=4",
        "strategy.data_parallel_shard_size=2",  # HSDP: shards within pairs, replicated across them
        "ckpt_path=last",
        keep,
    )
    assert_continues(tmp_path, uninterrupted_reference, 14)
    assert read_metrics(tmp_path, "layout/data_parallel_shard") == {0: 1, 7: 2}  # tp's one rank, then HSDP's pairs
    # Saved at 10 and 14: step-000007 (the tp run's last) went once step-000010 took its place.
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-000010.ckpt"]
    run_train(tiny_shards, tmp_path, *RESUME_RUN, "trainer.max_steps=20", "ckpt_path=last", keep)
    assert_continues(tmp_path, uninterrupted_reference, 20)
    assert (tmp_path / "checkpoints" / "step-000015.ckpt").is_file()  # a file replaced by a file is kept too
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file() and (
        checkpoints / "last-sharded.ckpt"
    ).is_dir()  # kept, not overwritten


def test_every_checkpoint_format_resumes_under_every_other_family(tiny_shards, uninterrupted_reference, tmp_path):
    """A single file and FSDP2's folders each load under the other strategies; those that can write in the
    background (ckpt_async) do, and what they write resumes alike."""
    chain = [
        ["ckpt_async=true"],  # one device writes a single file ...
        ["strategy=fsdp2", "trainer.devices=2", "ckpt_async=true"],  # ... FSDP2 reads it and writes a folder ...
        # ... which strategy=fsdp reads, writing one file gathered on rank 0 (optimizer keyed by position) ...
        ["strategy=fsdp", "trainer.devices=2", "strategy.state_dict_type=full", "ckpt_async=true"],
        ["strategy=fsdp", "trainer.devices=2"],  # ... which it reads into its shards again ...
        # ... and two DDP processes (Lightning starts the second) its folder.
        ["strategy=ddp", "trainer.devices=2", "ckpt_async=true"],
    ]
    for hop, layout in enumerate(chain):
        resume = ["ckpt_path=last"] if hop else []
        run_train(tiny_shards, tmp_path, *RESUME_RUN, f"trainer.max_steps={4 * (hop + 1)}", *resume, *layout)
    assert_continues(tmp_path, uninterrupted_reference, 20)
    # Each save's size, seconds and throughput, in the row of the step it saved: every 5 steps and each run's last.
    sizes, seconds, waited = (
        read_metrics(tmp_path, f"checkpoint/{m}") for m in ("gigabytes", "seconds", "stall_seconds")
    )
    assert sorted(sizes) == [3, 4, 7, 9, 11, 14, 15, 19] and all(size > 0 for size in sizes.values())
    assert all(0 < waited[step] <= seconds[step] for step in sizes)
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith("best"))
    # Each change of format moved the old last.ckpt aside (four changes); no converted copies or partial saves remain.
    assert left == ["last-file-2.ckpt", "last-file.ckpt", "last-sharded-2.ckpt", "last-sharded.ckpt", "last.ckpt"]


def test_a_checkpoint_fsdp1_wrote_resumes_under_fsdp_and_on_one_device(tiny_shards, uninterrupted_reference, tmp_path):
    """strategy=fsdp ran FSDP1 until 2026-12-05: its folders (weights under `model`, AdamW's moments in
    ShardedTensors; tests/fsdp1_checkpoint/README.md) still resume, sharded or whole, as the run went on."""
    for name, layout in (("fsdp", ["strategy=fsdp", "trainer.devices=2"]), ("single", [])):
        resume = [f"ckpt_path={FSDP1_CHECKPOINT}", "trainer.max_steps=8"]
        run_train(tiny_shards, tmp_path / name, *RESUME_RUN, *resume, *layout)
        resumed = read_metrics(tmp_path / name, "train/loss")
        assert sorted(resumed) == [4, 5, 6, 7], name
        for step, loss in resumed.items():
            assert loss == pytest.approx(uninterrupted_reference[step], rel=1e-5), (name, step)


def test_sharded_checkpoint_exports_to_transformers(tiny_shards, tmp_path):
    transformers = pytest.importorskip("transformers")
    from project.checkpoint.reshard import read_whole
    from project.model.config import LlamaConfig
    from project.model.llama import Llama
    from project.training.lit_module import LlamaLitModule

    run_train(
        tiny_shards, tmp_path, "trainer.max_steps=3", "global_batch_size=8", "strategy=tp_fsdp", "trainer.devices=4"
    )
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    result = run_module("project.export", [f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'hf'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    full = read_whole(ckpt)
    ours = Llama(LlamaConfig(**full["hyper_parameters"]["model"])).eval()
    ours.load_state_dict({k.removeprefix("model."): v for k, v in full["state_dict"].items()})
    # The Python API reads the sharded folder too, into the plain model.
    loaded = LlamaLitModule.load_from_checkpoint(ckpt).model
    assert type(loaded) is Llama
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, full["state_dict"][f"model.{name}"]), name
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_a_strategy_that_cannot_write_in_the_background_refuses_ckpt_async_by_name():
    from project.parallel.contract import LlamaStrategy
    from project.runtime.errors import ConfigError

    class OwnStrategy(LlamaStrategy):  # a user's, with the contract's defaults only
        pass

    own = OwnStrategy()
    own.save_in_background(False)  # the default asks nothing of it
    with pytest.raises(
        ConfigError, match=r"ckpt_async=true: this strategy \(OwnStrategy\) writes .* in the background"
    ):
        own.save_in_background(True)

"""A resumed run continues exactly as the uninterrupted run: same losses, same batches."""

import lightning as L
import pytest
import torch
from conftest import RESUME_RUN as RUN
from conftest import read_metrics, run_module, run_train, train_overrides

from project.data.datamodule import TokenShardDataModule
from project.training.callbacks import StepCheckpoint


@pytest.fixture
def uninterrupted(uninterrupted_reference):
    return uninterrupted_reference


@pytest.mark.slow
@pytest.mark.parametrize("resumed_layout", [[], ["strategy=ddp", "trainer.devices=2"]], ids=["single", "ddp2"])
def test_resumed_run_matches_uninterrupted_losses(tiny_shards, uninterrupted, tmp_path, resumed_layout):
    run_train(tiny_shards, tmp_path, *RUN, "trainer.max_steps=7")  # stops between checkpoint intervals
    run_train(tiny_shards, tmp_path, *RUN, "trainer.max_steps=20", "ckpt_path=last", *resumed_layout)
    resumed = read_metrics(tmp_path, "train/loss")
    assert sorted(resumed) == list(range(20))  # metrics.csv keeps the first part and appends the rest
    for step in range(7, 20):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step


@pytest.mark.slow
def test_run_resumed_from_an_earlier_checkpoint_replaces_the_rows_it_replays(tiny_shards, uninterrupted, tmp_path):
    run_train(tiny_shards, tmp_path, *RUN, "trainer.max_steps=13")  # as if it crashed after step 13
    best = tmp_path / "checkpoints" / "best-step000010.ckpt"  # written when validation at step 10 ended
    assert best.is_file()
    run_train(tiny_shards, tmp_path, *RUN, "trainer.max_steps=20", f"ckpt_path={best}")
    resumed = read_metrics(tmp_path, "train/loss")  # fails on a step logged twice
    assert sorted(resumed) == list(range(20))
    for step in range(20):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step


def test_resume_without_a_checkpoint_is_a_clear_error(tiny_shards, tmp_path):
    result = run_module("project.train", train_overrides(tiny_shards, tmp_path, "ckpt_path=last"))
    assert result.returncode == 2
    assert "ckpt_path=last: no checkpoint at" in result.stderr and "hydra.run.dir" in result.stderr


class RecordBatches(L.LightningModule):
    """Trains a single scalar and remembers every input batch it was given."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].clone())
        return self.w * batch[0].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(shards, run_dir, max_steps, ckpt_path=None):
    module = RecordBatches()
    data = TokenShardDataModule(str(shards), seq_len=32, global_batch_size=4, micro_batch_size=2, num_workers=0)
    checkpoint = StepCheckpoint(dirpath=run_dir, every_n_train_steps=100)
    trainer = L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=run_dir,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module.seen


def test_resumed_loader_yields_exactly_the_remaining_batches(tiny_shards, tmp_path):
    full = fit(tiny_shards, tmp_path / "full", max_steps=12)
    first = fit(tiny_shards, tmp_path / "part", max_steps=5)  # the final-step checkpoint: last.ckpt at step 5
    rest = fit(tiny_shards, tmp_path / "part", max_steps=12, ckpt_path=tmp_path / "part" / "last.ckpt")
    assert len(full) == 24 and len(first) == 10 and len(rest) == 14
    for expected, got in zip(full, first + rest):
        assert torch.equal(expected, got)

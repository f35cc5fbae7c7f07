"""Sharding divides what each rank holds: parameters, gradients and optimizer state."""

import json

import pytest
from conftest import read_metrics, run_train

from project.model.config import LlamaConfig
from project.model.flops import count_parameters

pytestmark = pytest.mark.slow

DEBUG_MODEL = LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32)


def rank_figures(run_dir, world_size):
    return [json.loads((run_dir / "memory" / f"rank{r}.json").read_text()) for r in range(world_size)]


HSDP = ["strategy=fsdp2", "trainer.devices=4", "strategy.data_parallel_shard_size=2"]


@pytest.mark.parametrize(
    "layout",
    [["strategy=fsdp2", "trainer.devices=2"], HSDP],
    ids=["fsdp2", "hsdp-2x2"],
)
def test_each_fsdp_rank_holds_its_share_of_the_model_and_optimizer_state(tiny_shards, tmp_path, layout):
    """Two ranks hold half the model each; so do four under HSDP in pairs (each pair a whole copy)."""
    run_train(tiny_shards, tmp_path, "trainer.max_steps=2", "global_batch_size=8", *layout)
    model_bytes = 4 * count_parameters(DEBUG_MODEL)  # float32
    copies = 2 if layout is HSDP else 1
    ranks = rank_figures(tmp_path, 2 * copies)
    for pair in range(copies):  # disjoint shards that cover the model
        assert sum(r["param_bytes"] for r in ranks[2 * pair : 2 * pair + 2]) == model_bytes
    for r in ranks:
        assert r["param_bytes"] == pytest.approx(model_bytes / 2, rel=0.05)
        assert r["grad_bytes"] == r["param_bytes"]
        # AdamW's two moments per parameter, plus a step counter per tensor
        assert 2 * r["param_bytes"] <= r["optimizer_bytes"] <= 2 * r["param_bytes"] + 1024
    peaks = read_metrics(tmp_path, "memory/max_peak_bytes")
    assert peaks[max(peaks)] == pytest.approx(max(r["peak_bytes"] for r in ranks), rel=1e-6)  # the rank that needs most


def test_a_single_device_holds_the_whole_model(tiny_shards, tmp_path):
    run_train(tiny_shards, tmp_path, "trainer.max_steps=2", "global_batch_size=8")
    (only,) = rank_figures(tmp_path, 1)
    assert only["param_bytes"] == only["grad_bytes"] == 4 * count_parameters(DEBUG_MODEL)

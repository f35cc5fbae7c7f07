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


@pytest.mark.parametrize("layout", [["strategy=fsdp"], ["strategy=fsdp2"]], ids=["fsdp", "fsdp2"])
def test_each_of_two_fsdp_ranks_holds_half_the_model_and_optimizer_state(tiny_shards, tmp_path, layout):
    run_train(tiny_shards, tmp_path, "trainer.max_steps=2", "global_batch_size=8", "trainer.devices=2", *layout)
    model_bytes = 4 * count_parameters(DEBUG_MODEL)  # float32
    ranks = rank_figures(tmp_path, 2)
    assert sum(r["param_bytes"] for r in ranks) == model_bytes  # disjoint shards that cover the model
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

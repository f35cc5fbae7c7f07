"""The run that prepares its own shards trains exactly as every later run of the same command.

Preparing runs in the training process between the seed and the model's construction, and draws from
global generators on the way; the initial weights must depend on `seed` alone. Each layout's first run
(preparing a new data.dir from the corpus of the shared shards) is compared with the shared run of the
same layout, which read shards prepared beforehand: the same per-step losses and final weights.
"""

import pytest
import torch
from conftest import PARITY_RUN, PIPELINE_RUN, read_metrics, run_train

from project.checkpoint.reshard import read_whole

pytestmark = pytest.mark.slow

LAYOUTS = {
    "single": [*PARITY_RUN],
    "ddp": [*PARITY_RUN, "strategy=ddp", "trainer.devices=2", "micro_batch_size=null"],
    "fsdp2": [*PARITY_RUN, "strategy=fsdp2", "trainer.devices=2"],
    "pipeline": [*PIPELINE_RUN, "strategy=pipeline", "trainer.devices=2", "strategy.schedule=1f1b"],
}
# The later runs, trained together before the first test (tests/conftest.py: trained).
TRAINED_TOGETHER = [overrides for name, overrides in LAYOUTS.items() if name != "single"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_the_run_that_prepares_its_data_trains_as_the_next_run(
    trained, single_reference, tiny_shards, tmp_path, layout
):
    overrides = LAYOUTS[layout]
    later = single_reference if layout == "single" else trained(*overrides)
    fresh = tmp_path / "new-shards"  # prepared by the run itself, from the corpus tiny_shards was made from
    corpus = tiny_shards.parent / "raw"
    run_train(fresh, tmp_path / "run", *overrides, f"data.sources=[{corpus}/*.txt]", "data.fetch=null")
    assert (fresh / "manifest.json").is_file()

    first, second = read_metrics(tmp_path / "run", "train/loss"), read_metrics(later, "train/loss")
    assert sorted(first) == sorted(second) and len(first) >= 10
    for step in second:
        assert first[step] == pytest.approx(second[step], rel=1e-6), step
    weights = read_whole(tmp_path / "run" / "checkpoints" / "last.ckpt")["state_dict"]
    for name, value in read_whole(later / "checkpoints" / "last.ckpt")["state_dict"].items():
        torch.testing.assert_close(weights[name], value, rtol=1e-6, atol=1e-7, msg=name)

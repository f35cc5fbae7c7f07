"""Each rank of a resumed run reads only its own share of the checkpoint, whatever layout wrote it
(project.checkpoint.reshard): its memory while the checkpoint loads is bounded by its share of the training state,
and the resumed run continues the uninterrupted one.

The model is made large enough (27.5M parameters, 330 MB of weights and AdamW moments in float32) that one rank's
share on 4 ranks (about 83 MB) stands well above what a process allocates besides. Measured (tests/load_memory_probe.py:
resident anonymous memory from setup to the start of training, fresh processes): 1.04 to 1.22 times the share; a rank
that read the whole file grew by 5.1 times it.
"""

import json

import pytest
from conftest import read_metrics, train_overrides

pytestmark = pytest.mark.slow

MODEL = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=1536"]
RUN = [*MODEL, "optim.decay_steps=20", "global_batch_size=8", "micro_batch_size=2", "trainer.devices=4",
       "ckpt_every_n_steps=100", "val_every_n_steps=100", "trainer.log_every_n_steps=1"]  # fmt: skip
FSDP2 = ["strategy=fsdp2"]
WRITERS = {
    "folder": ["strategy=tp_fsdp", "strategy.tensor_parallel_size=2"],  # a distributed checkpoint of another layout
    "file": ["strategy=ddp"],  # one file, AdamW's state keyed by position
}
SHARE_BOUND = 1.3  # the share itself (weights and moments) and 30% for reading it


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    from in_process import train_in_process

    names = ["uninterrupted", *WRITERS, *(f"from-{w}" for w in WRITERS)]
    dirs = {name: tmp_path_factory.mktemp(name) for name in names}

    def case(name: str, *overrides: str):
        return dirs[name], train_overrides(tiny_shards, dirs[name], *RUN, *overrides)

    written = [case(writer, *layout, "trainer.max_steps=2") for writer, layout in WRITERS.items()]
    train_in_process(4, [case("uninterrupted", *FSDP2, "trainer.max_steps=4"), *written])
    for writer in WRITERS:  # each in new processes: memory an earlier run freed is not counted against it
        resumed = f"from-{writer}"
        probe = ["+callbacks.load_memory._target_=tests.load_memory_probe.LoadMemory",
                 f"+callbacks.load_memory.output_dir={dirs[resumed]}"]  # fmt: skip
        checkpoint = f"ckpt_path={dirs[writer] / 'checkpoints' / 'last.ckpt'}"
        train_in_process(4, [case(resumed, *FSDP2, "trainer.max_steps=4", checkpoint, *probe)])
    return dirs


@pytest.mark.parametrize("writer", list(WRITERS))
def test_each_rank_loads_its_own_share_and_the_run_continues(runs, writer):
    assert (runs[writer] / "checkpoints" / "last.ckpt").is_dir() == (writer == "folder")
    resumed, uninterrupted = (read_metrics(runs[name], "train/loss") for name in (f"from-{writer}", "uninterrupted"))
    assert sorted(resumed) == [2, 3]
    for step in resumed:
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step
    for rank in range(4):
        probe = json.loads((runs[f"from-{writer}"] / "load_memory" / f"rank{rank}.json").read_text())
        grown = probe["peak"] - probe["at_setup"]
        assert 0 < grown <= SHARE_BOUND * probe["share"], (rank, grown / probe["share"])

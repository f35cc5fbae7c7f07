"""data.mix: weighted mixtures of prepared corpora, read in one layout-independent order."""

import pytest
from conftest import read_metrics, run_train, write_corpus

from project.data.datamodule import TokenShardDataModule
from project.data.prepare import prepare_shards
from project.runtime.errors import ConfigError


@pytest.fixture(scope="module")
def second_corpus(tiny_shards, tmp_path_factory):
    """Other text, prepared with tiny_shards' tokenizer."""
    root = tmp_path_factory.mktemp("second")
    raw = write_corpus(root / "raw", documents=5, lines=200, seed=11)
    prepare_shards(
        [str(raw / "*.txt")], root / "shards", tokenizer=tiny_shards / "tokenizer.json", seq_len=32, num_workers=1
    )
    return root / "shards"


def mix(first, second, w=(0.75, 0.25)):
    return [
        {"name": "first", "dir": str(first), "weight": w[0]},
        {"name": "second", "dir": str(second), "weight": w[1]},
    ]


def step_indices(data_mix, dp_size, steps, global_batch=8, micro=2, start=0):
    """Per optimizer step: the sorted block indices all replicas read together."""
    per_rank = []
    for rank in range(dp_size):
        dm = TokenShardDataModule(
            None,
            seq_len=32,
            global_batch_size=global_batch,
            micro_batch_size=micro,
            num_workers=0,
            dp_rank=rank,
            dp_size=dp_size,
            mix=data_mix,
        )
        dm.setup()
        dm._start_sample = start
        sampler = iter(dm.train_dataloader().batch_sampler)
        per_rank.append([next(sampler) for _ in range(steps * global_batch // (micro * dp_size))])
    accum = global_batch // (micro * dp_size)
    return dm, [sorted(i for r in per_rank for b in r[s * accum : (s + 1) * accum] for i in b) for s in range(steps)]


def test_a_mixture_reads_the_same_sequences_per_step_on_any_number_of_replicas(tiny_shards, second_corpus):
    _, one = step_indices(mix(tiny_shards, second_corpus), 1, steps=6)
    _, two = step_indices(mix(tiny_shards, second_corpus), 2, steps=6)
    _, four = step_indices(mix(tiny_shards, second_corpus), 4, steps=6)
    assert one == two == four


def test_each_step_draws_the_corpora_by_their_weights_and_resumes_from_the_count(tiny_shards, second_corpus):
    dm, steps = step_indices(mix(tiny_shards, second_corpus), 2, steps=10)
    second_start = dm.train_set.offsets[1]
    assert [sum(i >= second_start for i in step) for step in steps] == [2] * 10  # 25% of 8
    _, resumed = step_indices(mix(tiny_shards, second_corpus), 2, steps=4, start=6 * 8)
    assert resumed == steps[6:]


def test_corpora_prepared_with_another_tokenizer_are_refused(tiny_shards, tmp_path):
    raw = write_corpus(tmp_path / "raw", documents=3, lines=100, seed=5)
    prepare_shards([str(raw / "*.txt")], tmp_path / "own", vocab_size=280, seq_len=32, num_workers=1)
    with pytest.raises(ConfigError, match="prepared with another tokenizer.*data.tokenizer="):
        TokenShardDataModule(
            None, seq_len=32, global_batch_size=4, micro_batch_size=2, mix=mix(tiny_shards, tmp_path / "own")
        )


def test_malformed_mixtures_are_refused(tiny_shards):
    with pytest.raises(ConfigError, match=r"data.mix\[1\].weight=0 must be a positive number"):
        TokenShardDataModule(
            None, seq_len=32, global_batch_size=4, micro_batch_size=2, mix=mix(tiny_shards, tiny_shards, (1, 0))
        )
    with pytest.raises(ConfigError, match="each with its own name"):
        TokenShardDataModule(
            None,
            seq_len=32,
            global_batch_size=4,
            micro_batch_size=2,
            mix=[{"dir": str(tiny_shards), "weight": 1}, {"dir": str(tiny_shards), "weight": 1}],
        )


def test_training_on_a_mixture_reports_validation_loss_per_corpus_and_weighted(tiny_shards, second_corpus, tmp_path):
    entries = ",".join(
        f"{{name:{m['name']},dir:'{m['dir']}',weight:{m['weight']}}}" for m in mix(tiny_shards, second_corpus)
    )
    run_train(
        tiny_shards, tmp_path, f"data.mix=[{entries}]", "trainer.max_steps=2", "val_every_n_steps=2", "val_sequences=4"
    )
    first, second, overall = (read_metrics(tmp_path, f"val/loss{suffix}") for suffix in ("/first", "/second", ""))
    (step,) = overall  # one validation, after step 2
    assert sorted(first) == sorted(second) == [step] and first[step] != second[step]
    assert overall[step] == pytest.approx(0.75 * first[step] + 0.25 * second[step], rel=1e-5)

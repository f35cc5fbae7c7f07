import itertools

from project.data.sampler import GlobalBatchSampler, ValidationSampler


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def steps(num_samples, global_batch, micro, dp_size, n_steps, start=0):
    """Per optimizer step: the sorted indices all replicas read together."""
    accum = global_batch // (micro * dp_size)
    per_rank = [take(GlobalBatchSampler(num_samples, global_batch, micro, r, dp_size, seed=3, start_sample=start), accum * n_steps)
                for r in range(dp_size)]
    return [sorted(i for r in range(dp_size) for b in per_rank[r][s * accum:(s + 1) * accum] for i in b)
            for s in range(n_steps)]


def test_each_step_reads_the_same_sequences_on_one_or_many_replicas():
    reference = steps(50, global_batch=8, micro=2, dp_size=1, n_steps=20)
    assert steps(50, global_batch=8, micro=2, dp_size=2, n_steps=20) == reference
    assert steps(50, global_batch=8, micro=4, dp_size=2, n_steps=20) == reference
    assert steps(50, global_batch=8, micro=1, dp_size=4, n_steps=20) == reference


def test_replicas_read_disjoint_sequences_within_an_epoch():
    a = [i for b in take(GlobalBatchSampler(64, 8, 2, 0, 2, seed=1), 16) for i in b]
    b = [i for b in take(GlobalBatchSampler(64, 8, 2, 1, 2, seed=1), 16) for i in b]
    assert not set(a) & set(b)
    assert sorted(a + b) == list(range(64))


def test_every_epoch_is_a_new_permutation_of_all_blocks():
    stream = [i for b in take(GlobalBatchSampler(10, 5, 5, 0, 1, seed=0), 4) for i in b]
    first, second = stream[:10], stream[10:20]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second


def test_resuming_from_consumed_count_continues_the_stream():
    full = take(GlobalBatchSampler(37, 6, 3, 1, 2, seed=5), 20)
    resumed = take(GlobalBatchSampler(37, 6, 3, 1, 2, seed=5, start_sample=6 * 4), 12)
    assert resumed == full[4:16]


def test_validation_reads_the_same_spread_out_blocks_for_any_layout():
    def blocks(micro, dp):
        return sorted(i for r in range(dp) for b in ValidationSampler(100, 10, micro, r, dp) for i in b)

    assert blocks(4, 1) == list(range(0, 100, 10))  # every 10th block: all of the split is sampled
    assert blocks(2, 3) == blocks(4, 1) == blocks(1, 4)


def test_validation_shares_are_disjoint_and_within_one_block():
    shares = [[i for b in ValidationSampler(23, 7, 2, r, 3) for i in b] for r in range(3)]
    assert sorted(len(s) for s in shares) == [2, 2, 3]
    flat = [i for s in shares for i in s]
    assert len(set(flat)) == len(flat) == 7

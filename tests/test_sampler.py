import itertools

from project.data.sampler import BlockOrder, GlobalBatchSampler, ValidationSampler


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def steps(num_samples, global_batch, micro, dp_size, n_steps, start=0):
    """Per optimizer step: the sorted indices all replicas read together."""
    accum = global_batch // (micro * dp_size)
    per_rank = [
        take(
            GlobalBatchSampler(
                BlockOrder.single_chunk(num_samples, seed=3), global_batch, micro, r, dp_size, start_sample=start
            ),
            accum * n_steps,
        )
        for r in range(dp_size)
    ]
    return [
        sorted(i for r in range(dp_size) for b in per_rank[r][s * accum : (s + 1) * accum] for i in b)
        for s in range(n_steps)
    ]


def test_each_step_reads_the_same_sequences_on_one_or_many_replicas():
    reference = steps(50, global_batch=8, micro=2, dp_size=1, n_steps=20)
    assert steps(50, global_batch=8, micro=2, dp_size=2, n_steps=20) == reference
    assert steps(50, global_batch=8, micro=4, dp_size=2, n_steps=20) == reference
    assert steps(50, global_batch=8, micro=1, dp_size=4, n_steps=20) == reference


def test_replicas_read_disjoint_sequences_within_an_epoch():
    a = [i for b in take(GlobalBatchSampler(BlockOrder.single_chunk(64, seed=1), 8, 2, 0, 2), 16) for i in b]
    b = [i for b in take(GlobalBatchSampler(BlockOrder.single_chunk(64, seed=1), 8, 2, 1, 2), 16) for i in b]
    assert not set(a) & set(b)
    assert sorted(a + b) == list(range(64))


def test_every_epoch_is_a_new_permutation_of_all_blocks():
    stream = [i for b in take(GlobalBatchSampler(BlockOrder.single_chunk(10, seed=0), 5, 5, 0, 1), 4) for i in b]
    first, second = stream[:10], stream[10:20]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second


def test_resuming_from_consumed_count_continues_the_stream():
    full = take(GlobalBatchSampler(BlockOrder([10, 0, 7, 20], seed=5, window_chunks=2), 6, 3, 1, 2), 20)
    resumed = take(
        GlobalBatchSampler(BlockOrder([10, 0, 7, 20], seed=5, window_chunks=2), 6, 3, 1, 2, start_sample=6 * 4), 12
    )
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


def chunked_order(seed=7, window=3):
    """A split of 40 chunks of 5 to 24 blocks (one empty), as litdata numbers them."""
    sizes = [5 + (i * 7) % 20 for i in range(40)]
    sizes[11] = 0
    return BlockOrder(sizes, seed=seed, window_chunks=window), sizes


def test_every_block_of_an_epoch_is_read_exactly_once_and_epochs_differ():
    order, sizes = chunked_order()
    n = sum(sizes)
    first, second = order.take(0, n), order.take(n, n)
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second
    assert order.take(n - 5, 10) == first[-5:] + second[:5]  # a slice across the epoch boundary


def test_the_seed_changes_the_order():
    assert chunked_order(seed=1)[0].take(0, 50) != chunked_order(seed=2)[0].take(0, 50)


def test_reads_stay_within_a_window_of_chunks():
    order, sizes = chunked_order(window=3)
    stream = order.take(0, sum(sizes))
    chunks = [order.chunk_of(i) for i in stream]
    # Each window's blocks come from 3 chunks and are read before the next window's.
    seen, window_sets = [], []
    for c in chunks:
        if c not in seen:
            seen.append(c)
    window_sets = [set(seen[i : i + 3]) for i in range(0, len(seen), 3)]
    position = 0
    for members in window_sets:
        count = sum(sizes[c] for c in members)
        assert set(chunks[position : position + count]) == members
        position += count


def test_a_split_no_larger_than_the_window_is_shuffled_as_a_whole():
    order = BlockOrder([30, 30], seed=0, window_chunks=8)
    first_half = order.take(0, 30)
    assert {order.chunk_of(i) for i in first_half} == {0, 1}  # both chunks mix from the start


def test_memory_of_the_order_grows_with_chunks_not_blocks():
    order = BlockOrder([1000] * 10**4, seed=0, window_chunks=2)  # 10^7 blocks
    for start in (0, 5 * 10**6, 10**7 - 1500):
        order.take(start, 3000)  # crossing windows, and an epoch
    assert order._windows and all(len(blocks) == 2000 for blocks in order._windows.values())

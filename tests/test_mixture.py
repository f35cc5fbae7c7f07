"""MixtureOrder: which corpus each position of the global stream reads, by weight."""

import pytest

from project.data.mixture import MixtureOrder, apportion
from project.data.sampler import BlockOrder


def mixture(weights=(0.7, 0.2, 0.1), sizes=((30, 30), (17,), (4, 4, 4))):
    orders = [BlockOrder(chunks, seed=9, window_chunks=2, stream=i) for i, chunks in enumerate(sizes)]
    return MixtureOrder(orders, weights), orders


def test_every_prefix_of_the_stream_holds_each_corpus_within_one_sequence_of_its_weight():
    mix, _ = mixture()
    stream = mix.take(0, 3000)
    counts = [0, 0, 0]
    for p, index in enumerate(stream, start=1):
        counts[mix.corpus_of(index)] += 1
        for i, w in enumerate((0.7, 0.2, 0.1)):
            assert abs(counts[i] - w * p) < 1, (p, counts)


def test_each_corpus_reads_its_own_order_through_its_own_epochs():
    mix, orders = mixture()
    stream = mix.take(0, 2000)
    for i, order in enumerate(orders):
        mine = [index - int(mix.offsets[i]) for index in stream if mix.corpus_of(index) == i]
        assert mine == order.take(0, len(mine))
    assert len([i for i in stream if mix.corpus_of(i) == 1]) > 3 * 17  # the small corpus went round several epochs


def test_any_slice_of_the_stream_equals_the_same_slice_read_from_the_start():
    mix, _ = mixture()
    whole = mix.take(0, 25_000)  # past one period of the pattern
    for start, count in [(0, 7), (13, 50), (9_995, 20), (19_990, 5_010)]:
        assert mix.take(start, count) == whole[start : start + count]


def test_weights_are_apportioned_exactly_and_no_corpus_is_left_out():
    assert apportion([0.7, 0.2, 0.1], 10_000) == [7000, 2000, 1000]
    assert apportion([1, 1, 1], 10) == [4, 3, 3]
    assert apportion([1.0, 1e-9], 10_000)[1] == 1


def test_one_weight_per_corpus():
    with pytest.raises(ValueError, match="one weight per corpus"):
        MixtureOrder([BlockOrder([3], seed=0)], [0.5, 0.5])

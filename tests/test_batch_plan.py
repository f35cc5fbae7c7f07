import pytest

from project.parallel import plan_batches
from project.runtime.errors import ConfigError


def test_same_global_batch_splits_into_accumulation_on_fewer_devices():
    one = plan_batches(global_batch_size=32, data_parallel_size=1, micro_batch_size=8)
    four = plan_batches(global_batch_size=32, data_parallel_size=4, micro_batch_size=8)
    assert (one.micro_batch_size, one.accumulate_grad_batches) == (8, 4)
    assert (four.micro_batch_size, four.accumulate_grad_batches) == (8, 1)


def test_micro_batch_defaults_to_the_per_replica_share():
    plan = plan_batches(global_batch_size=12, data_parallel_size=3)
    assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (4, 1)


def test_global_batch_not_divisible_by_replicas_is_a_clear_error():
    with pytest.raises(ConfigError, match="global_batch_size=10 does not divide over 4"):
        plan_batches(global_batch_size=10, data_parallel_size=4)


def test_micro_batch_not_dividing_the_share_is_a_clear_error():
    with pytest.raises(ConfigError, match="micro_batch_size=3"):
        plan_batches(global_batch_size=16, data_parallel_size=2, micro_batch_size=3)

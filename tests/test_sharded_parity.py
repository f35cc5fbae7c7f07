"""Every sharded and tensor-parallel layout (and compiled blocks) optimizes like one device: same per-step loss and
final weights.

torchtitan's method: the same seed weights, the same global batch, a 1-device reference (`python -m project.train`
on one process). The layouts train on gloo processes on the CPU, together (tests/in_process.py).
"""

import pytest
import torch
from conftest import PARITY_RUN, assert_reproduces, read_metrics, run_train

from project.checkpoint.reshard import read_whole

pytestmark = pytest.mark.slow

LAYOUTS = {
    # strategy.compile=true where the model stays whole: compiled blocks optimize as the eager ones do. One
    # device compiles through the same hook as ddp (WholeModelTransforms; tests/test_configs.py shows it has it).
    "ddp-compiled-blocks": ["strategy=ddp", "trainer.devices=2", "strategy.compile=true"],
    # strategy=fsdp: Lightning's names for FSDP2's settings (tests/test_configs.py: which each is; FULL_SHARD is
    # fsdp2 as it is, below).
    # Each block's gathered parameters kept from a micro batch's forward to its backward (four micro batches a step).
    "fsdp-shard-grad-op": [
        "strategy=fsdp",
        "trainer.devices=2",
        "strategy.sharding_strategy=SHARD_GRAD_OP",
        "micro_batch_size=1",
    ],
    "fsdp-hybrid-2x2": [
        "strategy=fsdp",
        "trainer.devices=4",
        "strategy.sharding_strategy=HYBRID_SHARD",
        "strategy.hybrid_shard_size=2",
    ],
    "fsdp-no-shard": ["strategy=fsdp", "trainer.devices=2", "strategy.sharding_strategy=NO_SHARD"],
    # Its checkpoints one file, gathered on rank 0 (the weights compared below are read from it).
    "fsdp-one-file": ["strategy=fsdp", "trainer.devices=2", "strategy.state_dict_type=full"],
    "fsdp2": ["strategy=fsdp2", "trainer.devices=2"],
    "fsdp2-activation-checkpointing": ["strategy=fsdp2", "trainer.devices=2", "strategy.activation_checkpointing=true"],
    "fsdp2-compiled-blocks": ["strategy=fsdp2", "trainer.devices=2", "strategy.compile=true"],
    # HSDP: each weight sharded within pairs of neighbouring ranks, its gradient shards all-reduced across the pairs
    # (two micro batches a step: after the second only).
    "fsdp2-hybrid-2x2": [
        "strategy=fsdp2",
        "trainer.devices=4",
        "strategy.data_parallel_shard_size=2",
        "micro_batch_size=1",
        "strategy.gradient_sync=replicas_at_last",
    ],
    "tp": ["strategy=tp", "trainer.devices=2"],  # loss on vocabulary-split logits (loss_parallel)
    "tp-gathered-logits": ["strategy=tp", "trainer.devices=2", "strategy.loss_parallel=false"],
    "tp-sequence-parallel": ["strategy=tp", "trainer.devices=2", "strategy.sequence_parallel=true"],
    "tp2-fsdp2-2d": ["strategy=tp_fsdp", "trainer.devices=4"],
    "tp2-sequence-parallel-fsdp2-2d": ["strategy=tp_fsdp", "trainer.devices=4", "strategy.sequence_parallel=true"],
    # HSDP with tensor parallelism: 8 ranks, tp 2 x data_replicate 2 x data_shard 2; each rank's unsharded gradients
    # kept through a step's two micro batches and reduced after the second.
    "tp2-fsdp2-hybrid-2x2": [
        "strategy=tp_fsdp",
        "trainer.devices=8",
        "strategy.data_parallel_shard_size=2",
        "micro_batch_size=1",
        "strategy.gradient_sync=at_last",
    ],
}

# Trained before the first test that reads one (tests/conftest.py: trained).
TRAINED_TOGETHER = [(*PARITY_RUN, *overrides) for overrides in LAYOUTS.values()]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_layout_matches_single_device_loss_and_weights(trained, single_reference, layout):
    assert_reproduces(trained(*PARITY_RUN, *LAYOUTS[layout]), single_reference)


def test_fsdp2_computes_in_bfloat16_when_asked(tiny_shards, single_reference, tmp_path):
    """param_dtype=bfloat16 really changes the compute dtype, and training stays close to float32's."""
    same_schedule = [*PARITY_RUN, "optim.decay_steps=12", "trainer.max_steps=3"]  # 3 of the reference's 12 steps
    run_train(
        tiny_shards, tmp_path, *same_schedule, "strategy=fsdp2", "trainer.devices=2", "strategy.param_dtype=bfloat16"
    )
    reference, loss = read_metrics(single_reference, "train/loss"), read_metrics(tmp_path, "train/loss")
    for step in range(3):
        assert loss[step] != reference[step]  # float32 would agree to ~1e-7
        assert loss[step] == pytest.approx(reference[step], rel=2e-2)  # bfloat16 keeps about 3 significant digits
    weights = read_whole(tmp_path / "checkpoints" / "last.ckpt")["state_dict"]
    assert all(w.dtype == torch.float32 for w in weights.values())  # the sharded master weights stay float32

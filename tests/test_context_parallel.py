"""Context parallelism (`strategy.context_parallel_size`): each sequence split over a group of ranks trains like one
device (per-step loss and gradient norm, final weights), alone and with data, tensor and pipeline parallelism, with
document masking, and across a change of the degree on resume, each rank holding fewer activations; settings that
cannot split are refused before any process starts. The attention itself, and a rank's activations at 4,096 tokens,
against one device: tests/test_parallel_in_process.py.

The layouts train on gloo processes on the CPU, together (tests/in_process.py), against the one-device runs that the
other parity tests share (tests/conftest.py).
"""

import json
import re

import pytest
from conftest import (
    DOCUMENT_RUN,
    PARITY_RUN,
    PIPELINE_RUN,
    RESUME_RUN,
    assert_continues,
    assert_reproduces,
    assert_validates_like,
    read_metrics,
    train_overrides,
)
from hydra import compose, initialize_config_dir
from in_process import ROOT, train_in_process

from project.config.checks import preflight
from project.parallel.mesh import MeshShape
from project.runtime.errors import ConfigError

pytestmark = pytest.mark.slow

RING = "strategy.context_parallel_kv=ring"
LAYOUTS = {
    "cp2": ["strategy=fsdp2", "trainer.devices=2", "strategy.context_parallel_size=2"],
    "cp4": ["strategy=fsdp2", "trainer.devices=4", "strategy.context_parallel_size=4"],
    "cp2-tp2": ["strategy=tp_fsdp", "trainer.devices=4", "strategy.context_parallel_size=2"],
    "cp2-dp2": ["strategy=fsdp2", "trainer.devices=4", "strategy.context_parallel_size=2"],
    # Ring attention: keys and values passed around a ring of 4 (and of 2 beside tensor parallelism), not gathered.
    "cp4-ring": ["strategy=fsdp2", "trainer.devices=4", "strategy.context_parallel_size=4", RING],
    "cp2-tp2-ring": ["strategy=tp_fsdp", "trainer.devices=4", "strategy.context_parallel_size=2", RING],
}
# Each layout without its context parallelism: the same replicas and tensor-parallel degree (None: one device, the
# single reference; FSDP2's gathered parameters, freed after the forward, are not counted as activations).
WITHOUT = {
    "cp2": None,
    "cp4": None,
    "cp2-tp2": ["strategy=tp", "trainer.devices=2"],
    "cp2-dp2": ["strategy=fsdp2", "trainer.devices=2"],
    "cp4-ring": None,
    "cp2-tp2-ring": ["strategy=tp", "trainer.devices=2"],
}

# Two pipeline stages, each on a context group of two ranks (the 4-layer model of the pipeline's tests).
PIPELINE_SPLIT = ["strategy=pipeline", "trainer.devices=4", "strategy.context_parallel_size=2"]

# Trained before the first test that reads one (tests/conftest.py: trained); the runs without context parallelism
# are those of tests/test_sharded_parity.py where it has them.
TRAINED_TOGETHER = [
    *[(*PARITY_RUN, *overrides) for overrides in [*LAYOUTS.values(), *filter(None, WITHOUT.values())]],
    (*PIPELINE_RUN, *PIPELINE_SPLIT),
    (*PIPELINE_RUN, *PIPELINE_SPLIT, RING),
]


def activation_bytes(run_dir) -> int:
    """What MemoryMonitor found rank 0 saved for backward at the run's last logging step."""
    return json.loads((run_dir / "memory" / "rank0.json").read_text())["activation_bytes"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_sequences_split_over_ranks_train_like_one_device(trained, single_reference, layout):
    run_dir = trained(*PARITY_RUN, *LAYOUTS[layout])
    assert_reproduces(run_dir, single_reference)
    # Each rank computed only its part of every sequence: its activations are well under those of the same layout
    # without context parallelism (which would reproduce the losses too, every rank running whole sequences).
    without = single_reference if WITHOUT[layout] is None else trained(*PARITY_RUN, *WITHOUT[layout])
    assert activation_bytes(run_dir) < 0.75 * activation_bytes(without)


@pytest.mark.parametrize("kv", ["gather", "ring"])
def test_pipeline_stages_split_sequences_like_one_device(trained, pipeline_reference, kv):
    """Each stage runs its ranks' parts of every microbatch's sequences, the keys and values gathered or passed
    around a ring; validation goes through the stages too."""
    run_dir = trained(*PIPELINE_RUN, *PIPELINE_SPLIT, *([RING] if kv == "ring" else []))
    assert_reproduces(run_dir, pipeline_reference)
    assert_validates_like(run_dir, pipeline_reference)


def test_document_masks_hold_across_the_split(short_document_shards, document_mask_reference, tmp_path):
    """Each rank keeps its rows of the whole sequences' masks (conftest.document_mask_reference: the masks matter),
    with the keys and values gathered and passed around a ring alike."""
    overrides = [*DOCUMENT_RUN, "strategy=fsdp2", "trainer.devices=2", "strategy.context_parallel_size=2"]
    runs = {"cp2": tmp_path / "cp2", "cp2-ring": tmp_path / "cp2-ring"}
    cases = [(runs["cp2"], train_overrides(short_document_shards, runs["cp2"], *overrides))]
    cases.append((runs["cp2-ring"], train_overrides(short_document_shards, runs["cp2-ring"], *overrides, RING)))
    train_in_process(2, cases)
    reference = read_metrics(document_mask_reference, "train/loss")
    for name, run_dir in runs.items():
        losses = read_metrics(run_dir, "train/loss")
        assert sorted(losses) == sorted(reference), name
        for step in reference:
            assert losses[step] == pytest.approx(reference[step], rel=1e-5), (name, step)


def test_a_run_resumes_under_another_context_parallel_degree(tiny_shards, uninterrupted_reference, tmp_path):
    """cp=2 to step 7, then two replicas without context parallelism to 14, then cp=2 by ring to 20: the losses of one
    uninterrupted run, data position kept (the checkpoint is FSDP2's, over data x context: any layout reads it,
    test_sharded_checkpoints)."""
    cp2 = ["strategy=fsdp2", "trainer.devices=2", "strategy.context_parallel_size=2"]
    two_ranks = [
        ["trainer.max_steps=7", *cp2],
        ["trainer.max_steps=14", "strategy=fsdp2", "trainer.devices=2", "ckpt_path=last"],
        ["trainer.max_steps=20", *cp2, RING, "ckpt_path=last"],
    ]
    train_in_process(2, [(tmp_path, train_overrides(tiny_shards, tmp_path, *RESUME_RUN, *o)) for o in two_ranks])
    assert_continues(tmp_path, uninterrupted_reference, 20)


def compose_train(*overrides: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=["experiment=debug", *overrides])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["strategy.context_parallel_size=3", "trainer.devices=6"],
            "data.seq_len=64 does not cut into 2 x strategy.context_parallel_size=3 = 6 equal chunks",
        ),
        (
            ["strategy.context_parallel_size=0", "trainer.devices=2"],
            "strategy.context_parallel_size=0: give the number of ranks that split each sequence (1: none)",
        ),
        (
            ["strategy.context_parallel_size=4", "trainer.devices=2"],
            "strategy.context_parallel_size=4 does not divide the 2 devices",
        ),
        (
            ["strategy.context_parallel_size=2", "strategy.data_parallel_size=2", "trainer.devices=2"],
            "data_parallel_size=2 x context_parallel_size=2 x tensor_parallel_size=1 must equal the 2 devices",
        ),
        (
            ["strategy=ddp", "+strategy.context_parallel_size=2", "trainer.devices=2"],
            "ddp_strategy does not split sequences. Context parallelism runs under strategy=fsdp2, tp_fsdp, tp or "
            "pipeline",
        ),
        (  # a ring splits dense masks, not FlexAttention's block masks (GPUs)
            ["trainer=gpu", "trainer.devices=2", "strategy.context_parallel_size=2", RING, "document_mask=true"],
            "strategy.context_parallel_kv=ring does not split FlexAttention's block masks, and on GPUs the attention "
            "takes them for document_mask=true: set strategy.context_parallel_kv=gather.",
        ),
        (  # each context rank would step on its own gradients: the split-backward schedules run without FSDP2
            ["strategy=pipeline", "trainer.devices=4", "strategy.context_parallel_size=2", "strategy.schedule=zbv"],
            "strategy.context_parallel_size=1",
        ),
    ],
)
def test_settings_that_cannot_split_are_refused_before_any_process_starts(overrides, message):
    strategy = [] if any(o.startswith("strategy=") for o in overrides) else ["strategy=fsdp2"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(compose_train(*strategy, *overrides, "model.n_layers=4"), dry_run=True)


def test_the_layout_counts_context_parallel_ranks_apart_from_replicas():
    layout = preflight(compose_train("strategy=tp_fsdp", "trainer.devices=8", "strategy.context_parallel_size=2"))
    assert layout.shape == MeshShape(1, 2, 2, 2) and layout.shape.world_size == 8
    assert layout.plan.data_parallel_size == 2  # a context group reads one batch
    assert layout.name("debug", "tp_fsdp").startswith("debug_dp2-tp2-pp1-cp2_")
    assert layout.facts()["layout/context_parallel"] == 2

"""Pipeline parallelism trains like one device: every schedule, and pipelines with data and tensor
parallelism inside the stages; its checkpoints resume in any layout and export to Hugging Face.

The parity layouts train on gloo processes on the CPU together (tests/in_process.py), the others as
`python -m project.train` subprocesses, each under a time limit (torch's pipelining has been reported to hang on
gloo: pytorch#132644).
"""

import json

import pytest
import torch
from conftest import (
    DOCUMENT_RUN,
    PIPELINE_RUN,
    RESUME_RUN,
    assert_continues,
    assert_reproduces,
    assert_validates_like,
    read_metrics,
    run_module,
    run_train,
    train_overrides,
)

from project.model.config import LlamaConfig
from project.model.flops import count_parameters

pytestmark = pytest.mark.slow

PP2 = ["strategy=pipeline", "trainer.devices=2"]
LAYOUTS = {
    "pp2-gpipe": [*PP2, "strategy.schedule=gpipe"],
    "pp2-1f1b": [*PP2, "strategy.schedule=1f1b"],
    "pp2-interleaved-1f1b": [*PP2, "strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=2"],
    "pp2-looped-bfs": [*PP2, "strategy.schedule=looped_bfs", "strategy.virtual_stages=2"],
    "pp2-interleaved-zero-bubble": [*PP2, "strategy.schedule=interleaved_zero_bubble", "strategy.virtual_stages=2"],
    "pp2-zbv": [*PP2, "strategy.schedule=zbv"],
    "pp2-activation-checkpointing": [*PP2, "strategy.activation_checkpointing=true"],
    "pp4-1f1b": ["strategy=pipeline", "trainer.devices=4"],
    "pp2-dp2-fsdp2": ["strategy=pipeline", "trainer.devices=4", "strategy.data_parallel_size=2"],
    "pp2-tp2": ["strategy=pipeline", "trainer.devices=4", "strategy.tensor_parallel_size=2"],
    "pp2-dp2-tp2-sequence-parallel": [
        "strategy=pipeline",
        "trainer.devices=8",
        "strategy.data_parallel_size=2",
        "strategy.tensor_parallel_size=2",
        "strategy.sequence_parallel=true",
    ],
}

# Trained before the first test that reads one (tests/conftest.py: trained).
TRAINED_TOGETHER = [(*PIPELINE_RUN, *overrides) for overrides in LAYOUTS.values()]


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_pipeline_matches_single_device_loss_and_weights(trained, pipeline_reference, layout):
    run_dir = trained(*PIPELINE_RUN, *LAYOUTS[layout])
    assert_reproduces(run_dir, pipeline_reference)
    # Validation runs forward through the stages and evaluates the same sequences as one device.
    assert_validates_like(run_dir, pipeline_reference)


def test_pipeline_passes_document_masks_to_every_stage(short_document_shards, document_mask_reference, tmp_path):
    run_train(
        short_document_shards,
        tmp_path / "pipeline",
        *DOCUMENT_RUN,
        *PP2,
        "strategy.schedule=interleaved_1f1b",
        "strategy.virtual_stages=2",
    )
    single, pipeline = (
        read_metrics(document_mask_reference, "train/loss"),
        read_metrics(tmp_path / "pipeline", "train/loss"),
    )
    assert sorted(pipeline) == list(range(4))
    for step in single:
        assert pipeline[step] == pytest.approx(single[step], rel=1e-5), step


def test_each_pipeline_stage_holds_only_its_share_of_the_model(trained):
    run_dir = trained(*PIPELINE_RUN, *LAYOUTS["pp2-1f1b"])  # the parity run's folder: no training of its own
    model = LlamaConfig(vocab_size=300, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=32)
    ranks = [json.loads((run_dir / "memory" / f"rank{r}.json").read_text()) for r in range(2)]
    assert sum(r["param_bytes"] for r in ranks) == 4 * count_parameters(model)  # disjoint stages that cover the model
    for r in ranks:
        assert 0.3 < r["param_bytes"] / (4 * count_parameters(model)) < 0.7  # two blocks and one end of the model each
        assert r["grad_bytes"] == r["param_bytes"]
        assert 2 * r["param_bytes"] <= r["optimizer_bytes"] <= 2 * r["param_bytes"] + 1024


def test_pipeline_checkpoints_resume_under_other_layouts_and_back(tiny_shards, uninterrupted_reference, tmp_path):
    chain = [
        [],  # one device writes a single file ...
        PP2,  # ... a 2-stage pipeline resumes from it ...
        [],  # ... one device from the pipeline's folder ...
        [
            "strategy=pipeline",
            "trainer.devices=4",
            "strategy.tensor_parallel_size=2",
        ],  # ... pipeline x tensor from a file ...
        ["strategy=fsdp2", "trainer.devices=2"],  # ... and FSDP2 from the pipeline x tensor folder.
    ]
    for hop, layout in enumerate(chain):  # ckpt_path=auto: the first hop starts the run, the others resume it
        ran = run_train(
            tiny_shards, tmp_path, *RESUME_RUN, f"trainer.max_steps={4 * (hop + 1)}", "ckpt_path=auto", *layout
        )
        said = (
            "ckpt_path=auto: resuming the run from its last checkpoint" if hop else "ckpt_path=auto: no checkpoint in"
        )
        assert said in ran.stderr, ran.stderr[-3000:]
        # Each checkpoint (files and sharded folders) keeps its run's settings: a change of layout is only told.
        assert "resuming with settings that change what the run computes" not in ran.stderr, ran.stderr[-3000:]
        assert not hop or "resuming with other settings of the layout or bookkeeping: " in ran.stderr
    assert_continues(tmp_path, uninterrupted_reference, 20)


def test_pipeline_checkpoint_exports_to_transformers(tiny_shards, tmp_path):
    transformers = pytest.importorskip("transformers")
    from project.checkpoint.reshard import read_whole
    from project.model.llama import Llama
    from project.training.lit_module import LlamaLitModule

    run_train(tiny_shards, tmp_path, "trainer.max_steps=3", "global_batch_size=8", *PP2)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    result = run_module("project.export", [f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'hf'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    full = read_whole(ckpt)
    ours = Llama(LlamaConfig(**full["hyper_parameters"]["model"])).eval()
    ours.load_state_dict({k.removeprefix("model."): v for k, v in full["state_dict"].items()})  # every stage's weights
    loaded = LlamaLitModule.load_from_checkpoint(ckpt).model  # the Python API reads the folder too
    assert all(torch.equal(v, full["state_dict"][f"model.{k}"]) for k, v in loaded.state_dict().items())
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["strategy.pipeline_parallel_size=4", "trainer.devices=4"],
            "model.n_layers=2 is fewer than the 4 pipeline stage chunks",
        ),
        (["strategy.n_microbatches=3", "trainer.devices=2"], "n_microbatches=3 microbatches"),
        (["strategy.n_microbatches=1", "trainer.devices=2"], "needs at least 2 microbatches per step"),
        (
            ["strategy.pipeline_parallel_size=2", "strategy.data_parallel_size=2", "trainer.devices=2"],
            "must equal the 2 devices",
        ),
    ],
    ids=["fewer-layers-than-stages", "batch-not-split", "too-few-microbatches", "degrees-not-world"],
)
def test_pipeline_settings_that_cannot_run_fail_before_any_process_starts(tiny_shards, tmp_path, overrides, message):
    result = run_module("project.train", train_overrides(tiny_shards, tmp_path, "strategy=pipeline", *overrides))
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert "Initializing distributed" not in result.stdout + result.stderr

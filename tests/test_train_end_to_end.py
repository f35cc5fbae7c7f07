from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_module, run_train, train_overrides

pytestmark = pytest.mark.slow
PEAK = 1e12  # a made-up device peak, so that train/mfu is logged on the CPU
EXPERIMENTS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "experiment").glob("*.yaml"))


@pytest.fixture(scope="module")
def debug_run(tiny_shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("debug-run")
    # Started cold, as a user's command starts: the time to the first step counts the imports (a test below).
    result = run_module(
        "project.train", train_overrides(tiny_shards, run_dir, f"peak_flops_per_device={PEAK}"), warm=False
    )
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return run_dir, result


def test_debug_experiment_trains_and_lowers_the_loss(debug_run):
    run_dir, _ = debug_run
    loss = read_metrics(run_dir, "train/loss")
    assert sorted(loss) == list(range(30))
    assert loss[29] < loss[0] - 1.0  # from ~ln(300)=5.7 down: the model learns the generated text


def test_run_directory_holds_config_metrics_and_checkpoints(debug_run):
    run_dir, _ = debug_run
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert list((run_dir / "checkpoints").glob("best-*.ckpt"))
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    for name in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_sec",
        "train/tokens_seen",
        "val/loss",
        "val/ppl",
    ):
        assert name in header
    val = read_metrics(run_dir, "val/loss")
    ppl = read_metrics(run_dir, "val/ppl")
    assert set(val) == {9, 19, 29}
    assert ppl[29] == pytest.approx(torch.exp(torch.tensor(val[29])).item(), rel=1e-5)
    assert read_metrics(run_dir, "train/tokens_seen")[29] == 30 * 8 * 32


def test_best_checkpoint_is_the_lowest_validation_loss(debug_run):
    run_dir, _ = debug_run
    best = list((run_dir / "checkpoints").glob("best-*.ckpt"))
    val = read_metrics(run_dir, "val/loss")
    lowest = min(val, key=val.get)
    assert [p.name for p in best] == [f"best-step{lowest + 1:06d}.ckpt"]  # the checkpoint after step index `lowest`
    callbacks = torch.load(best[0], weights_only=False)["callbacks"]
    score = next(v["best_model_score"] for k, v in callbacks.items() if "val/loss" in k)
    assert float(score) == pytest.approx(val[lowest], rel=1e-6)


def test_mfu_is_model_flops_over_the_device_peak(debug_run):
    from project.model.config import LlamaConfig
    from project.model.flops import training_flops_per_token

    run_dir, _ = debug_run
    config = LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32)
    mfu, tps = read_metrics(run_dir, "train/mfu"), read_metrics(run_dir, "train/tokens_per_sec")
    assert set(mfu) == set(tps) == set(range(30))
    for step in mfu:
        assert mfu[step] == pytest.approx(training_flops_per_token(config, 32) * tps[step] / PEAK, rel=1e-5)


def test_every_metric_the_run_logs_is_one_the_callbacks_settings_check_knows(debug_run):
    # project.config.callbacks.LOGGED_METRICS is what a callback's `monitor` is checked against before training.
    from project.config.callbacks import logged_by

    run_dir, _ = debug_run
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "val/loss" in header and "memory/peak_bytes" in header and "checkpoint/seconds" in header
    assert [name for name in header if logged_by(name) is None] == []
    # What the module logs through self.log is what a monitor reads; what callbacks write to the loggers is not.
    assert logged_by("val/loss").monitorable and logged_by("train/mfu").monitorable
    assert not logged_by("layout/world_size").monitorable and not logged_by("checkpoint/seconds").monitorable


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_two_steps(tiny_shards, tmp_path, experiment):
    args = train_overrides(tiny_shards, tmp_path, "trainer.max_steps=2", "val_every_n_steps=1", "global_batch_size=4")
    args[0] = f"experiment={experiment}"
    result = run_module("project.train", args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(read_metrics(tmp_path, "val/loss")) == [0, 1]


def test_trainer_settings_the_entry_point_computes_are_refused(tiny_shards, tmp_path):
    result = run_module("project.train", train_overrides(tiny_shards, tmp_path, "+trainer.accumulate_grad_batches=4"))
    assert result.returncode == 2
    assert "trainer.accumulate_grad_batches is computed by project.train: set global_batch_size" in result.stderr


def test_cpu_offload_on_a_cpu_run_is_a_clear_error(tiny_shards, tmp_path):
    args = train_overrides(
        tiny_shards, tmp_path, "strategy=fsdp", "strategy.cpu_offload=true", "trainer.devices=2", "global_batch_size=8"
    )
    result = run_module("project.train", args)
    assert result.returncode == 2
    assert "this run is already on the CPU: set strategy.cpu_offload=false" in result.stderr


def test_checkpoint_loads_back_into_a_llama(debug_run):
    from project.model.llama import Llama
    from project.training.lit_module import LlamaLitModule

    run_dir, _ = debug_run
    module = LlamaLitModule.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt", map_location="cpu")
    assert isinstance(module.model, Llama)
    assert module.model.config.vocab_size == 300
    logits = module.model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, 300)


def test_learning_rate_follows_warmup_then_cosine(debug_run):
    from project.training.lit_module import OptimConfig, lr_at

    run_dir, _ = debug_run
    lr = read_metrics(run_dir, "train/lr")
    cfg = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5)
    for step, value in lr.items():
        assert value == pytest.approx(lr_at(step, cfg, total_steps=30), rel=1e-5)


def test_model_vocabulary_smaller_than_tokenizer_is_a_clear_error(tiny_shards, tmp_path):
    result = run_module("project.train", train_overrides(tiny_shards, tmp_path / "run", "model.vocab_size=100"))
    assert result.returncode == 2
    assert "model.vocab_size=100 is smaller than the tokenizer's 300" in result.stderr
    assert "Traceback" not in result.stderr


def test_global_batch_not_divisible_by_devices_is_a_clear_error(tiny_shards, tmp_path):
    args = train_overrides(tiny_shards, tmp_path / "run", "strategy=ddp", "trainer.devices=2", "global_batch_size=7")
    result = run_module("project.train", args)
    assert result.returncode == 2
    assert "global_batch_size=7 does not divide over 2 data-parallel ranks" in result.stderr


def test_trained_checkpoint_exports_to_transformers_with_equal_logits(debug_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from project.training.lit_module import LlamaLitModule

    run_dir, _ = debug_run
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    result = run_module("project.export", [f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'hf'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = LlamaLitModule.load_from_checkpoint(ckpt, map_location="cpu").model.eval()
    ids = torch.tensor([tokenizer("Fair lady, speak of love and war.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def test_training_prepares_missing_shards_from_the_data_sources(tmp_path):
    from conftest import write_corpus

    corpus = write_corpus(tmp_path / "raw", documents=4, lines=100)
    shards = tmp_path / "fresh-shards"  # nothing prepared here yet
    data = [f"data.sources=[{corpus}/*.txt]", "data.fetch=null", "trainer.max_steps=2"]
    refused = run_module(
        "project.train", train_overrides(shards, tmp_path / "refused", *data, "data.auto_prepare=false")
    )
    assert (
        refused.returncode == 2 and "missing manifest.json" in refused.stderr and "data.auto_prepare" in refused.stderr
    )
    # A run shorter than trainer.log_every_n_steps still writes its metrics (here: after its last step).
    run_train(shards, tmp_path / "run", *data, "trainer.log_every_n_steps=50")
    assert (shards / "manifest.json").is_file() and (shards / "tokenizer.json").is_file()
    assert sorted(read_metrics(tmp_path / "run", "train/loss")) == [1]


def test_resuming_a_finished_run_says_there_is_nothing_to_do(debug_run, tiny_shards):
    run_dir, _ = debug_run
    before = (run_dir / "metrics.csv").read_text()
    record = {p.name: p.read_text() for p in [*(run_dir / ".hydra").iterdir(), run_dir / "config.yaml"]}
    assert {"config.yaml", "hydra.yaml", "overrides.yaml"} <= record.keys()
    result = run_train(tiny_shards, run_dir, f"peak_flops_per_device={PEAK}", "ckpt_path=last")
    assert "already trained to step 30 (trainer.max_steps=30): nothing to do" in result.stdout + result.stderr
    assert (run_dir / "metrics.csv").read_text() == before
    # The run's record is the run's, not the no-op start's; nor a refused start's.
    assert {p.name: p.read_text() for p in [*(run_dir / ".hydra").iterdir(), run_dir / "config.yaml"]} == record
    refused = run_module(
        "project.train", train_overrides(tiny_shards, run_dir, "ckpt_path=last", "trainer.max_steps=40", "model.dim=32")
    )
    assert refused.returncode == 2 and "holds a model of another shape" in refused.stderr
    assert {p.name: p.read_text() for p in [*(run_dir / ".hydra").iterdir(), run_dir / "config.yaml"]} == record


def test_a_refused_run_leaves_no_run_directory(tiny_shards, tmp_path):
    run_dir = tmp_path / "never-ran"
    result = run_module(
        "project.train",
        train_overrides(tiny_shards, run_dir, "global_batch_size=7", "trainer.devices=2", "strategy=ddp"),
    )
    assert result.returncode == 2 and "global_batch_size=7" in result.stderr
    assert not run_dir.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a usable GPU")
def test_trainer_gpu_without_a_gpu_says_how_to_get_one(tiny_shards, tmp_path):
    result = run_module("project.train", train_overrides(tiny_shards, tmp_path / "run", "trainer=gpu"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "needs a CUDA GPU" in result.stderr and "trainer=cpu" in result.stderr


def test_the_time_to_the_first_step_is_logged_once_and_printed(debug_run):
    run_dir, result = debug_run
    first = read_metrics(run_dir, "time/seconds_to_first_step")
    assert list(first) == [0] and 1.0 < first[0] < 300  # imports alone take seconds
    assert f"first optimizer step done {first[0]:.1f} s after the command started" in result.stdout + result.stderr

import pytest
import torch

from conftest import read_metrics, run_module, run_train, train_overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def debug_run(tiny_shards, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("debug-run")
    result = run_train(tiny_shards, run_dir)
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
    for name in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/tokens_seen", "val/loss", "val/ppl"):
        assert name in header
    val = read_metrics(run_dir, "val/loss")
    ppl = read_metrics(run_dir, "val/ppl")
    assert set(val) == {9, 19, 29}
    assert ppl[29] == pytest.approx(torch.exp(torch.tensor(val[29])).item(), rel=1e-5)
    assert read_metrics(run_dir, "train/tokens_seen")[29] == 30 * 8 * 32


def test_checkpoint_loads_back_into_a_llama(debug_run):
    from project import Llama, LlamaLitModule

    run_dir, _ = debug_run
    module = LlamaLitModule.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt", map_location="cpu")
    assert isinstance(module.model, Llama)
    assert module.model.config.vocab_size == 300
    logits = module.model(torch.zeros(1, 4, dtype=torch.long))
    assert logits.shape == (1, 4, 300)


def test_learning_rate_follows_warmup_then_cosine(debug_run):
    from project.lit_module import OptimConfig, lr_at

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
    from project import LlamaLitModule

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

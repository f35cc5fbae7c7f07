"""strategy.float8: the blocks' linear layers train in float8 (torchao's, emulated on the CPU), with the products a
float8 rounding formula written out here gives, close to float32 over a run, like one device in every layout, and
resumable in either precision.

The layouts train on gloo processes on the CPU, together (tests/in_process.py). Their float8 references are one
device's runs of the same settings: for layouts that split a step's batch over data-parallel ranks or pipeline
microbatches, one device that accumulates the same micro batches, since float8's scales are each micro batch's own
(project/parallel/float8.py).
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
from conftest import PARITY_RUN, assert_reproduces, read_metrics, train_overrides
from in_process import ROOT, train_in_process
from torch import nn

from project.model.config import LlamaConfig
from project.model.llama import Llama
from project.parallel.float8 import apply_float8, check_float8_device, torchao_float8
from project.runtime.errors import ConfigError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as float8 `dtype` holds it with one scale for the tensor (its largest magnitude at the format's largest
    value), back in float32."""
    top = torch.finfo(dtype).max
    scale = (top / t.detach().abs().amax().double().clamp(min=1e-12)).float()
    return (t * scale).clamp(-top, top).to(dtype).float() / scale


class Float8Product(torch.autograd.Function):
    """x @ w.T of the rounded x and w (e4m3); backward with the output gradient rounded to e5m2."""

    @staticmethod
    def forward(ctx, x, w):
        x8, w8 = rounded(x, E4M3), rounded(w, E4M3)
        ctx.save_for_backward(x8, w8)
        return x8 @ w8.T

    @staticmethod
    def backward(ctx, grad):
        x8, w8 = ctx.saved_tensors
        g8 = rounded(grad, E5M2)
        return g8 @ w8, g8.reshape(-1, g8.shape[-1]).T @ x8.reshape(-1, x8.shape[-1])


class FormulaLinear(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return Float8Product.apply(x, self.weight)


TINY = LlamaConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=64)


def test_the_blocks_linears_compute_float8_rounded_products_forward_and_backward():
    torch.manual_seed(0)
    model = Llama(TINY)
    formula = Llama(TINY)
    formula.load_state_dict(model.state_dict())
    for block in formula.layers.values():
        for sub in (block.attention, block.feed_forward):
            for name, child in list(sub.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(sub, name, FormulaLinear(child.weight))
    apply_float8(model, "tensorwise", torch.device("cpu"), compiled=False, gather=False)

    float8_linear = torchao_float8().float8_linear.Float8Linear
    assert type(model.output) is nn.Linear  # the head keeps its precision
    assert sum(isinstance(m, float8_linear) for m in model.modules()) == 7 * TINY.n_layers
    assert model.state_dict().keys() == formula.state_dict().keys()  # checkpoints hold the plain model's names

    tokens = torch.randint(0, TINY.vocab_size, (2, 33))
    losses = [m(tokens[:, :-1], targets=tokens[:, 1:]) for m in (model, formula)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), formula.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8, msg=name)
    # and float8 is not float32: the plain model's loss differs by float8's rounding
    plain = Llama(TINY)
    plain.load_state_dict(formula.state_dict())
    assert abs(plain(tokens[:, :-1], targets=tokens[:, 1:]).item() - losses[0].item()) > 1e-5


def test_layers_whose_shapes_float8_cannot_take_keep_their_precision_and_are_named(caplog):
    # heads of 8: the keys' and values' projections are 8 wide, not a multiple of 16
    config = LlamaConfig(vocab_size=96, dim=64, n_layers=1, n_heads=8, n_kv_heads=1, multiple_of=32, max_seq_len=64)
    model = Llama(config)
    with caplog.at_level(logging.INFO):
        apply_float8(model, "rowwise", torch.device("cpu"), compiled=False, gather=False)
    assert type(model.layers["0"].attention.wk) is nn.Linear and type(model.layers["0"].attention.wv) is nn.Linear
    assert type(model.layers["0"].attention.wq) is torchao_float8().float8_linear.Float8Linear
    assert "layers.0.attention.wk, layers.0.attention.wv" in caplog.text


def test_the_shapes_checked_are_those_each_tensor_parallel_rank_holds():
    from project.parallel.float8_rules import in_float8, sub_layer_in_float8

    # keys and values 32 wide: 16 on each of 2 ranks, 8 on each of 4, which float8 kernels cannot take
    assert len(in_float8(TINY, 2)) == 7
    assert sorted(set(in_float8(TINY)) - set(in_float8(TINY, 4))) == ["attention.wk", "attention.wv"]
    assert not sub_layer_in_float8(TINY, "attention", 4) and sub_layer_in_float8(TINY, "feed_forward", 4)
    model = Llama(TINY)
    apply_float8(model, "tensorwise", torch.device("cpu"), compiled=False, gather=False, tensor_parallel=4)
    assert type(model.layers["0"].attention.wk) is nn.Linear
    assert type(model.layers["0"].attention.wq) is torchao_float8().float8_linear.Float8Linear


def test_a_model_float8_can_take_no_layer_of_is_refused():
    config = LlamaConfig(vocab_size=96, dim=72, n_layers=1, n_heads=6, multiple_of=8, max_seq_len=64)
    with pytest.raises(ConfigError, match="strategy.float8=tensorwise: no linear layer"):
        apply_float8(Llama(config), "tensorwise", torch.device("cpu"), compiled=False, gather=False)


def test_a_gpu_without_float8_products_is_refused_and_an_uncompiled_one_warned(monkeypatch):
    import warnings

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match=r"A100.*capability 8.0.*start at compute capability 8.9.*float8=null"):
        check_float8_device("tensorwise", torch.device("cuda", 0), compiled=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_float8_device("tensorwise", torch.device("cuda", 0), compiled=True) is False  # real float8
    assert caught == []
    with pytest.warns(UserWarning, match="without strategy.compile=true"):
        check_float8_device("rowwise", torch.device("cuda", 0), compiled=False)
    assert check_float8_device("rowwise", torch.device("cpu"), compiled=False) is True  # emulated


def test_the_trainers_device_check_refuses_float8_on_a_gpu_without_float8_products(monkeypatch):
    """check_devices runs as soon as the Trainer is built (project.training.run.fit_once), before the data is
    prepared and the model built: the first place a run sees its node's GPU."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from project.training.trainer import check_devices

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    cfg = OmegaConf.create({"trainer": {"devices": 1}, "strategy": {"float8": "tensorwise"}})
    on = {kind: SimpleNamespace(num_devices=1, strategy=SimpleNamespace(root_device=torch.device(kind, 0)))
          for kind in ("cuda", "cpu")}  # fmt: skip
    with pytest.raises(ConfigError, match=r"V100.*compute capability 7.0.*strategy.float8=null"):
        check_devices(cfg, on["cuda"])
    check_devices(cfg, on["cpu"])  # emulated
    cfg.strategy.float8 = None
    check_devices(cfg, on["cuda"])  # bf16 on the same GPU goes on
    cfg.strategy.float8 = "blockwise"
    with pytest.raises(ConfigError, match=r"'blockwise'.*tensorwise, rowwise"):
        check_devices(cfg, on["cpu"])


def test_float8_without_torchao_says_how_to_install_it_before_training(monkeypatch):
    import importlib.util

    from hydra import compose, initialize_config_dir

    from project.config.checks import preflight

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=debug", "strategy.float8=rowwise"])
    with pytest.raises(ConfigError, match=r"strategy.float8=rowwise needs torchao.*make install"):
        preflight(cfg)


def test_torchao_is_imported_without_messages_about_cuda_libraries():
    code = "from project.parallel.float8 import torchao_float8; torchao_float8()"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr


# -- training runs ---------------------------------------------------------------------------------------------

slow = pytest.mark.slow
# The debug model's losses in float8 against float32, step by step over 30 steps (relative): measured 2026-11-27, at
# most 1.4e-3; a resume's in the other precision against the run it resumes, at most 8.8e-5 over its 2 steps (into or
# out of bf16-mixed: 7.3e-5).
FLOAT8_TRACKING = 3e-3
# A float8 layout's losses against one device's in float8 over 12 steps (relative): measured 2026-11-27, at most
# 4.4e-4 (context parallelism; tensor parallelism with sequence parallelism 3.8e-4), as one device taking the step's
# batch at once against two micro batches (5.8e-4): float8's rounding. The runs below take STEPS steps, fewer.
FLOAT8_DRIFT = 1e-3

# STEPS steps, validated and saved at step AT (0-based: best-step00000{AT}.ckpt, which the resumed runs go on from).
STEPS, AT = 6, 4
BEST = f"best-step{AT:06d}.ckpt"
RUN = [*PARITY_RUN, f"trainer.max_steps={STEPS}", f"val_every_n_steps={AT}", f"ckpt_every_n_steps={AT}"]
TENSORWISE, ROWWISE = "strategy.float8=tensorwise", "strategy.float8=rowwise"
BF16 = "trainer.precision=bf16-mixed"  # a GPU run's precision (on this CPU, bf16 products of a tiny model)
ACCUMULATED = "micro_batch_size=4"  # one device taking the 8 sequences of a step as two micro batches of 4
PARALLEL = {
    # name: (overrides, the one-device run it equals)
    "ddp": (["strategy=ddp", "trainer.devices=2", TENSORWISE], "accumulated"),
    "fsdp2": (["strategy=fsdp2", "trainer.devices=2", TENSORWISE], "accumulated"),  # float8 gathers
    "tp": (["strategy=tp", "trainer.devices=2", TENSORWISE], "tensorwise"),  # float8 tensor-parallel styles
    "tp-rowwise": (["strategy=tp", "trainer.devices=2", ROWWISE], "rowwise"),
    "pipeline": (["strategy=pipeline", "trainer.devices=2", ACCUMULATED, TENSORWISE], "accumulated"),
    "tp2-sequence-parallel-fsdp2": (
        ["strategy=tp_fsdp", "trainer.devices=4", "strategy.sequence_parallel=true", TENSORWISE],
        "accumulated",
    ),
}
ONE_DEVICE = {
    "tensorwise": [TENSORWISE],
    "accumulated": [ACCUMULATED, TENSORWISE],
    "rowwise": [ROWWISE],
    "float32": [],
    "bf16": [BF16],
}
# 30 steps of the debug model (its experiment's own length), float8 against float32.
LONG = {"float32-30": ["trainer.max_steps=30"], "float8-30": ["trainer.max_steps=30", TENSORWISE]}
CONTEXT_PARALLEL = ["strategy=fsdp2", "trainer.devices=2", "strategy.context_parallel_size=2", TENSORWISE]
# Resumed at step AT (BEST) to the end, in the other precision and layout.
RESUMED = {
    "float8-fsdp2-to-float32-ddp": ("fsdp2", ["strategy=ddp", "trainer.devices=2"]),
    "float32-single-to-float8-tp": ("float32", ["strategy=tp", "trainer.devices=2", TENSORWISE]),
    # into FSDP2's float8 gathers, whose weights are torchao's wrappers
    "float32-single-to-float8-fsdp2": ("float32", ["strategy=fsdp2", "trainer.devices=2", TENSORWISE]),
    "float8-fsdp2-to-bf16-ddp": ("fsdp2", ["strategy=ddp", "trainer.devices=2", BF16]),
    "bf16-single-to-float8-tp": ("bf16", ["strategy=tp", "trainer.devices=2", TENSORWISE, BF16]),
}


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory) -> dict:
    names = [*ONE_DEVICE, *LONG, *PARALLEL, "context-parallel", *RESUMED]
    folders = {name: tmp_path_factory.mktemp(name) for name in names}  # a resume names its source's beforehand

    def cases(names_overrides: dict[str, list[str]]) -> list:
        return [(folders[name], train_overrides(tiny_shards, folders[name], *o)) for name, o in names_overrides.items()]

    def resumed(name: str) -> list[str]:
        source, overrides = RESUMED[name]
        return [*RUN, *overrides, f"ckpt_path={folders[source] / 'checkpoints' / BEST}"]

    one_device = {name: [*RUN, *o] for name, o in ONE_DEVICE.items()} | LONG
    train_in_process(1, cases(one_device))
    two = {name: [*RUN, *o] for name, (o, _) in PARALLEL.items() if "trainer.devices=2" in o}
    two["context-parallel"] = [*RUN, *CONTEXT_PARALLEL]
    two["float32-single-to-float8-tp"] = resumed("float32-single-to-float8-tp")
    two["float32-single-to-float8-fsdp2"] = resumed("float32-single-to-float8-fsdp2")
    two["bf16-single-to-float8-tp"] = resumed("bf16-single-to-float8-tp")
    for name in ("float8-fsdp2-to-float32-ddp", "float8-fsdp2-to-bf16-ddp"):
        two[name] = resumed(name)  # after fsdp2, in the same group
    train_in_process(2, cases(two))
    four = {name: [*RUN, *o] for name, (o, _) in PARALLEL.items() if "trainer.devices=4" in o}
    train_in_process(4, cases(four))
    return folders


def assert_float8_reproduces(run_dir, reference_dir, first_loss=1e-6, first_norm=1e-4):
    """The first step's loss to `first_loss` and gradient norm to `first_norm` (relative) as the reference's, and
    every step's loss within float8's drift of it."""
    for column, first in (("train/loss", first_loss), ("train/grad_norm", first_norm)):
        reference, run = read_metrics(reference_dir, column), read_metrics(run_dir, column)
        assert sorted(run) == sorted(reference) and len(run) == STEPS
        assert run[0] == pytest.approx(reference[0], rel=first), column
    reference, run = read_metrics(reference_dir, "train/loss"), read_metrics(run_dir, "train/loss")
    for step in reference:
        assert run[step] == pytest.approx(reference[step], rel=FLOAT8_DRIFT), step


@slow
@pytest.mark.parametrize("layout", PARALLEL, ids=list(PARALLEL))
def test_float8_trains_in_every_layout_like_one_device(runs, layout):
    """Each layout casts with one device's scales: its first step is one device's to 1e-6 (a scale computed from
    part of a tensor moves the loss by 5e-5, as context parallelism's does, below). Then float32 sums in another
    order (tensor parallelism's partial products, FSDP's reductions) now and then round to the other side of a
    float8 value, and the runs drift apart by float8's rounding, as two micro-batchings of one device do."""
    assert_float8_reproduces(runs[layout], runs[PARALLEL[layout][1]])


@slow
def test_data_parallel_float8_is_one_device_accumulating_its_micro_batches_exactly(runs):
    """Two ranks' gradients summed in one order: no float32 difference for float8 to round apart."""
    assert_reproduces(runs["ddp"], runs["accumulated"], steps=STEPS)


@slow
def test_float8_tracks_float32_over_the_debug_models_thirty_steps(runs):
    float32, float8 = read_metrics(runs["float32-30"], "train/loss"), read_metrics(runs["float8-30"], "train/loss")
    assert sorted(float8) == list(range(30))
    gaps = [abs(float8[step] - float32[step]) / float32[step] for step in float32]
    assert max(gaps) < FLOAT8_TRACKING, gaps
    assert max(gaps) > 1e-5  # it did train in float8


@slow
def test_context_parallel_float8_is_within_float8_rounding_of_one_device(runs):
    """Each rank scales its own part of every sequence: not one device's scales, so not to 1e-6 even at first."""
    assert_float8_reproduces(runs["context-parallel"], runs["tensorwise"], first_loss=2e-4, first_norm=FLOAT8_DRIFT)
    first = read_metrics(runs["context-parallel"], "train/loss")[0]
    assert first != pytest.approx(read_metrics(runs["tensorwise"], "train/loss")[0], rel=1e-6)


@slow
@pytest.mark.parametrize("resume", RESUMED, ids=list(RESUMED))
def test_a_checkpoint_resumes_in_the_other_precision_under_another_layout(runs, resume):
    source = runs[RESUMED[resume][0]]
    before, after = read_metrics(source, "train/loss"), read_metrics(runs[resume], "train/loss")
    assert sorted(after) == list(range(AT, STEPS))  # went on from step AT
    for step in after:  # the source's weights, one precision or the other: within float8's rounding of it
        assert after[step] == pytest.approx(before[step], rel=FLOAT8_TRACKING), step
        assert after[step] != pytest.approx(before[step], rel=1e-6), step


@slow
def test_a_float8_checkpoint_holds_the_plain_models_weights(runs):
    """FSDP2's float8 gathers wrap each weight in torchao's tensor that casts it: the checkpoint holds the weights
    themselves (loadable without torchao), named and shaped as a float32 run's."""
    from project.checkpoint.reshard import read_whole

    saved = [read_whole(runs[name] / "checkpoints" / "last.ckpt")["state_dict"] for name in ("fsdp2", "float32")]
    assert saved[0].keys() == saved[1].keys()
    for name, weight in saved[0].items():
        assert type(weight) is torch.Tensor and weight.dtype == saved[1][name].dtype == torch.float32, name
        assert weight.shape == saved[1][name].shape, name


@slow
def test_a_float8_runs_export_holds_its_trained_weights(runs, tmp_path):
    """Exported as any run's: the Hugging Face folder holds the checkpoint's own weights (no float8 anywhere)."""
    from safetensors.torch import load_file

    from project.checkpoint.reshard import read_whole
    from project.hf.conversion import hf_pieces
    from project.hf.export import export
    from project.model.families import model_config

    checkpoint = runs["fsdp2"] / "checkpoints" / "last.ckpt"
    export(str(checkpoint), str(tmp_path / "hf"))
    exported = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    whole = read_whole(checkpoint)
    trained, config = whole["state_dict"], model_config(whole["hyper_parameters"]["model"])
    assert len(exported) == len(trained)
    for name, weight in trained.items():
        [(hf, _)] = hf_pieces(name.removeprefix("model."), config)
        torch.testing.assert_close(exported[hf], weight, rtol=0, atol=0, msg=name)

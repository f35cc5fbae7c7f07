import math

import pytest
import torch

from project.parallel.contract import LlamaStrategy
from project.parallel.init import materialize
from project.training.lit_module import LlamaLitModule, OptimConfig, document_ids, lr_at

MODEL = dict(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=32)


def test_warmup_is_linear_and_cosine_ends_at_min_lr():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert [lr_at(s, cfg, 110) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(10, cfg, 110) < 1.0  # the peak is used once
    assert lr_at(59, cfg, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert lr_at(109, cfg, 110) == pytest.approx(0.1)  # the final step reaches min_lr
    assert lr_at(500, cfg, 110) == pytest.approx(0.1)


def test_document_ids_start_a_new_document_after_each_eos():
    tokens = torch.tensor([[5, 6, 0, 7, 8, 0, 0, 9]])
    assert document_ids(tokens, eos_id=0).tolist() == [[0, 0, 0, 1, 1, 1, 2, 3]]


def test_loss_is_next_token_cross_entropy():
    torch.manual_seed(0)
    module = LlamaLitModule(MODEL)
    tokens = torch.randint(0, 50, (2, 9))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    log_probs = module.model(inputs).log_softmax(-1)
    # mean negative log-probability of each position's next token, written out
    expected = -sum(log_probs[b, t, targets[b, t]] for b in range(2) for t in range(8)) / 16
    torch.testing.assert_close(module.loss(inputs, targets), expected)
    assert module.loss(inputs, targets).item() == pytest.approx(math.log(50), rel=0.05)  # near-uniform at init


def test_document_mask_changes_the_loss_only_when_documents_are_packed():
    torch.manual_seed(0)
    plain = LlamaLitModule(MODEL)
    masked = LlamaLitModule(MODEL, document_mask=True, eos_id=0)
    masked.model.load_state_dict(plain.model.state_dict())
    no_eos = torch.randint(1, 50, (2, 9))
    torch.testing.assert_close(masked.loss(no_eos[:, :-1], no_eos[:, 1:]), plain.loss(no_eos[:, :-1], no_eos[:, 1:]))
    packed = no_eos.clone()
    packed[:, 3] = 0
    assert not torch.allclose(masked.loss(packed[:, :-1], packed[:, 1:]), plain.loss(packed[:, :-1], packed[:, 1:]))


def test_weight_decay_applies_to_matrices_not_norms():
    module = LlamaLitModule(MODEL, optim={"weight_decay": 0.1})

    class _Trainer:
        max_steps = 100

    module.trainer = _Trainer()  # configure_optimizers reads trainer.max_steps for the schedule length
    optimizer = module.configure_optimizers()["optimizer"]
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decayed["params"]) and all(p.ndim == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(module.model.parameters()))


def test_hyperparameters_rebuild_the_same_model_configuration():
    module = LlamaLitModule(MODEL, optim={"lr": 1e-2})
    rebuilt = LlamaLitModule(**module.hparams)
    assert rebuilt.model.config == module.model.config and rebuilt.optim.lr == 1e-2


def test_gradient_clipping_caps_the_global_norm_and_reports_it_unclipped():
    module = LlamaLitModule(MODEL, optim={"grad_clip": 0.5})
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    expected_norm = math.sqrt(sum(p.numel() for p in module.parameters()))
    logged = {}
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    module.configure_gradient_clipping(optimizer=torch.optim.AdamW(module.parameters(), fused=True))
    assert logged["train/grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
    clipped = torch.sqrt(sum((p.grad**2).sum() for p in module.parameters()))
    assert clipped.item() == pytest.approx(0.5, rel=1e-4)


class StepRunningStrategy(LlamaStrategy):
    """A strategy that runs the model itself, as a pipeline does: the module asks it for each step's loss."""

    model_on_meta = True
    gradients_in_step = True

    def __init__(self):
        self.steps, self.parallelized, self.clipped = [], [], []

    def parallelize(self, model, initialize=True):
        self.parallelized.append(initialize)
        materialize(model, torch.device("cpu"), initialize)

    def step_loss(self, module, inputs, targets, train):
        self.steps.append(train)
        return torch.tensor(2.5) if train else torch.tensor(1.5)

    def clip_grad_norm(self, module, max_norm):
        self.clipped.append(max_norm)
        return torch.tensor(0.25)


def test_the_module_trains_through_the_strategy_contract_alone():
    from types import SimpleNamespace

    strategy = StepRunningStrategy()
    module = LlamaLitModule(MODEL, optim={"grad_clip": 0.5}, init_on_meta=strategy.model_on_meta)
    steps = {"global_step": 0, "log_every_n_steps": 1, "should_stop": False, "max_steps": 1}  # what logging asks
    module.trainer = SimpleNamespace(strategy=strategy, datamodule=None, precision_plugin=SimpleNamespace(), **steps)
    module.configure_model()
    assert strategy.parallelized == [True] and not any(p.is_meta for p in module.parameters())
    batch = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    assert module.training_step(batch, 0).item() == 2.5
    module.validation_step(batch, 0)
    assert strategy.steps == [True, False] and module.val_losses[0].compute().item() == 1.5
    # The strategy computed the gradients within the step: Lightning's zeroing before backward must keep them.
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    module.optimizer_zero_grad(0, 0, optimizer)
    assert all(p.grad is not None and bool((p.grad == 1).all()) for p in module.parameters())
    module.log = lambda *args, **kwargs: None  # no Trainer to log into
    module.configure_gradient_clipping(optimizer)
    assert strategy.clipped == [0.5]


def test_a_module_without_a_strategy_of_ours_keeps_lightnings_defaults():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import SingleDeviceStrategy

    torch.manual_seed(0)
    module = LlamaLitModule(MODEL)
    module.trainer = SimpleNamespace(strategy=SingleDeviceStrategy("cpu"), datamodule=None)  # Lightning's own
    batch = torch.randint(0, 50, (2, 8)), torch.randint(0, 50, (2, 8))
    assert module.training_step(batch, 0).item() == pytest.approx(module.loss(*batch).item())
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    module.optimizer_zero_grad(0, 0, optimizer)
    assert all(p.grad is None for p in module.parameters())


def test_in_a_slurm_job_a_strategy_keeps_a_cluster_environment_of_its_own_and_others_get_slurms(monkeypatch):
    # Horovod's strategy brings its launcher's environment (built only where Horovod is installed): any strategy
    # built with one stands in for it.
    from lightning.pytorch.plugins.environments import LightningEnvironment, SLURMEnvironment

    from project.parallel.strategies.ddp import GlooFriendlyDDPStrategy
    from project.parallel.strategies.model_parallel import LlamaParallelStrategy
    from project.training.trainer import cluster_plugins

    own = GlooFriendlyDDPStrategy(cluster_environment=LightningEnvironment())
    assert cluster_plugins(GlooFriendlyDDPStrategy()) == [] and cluster_plugins(own) == []  # not in a SLURM job
    monkeypatch.setattr(SLURMEnvironment, "detect", staticmethod(lambda: True))
    for strategy in (GlooFriendlyDDPStrategy(), LlamaParallelStrategy()):
        (plugin,) = cluster_plugins(strategy)
        assert isinstance(plugin, SLURMEnvironment) and not plugin.auto_requeue
    assert cluster_plugins(own) == []


def test_an_optimizer_state_saved_unfused_is_fused_again_when_training_resumes():
    """Checkpoints from before the default AdamW was fused restore fused=None: the module fuses the groups again
    (the non-finite guard then decides on the device), and they step."""
    from types import SimpleNamespace

    module = LlamaLitModule(MODEL)
    groups = [{"params": [p for _, p in group], "weight_decay": decay} for decay, group in module.decay_groups()]
    saved = torch.optim.AdamW(groups, lr=1e-3)  # as before: not fused
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    saved.step()
    module.trainer = SimpleNamespace(optimizers=[], max_steps=10)
    optimizer = module.configure_optimizers()["optimizer"]
    optimizer.load_state_dict(saved.state_dict())
    assert all(group["fused"] is None for group in optimizer.param_groups)  # what torch restores
    module.trainer.optimizers.append(optimizer)
    module.on_train_start()
    assert all(group["fused"] is True for group in optimizer.param_groups)
    optimizer.step()
    assert all(int(state["step"]) == 2 for state in optimizer.state.values())


def test_an_optimizer_without_a_fused_argument_is_a_config_error_naming_the_fix():
    import functools
    from types import SimpleNamespace

    from project.runtime.errors import ConfigError

    module = LlamaLitModule(MODEL, optimizer=functools.partial(torch.optim.RMSprop, lr=0.1, fused=True))
    module.trainer = SimpleNamespace(max_steps=10)
    with pytest.raises(ConfigError, match=r"~module.optimizer.fused"):
        module.configure_optimizers()


def test_a_resume_that_changes_the_schedule_says_which_setting_and_the_steps_rate_before_and_after():
    from project.training.schedule import schedule_change, schedule_record

    cfg = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5)
    # The tour's mistake: stopped by trainer.max_steps=20 (the schedule's length), resumed with max_steps 30.
    said = schedule_change(schedule_record(cfg, max_steps=20), schedule_record(cfg, max_steps=30), step=20)
    # Step 20 by hand: 20 steps end the cosine at min_lr; of 30, step 20 is 16 of 25 cosine steps.
    before = 3e-4
    after = 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * 16 / 25))
    assert said is not None and "optim.decay_steps: 20 there, 30 here" in said
    assert f"{before:.6f} on the checkpoint's schedule and {after:.6f} on this one" in said
    assert "set optim.decay_steps=20" in said
    # The same schedule (decay_steps given on the first run) resumes silently; another peak rate is named.
    kept = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5, decay_steps=30)
    assert schedule_change(schedule_record(kept, 20), schedule_record(cfg, 30), 20) is None
    lower = schedule_change(
        schedule_record(kept, 20), schedule_record(OptimConfig(lr=1e-3, min_lr=3e-4, warmup_steps=5), 30), 20
    )
    assert lower is not None and "optim.lr: 0.003 there, 0.001 here" in lower


def test_a_resume_of_a_run_that_rolled_back_still_says_a_changed_schedule():
    """The checkpoint of a run with rollbacks behind it is resumed like any other: its rollbacks are restored, and a
    changed length is said (project.training.callbacks.run_settings)."""
    import lightning

    from project.training.callbacks.run_settings import RunSettings
    from project.training.schedule import schedule_record

    module = LlamaLitModule(MODEL, OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5))
    module.trainer = lightning.Trainer(max_steps=30, logger=False, enable_checkpointing=False, accelerator="cpu")
    checkpoint = {
        "global_step": 20,
        "schedule": schedule_record(module.optim, max_steps=20),
        "stability": {"rollbacks": [{"spike_step": 12, "restart_step": 10, "resume_sample": 200}]},
    }
    module.on_load_checkpoint(checkpoint)
    assert [r.spike_step for r in module._spikes.rollbacks] == [12]
    resumed = RunSettings({}, schedule_record(module.optim, max_steps=30))
    with pytest.warns(UserWarning, match=r"optim.decay_steps: 20 there, 30 here"):
        resumed.on_load_checkpoint(module.trainer, module, checkpoint)


def test_a_short_last_validation_batch_is_padded_so_nothing_compiles_again_and_the_loss_is_every_sequences_mean(
    tiny_shards,
):
    """Seven validation sequences in micro batches of 4: the last batch's padding row keeps every batch's shape (a
    model compiled once, for static shapes as FlexAttention's kernel is, is never compiled again), and val/loss is
    the mean over the seven sequences' tokens, computed here one sequence at a time."""
    import lightning as L

    from project.data.datamodule import TokenShardDataModule

    data = TokenShardDataModule(
        str(tiny_shards), seq_len=32, global_batch_size=4, micro_batch_size=4, val_sequences=7, num_workers=0
    )
    data.setup("fit")
    torch.manual_seed(0)
    module = LlamaLitModule({**MODEL, "vocab_size": 300})
    compiles = []
    module.model.compile(backend=lambda graph, inputs: compiles.append(graph) or graph.forward, dynamic=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    [metrics] = trainer.validate(module, datamodule=data, verbose=False)

    batches = list(data.val_dataloader())
    assert [tuple(inputs.shape) for inputs, _ in batches] == [(4, 32), (4, 32)]
    assert len(compiles) == 1  # one shape and layout, one compilation (a batch of 3 would compile again)
    sequences = [(i[r : r + 1], t[r : r + 1]) for i, t in batches for r in range(4) if t[r, 0] >= 0]
    assert len(sequences) == 7
    with torch.no_grad():
        expected = sum(module.loss(inputs, targets).item() for inputs, targets in sequences) / 7
    assert metrics["val/loss"] == pytest.approx(expected, rel=1e-6)

"""The non-finite guard decides on the device: a NaN step's update is withheld exactly (weights, moments, step
counts), the host learns of it where it reads the device anyway, and past the budget the run stops with the step."""

import pytest
import torch

from project.model.config import LlamaConfig
from project.model.llama import Llama
from project.runtime.errors import TrainingStopped
from project.training.nonfinite import NonFiniteGuard, takes_the_flag_on_the_device

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=16)


def step(model, optimizer, guard, index, poison=False):
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(index))
    loss = model(tokens, targets=tokens.roll(-1, dims=1)) * (float("nan") if poison else 1.0)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    guard.before_update(norm, optimizer, index, takes_the_flag_on_the_device(optimizer, scaled=False))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def snapshot(model, optimizer):
    return [t.clone() for t in model.parameters()] + [
        v.clone() for state in optimizer.state.values() for v in state.values()
    ]


def test_a_nan_step_is_withheld_exactly_and_reported_when_the_host_checks(recwarn):
    model = Llama(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    guard = NonFiniteGuard(max_skipped=1)
    step(model, optimizer, guard, 0)
    before = snapshot(model, optimizer)
    step(model, optimizer, guard, 1, poison=True)
    after = snapshot(model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # parameters, moments, step counts
    assert not [w for w in recwarn if "update skipped" in str(w.message)]  # nothing read on the host yet
    guard.check()
    assert any("step 1: gradient norm nan, update skipped (1 of" in str(w.message) for w in recwarn)
    step(model, optimizer, guard, 2)
    assert not all(torch.equal(a, b) for a, b in zip(after, snapshot(model, optimizer)))  # training goes on


def test_past_the_budget_every_later_update_is_withheld_until_the_host_stops_the_run():
    model = Llama(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = NonFiniteGuard(max_skipped=0)
    step(model, optimizer, guard, 0)
    before = snapshot(model, optimizer)
    step(model, optimizer, guard, 1, poison=True)
    step(model, optimizer, guard, 2)  # finite, but after the step that spent the budget
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer)))
    with pytest.raises(TrainingStopped, match=r"step 1: the gradient norm is nan .*training stopped"):
        guard.check()


def test_an_optimizer_that_cannot_take_the_flag_is_guarded_on_the_host_at_once():
    model = Llama(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    assert not takes_the_flag_on_the_device(optimizer, scaled=False)
    assert not takes_the_flag_on_the_device(torch.optim.AdamW(model.parameters(), fused=True), scaled=True)
    guard = NonFiniteGuard(max_skipped=0)
    with pytest.raises(TrainingStopped, match="step 0"):
        step(model, optimizer, guard, 0, poison=True)

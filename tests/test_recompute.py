"""Activation checkpointing of the model-parallel strategies (project.parallel.recompute): each block's forward runs
again in its backward, and nothing else changes: gradients, state-dict names, initial values."""

from __future__ import annotations

import torch

from project.model.families import build_model, model_config
from project.model.spec import own_name
from project.parallel.recompute import recompute_blocks

CONFIG = {"vocab_size": 128, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 16}


def test_recomputed_blocks_run_their_forward_again_in_the_backward_with_the_same_gradients_and_names():
    config = model_config(CONFIG)
    plain, recomputed = build_model(config, init_seed=1), build_model(config, init_seed=1)
    recompute_blocks(recomputed)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    calls = {}
    for name, model in (("plain", plain), ("recomputed", recomputed)):
        calls[name] = 0

        def count(*_, name=name):
            calls[name] += 1

        for block in model.layers.values():
            block.get_submodule("attention").register_forward_hook(count)
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
    assert calls == {"plain": 2, "recomputed": 4}  # two blocks, each run again in the backward
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    # A fresh model, wrapped before its values are drawn, draws the plain model's (keyed by the family's names).
    redrawn = build_model(config, init_seed=1)
    recompute_blocks(redrawn)
    redrawn.init_weights()
    gradients = {own_name(n): p.grad for n, p in recomputed.named_parameters()}
    for name, p in plain.named_parameters():
        torch.testing.assert_close(gradients[name], p.grad, msg=name)
        torch.testing.assert_close(redrawn.get_parameter(name), p, atol=0, rtol=0, msg=name)

"""The planner sizes a mixture of experts (project.planning with model.family=moe): its tensors, FLOPs, activations
and traffic against what the built model holds, computes and saves, and against the training run's settings check.
The collectives themselves are held to a run's in tests/test_comms.py, the shares to the dry run's in
tests/test_dry_run.py."""

import pytest
import torch
import yaml
from conftest import ROOT
from hydra import compose, initialize_config_dir
from test_planner import eager_saved_bytes

from project.config.command_line import CONF
from project.config.layout import plan_layout
from project.model.families import model_config
from project.model.families.moe.config import MoEConfig
from project.model.families.moe.model import MoELlama
from project.model.flops import count_parameters, training_flops_per_token
from project.planning.candidates import Candidate, SearchSpace
from project.planning.cluster import Cluster
from project.planning.memory import layer_activation_bytes
from project.planning.parameters import rank_weights, unsharded_parameters
from project.planning.planner import Workload, plan
from project.planning.render import train_overrides
from project.planning.step_time import block_flops_per_token, head_flops_per_token


def preset(name: str) -> MoEConfig:
    config = model_config(yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text()))
    assert isinstance(config, MoEConfig)
    return config


def h100s(nodes: int) -> Cluster:
    fields = yaml.safe_load((ROOT / "conf" / "cluster" / "h100_80gb.yaml").read_text())
    return Cluster.from_config({**fields, "nodes": nodes})


@pytest.mark.parametrize("name", ["mixtral_8x7b", "llama4_scout_text"])
def test_the_planners_tensors_and_flops_are_the_models_counts_all_and_active(name):
    """Its tensors hold the model's parameters (project.model.flops counts them from the config alone), and its model
    FLOPs per token, block by block plus the head, are the 6 per active parameter and attention term MFU is measured
    against: of each mixture, the gate and the top_k experts a token goes through (project.model.flops counts the
    norms' weights in its 6N too, which multiply nothing)."""
    config, seq_len = preset(name), 4096
    single = Candidate("fsdp2", 1, 1, 1, 1, 1)
    assert unsharded_parameters(config, single) == count_parameters(config)
    per_token = sum(block_flops_per_token(config, seq_len, "selective", i)[0] for i in range(config.n_layers))
    per_token += head_flops_per_token(config)
    norms = (2 * config.n_layers + 1) * config.dim
    assert per_token == training_flops_per_token(config, seq_len) - 6 * norms
    assert count_parameters(config, active=True) < 0.5 * count_parameters(config)


def test_expert_and_tensor_parallelism_divide_the_experts_and_leave_the_router_whole():
    config = preset("mixtral_8x7b")
    mixture = sum(w.numel for w in rank_weights(config, Candidate("fsdp2", 64, 1, 1, 1, 1)) if w.mixture)
    routed = 3 * config.n_experts * config.dim * config.expert_hidden_dim * config.n_layers
    gates = config.n_experts * config.dim * config.n_layers
    assert mixture == routed + gates
    split = Candidate("fsdp2", 64, 1, 1, 1, 1, expert_parallel=8)
    assert sum(w.numel for w in rank_weights(config, split) if w.mixture) == routed // 8 + gates
    tp = Candidate("tp_fsdp", 16, 4, 1, 1, 1)  # each expert's hidden units over 4 ranks
    assert sum(w.numel for w in rank_weights(config, tp) if w.mixture) == routed // 4 + gates
    both = Candidate("tp_fsdp", 16, 4, 1, 1, 1, expert_parallel=8)
    assert sum(w.numel for w in rank_weights(config, both) if w.mixture) == routed // 32 + gates


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-mixed", "fp32"])
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared-expert"])
def test_activation_count_of_an_eager_mixture_block_is_what_it_saves_for_its_backward(autocast, shared):
    """As tests/test_planner.py holds a dense block's: the count, tensor by tensor, against what a mixture of experts'
    block (attention and the mixture) saves without torch.compile, exactly. Every token reaches top_k experts
    however they are spread, so the bytes are the routing's whatever it chose. Weights, and autocast's 16-bit copies
    of them (of an expert's slice too), are the working copies, counted apart."""
    torch.manual_seed(0)
    config = MoEConfig(
        vocab_size=256, dim=96, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim=160, max_seq_len=64, n_experts=5,
        top_k=2, expert_ffn_dim=112, shared_expert=shared,
    )  # fmt: skip
    model = MoELlama(config)
    model.init_weights()
    measured = eager_saved_bytes(model, 3, 50, autocast)
    counted = layer_activation_bytes(
        config, 50, 3, Candidate("fsdp2", 1, 1, 1, 3, 1), 2 if autocast else 4, False, autocast
    )
    assert counted == measured


def test_a_mixtral_plan_lists_expert_parallel_layouts_that_project_train_accepts_as_planned():
    """Mixtral 8x7B on 64 H100s: fsdp2, tp_fsdp and pipeline stages take every expert-parallel degree its 8 experts
    and their data-parallel ranks allow, ddp none; each listed command builds the layout it was planned as; the
    fastest fsdp2 layout splits the experts (holding all 8 on every rank leaves less room for activations)."""
    config, gpus = preset("mixtral_8x7b"), h100s(8)
    work = Workload(config, 4096, 512, 1e12)
    space = SearchSpace(strategies=["ddp", "fsdp2", "tp_fsdp", "pipeline"], micro_batch_sizes=[1, 2])
    outcomes = plan(work, gpus, space, 0.5)
    degrees = {(o.prediction.candidate.strategy, o.prediction.candidate.expert_parallel) for o in outcomes}
    assert {ep for strategy, ep in degrees if strategy == "fsdp2"} == {1, 2, 4, 8}
    assert {ep for strategy, ep in degrees if strategy == "ddp"} == {1}
    for c in (o.prediction.candidate for o in outcomes):
        assert c.data_context_ranks % c.expert_parallel == 0 and config.n_experts % c.expert_parallel == 0, c.name
    assert {c.expert_parallel for c in (o.prediction.candidate for o in outcomes) if c.strategy == "pipeline"} > {1}
    fastest = next(o.prediction for o in outcomes if o.prediction.candidate.strategy == "fsdp2")
    assert fastest.fits and fastest.candidate.expert_parallel > 1
    split = [o for o in outcomes if o.prediction.candidate.expert_parallel > 1]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for outcome in split[:: max(1, len(split) // 8)]:
            c = outcome.prediction.candidate
            cfg = compose("train", overrides=train_overrides(c, work, gpus, ["model=mixtral_8x7b"]))
            layout = plan_layout(cfg, cfg.trainer.num_nodes, cfg.trainer.devices)
            assert layout.shape == c.shape and cfg.strategy.expert_parallel_size == c.expert_parallel, c.name
    # Sending tokens to their experts costs time only where experts are split, and more the more tokens.
    by_name = {o.prediction.candidate.name: o.prediction for o in outcomes}
    ep8 = [p for name, p in by_name.items() if name.startswith("fsdp2_dp64-tp1-pp1-ep8_mb")]
    assert all(p.time.expert_parallel > 0 for p in ep8)
    assert by_name["fsdp2_dp64-tp1-pp1_mb2_selective"].time.expert_parallel == 0
    mb1, mb2 = (by_name[f"fsdp2_dp64-tp1-pp1-ep8_mb{m}_selective"] for m in (1, 2))
    assert mb1.time.expert_parallel > mb2.time.expert_parallel  # the same bytes a step, in twice as many calls
    # FSDP2 spreads the experts over all 64 ranks either way (over the 8 that hold the same ones under ep=8), but
    # gathers each block's 8 experts at once without expert parallelism, one with it.
    whole = by_name["fsdp2_dp64-tp1-pp1_mb2_selective"].memory
    assert mb2.memory.params == whole.params and mb2.memory.working < whole.working / 4


def test_a_plan_says_a_mixtures_parameters_all_and_active():
    """The plan's first line names the model's size; a mixture's MFU counts its active parameters (Mistral's
    published 46.7B and 12.9B for Mixtral 8x7B; Meta's 8.03B for Llama 3 8B)."""
    from project.model.flops import parameter_counts

    dense = yaml.safe_load((ROOT / "conf" / "model" / "llama3_8b.yaml").read_text())
    assert parameter_counts(preset("mixtral_8x7b")) == "46.7B parameters, 12.9B active"
    assert parameter_counts(model_config(dense)) == "8.03B parameters"

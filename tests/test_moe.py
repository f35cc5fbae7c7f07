"""The mixture-of-experts family (project.model.families.moe): its layer against a per-token computation written out
here, its balancing loss against the formula, its counts against the built model, and training in every layout it
takes equal to one device (in process, over gloo)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import PARITY_RUN, assert_reproduces, assert_validates_like, read_metrics, train_overrides
from in_process import CONF, train_in_process

from project.hf.export import export
from project.model.config import LlamaConfig
from project.model.families import FAMILIES, ModelFamily, build_model, family_of, model_config
from project.model.families.llama.hf import LlamaFormat
from project.model.families.moe.config import MoEConfig
from project.model.families.moe.model import MoEFeedForward, WithAuxiliaryGradient
from project.model.flops import count_parameters, training_flops_per_token
from project.model.spec import TensorSpec
from project.training.nonfinite import NonFiniteGuard

TINY = {"vocab_size": 96, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 16}


def tiny(**fields) -> MoEConfig:
    return MoEConfig(**{**TINY, "n_experts": 4, "top_k": 2, "expert_ffn_dim": 24, **fields})


def seeded_mixture(config: MoEConfig) -> MoEFeedForward:
    model = build_model(config, init_seed=7)
    mixture = model.layers[str(config.moe_layers[0])].feed_forward
    if mixture.router.expert_bias is not None:  # a bias that changes the choice, not the weights
        mixture.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    return mixture


def per_token_reference(mixture: MoEFeedForward, config: MoEConfig, x: torch.Tensor) -> torch.Tensor:
    """Each token alone: its scores, the top_k experts by score plus bias (sorted here, not torch.topk), their
    weights, and the sum of those experts' SwiGLUs plus the shared one."""
    gate, experts = mixture.router.gate.weight, mixture.experts
    bias = mixture.router.expert_bias
    out = []
    for token in x.reshape(-1, x.shape[-1]):
        logits = gate.float() @ token.float()
        scores = logits.softmax(-1) if config.score_func == "softmax" else logits.sigmoid()
        ranked = sorted(range(config.n_experts), key=lambda e: -(scores[e] + (0 if bias is None else bias[e])))
        chosen = ranked[: config.top_k]
        weights = scores[chosen]
        if config.normalize_top_k:
            weights = weights / weights.sum()
        y = sum(
            w * (experts.w2[e] @ (F.silu(experts.w1[e] @ token) * (experts.w3[e] @ token)))
            for w, e in zip(weights, chosen, strict=True)
        )
        if mixture.shared_expert is not None:
            y = y + mixture.shared_expert(token)
        out.append(y)
    return torch.stack(out).view_as(x)


VARIANTS = {
    "mixtral": {},
    "top1-shared-sigmoid": {"top_k": 1, "shared_expert": True, "score_func": "sigmoid", "normalize_top_k": False},
    "routing-bias": {"bias_update_rate": 0.01, "score_func": "sigmoid"},
}


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_the_mixture_is_each_tokens_chosen_experts_weighted_as_written_out(variant):
    config = tiny(**VARIANTS[variant])
    mixture = seeded_mixture(config)
    x = torch.randn(3, 5, config.dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(mixture(x), per_token_reference(mixture, config, x), rtol=1e-5, atol=1e-6)


def test_no_token_is_dropped_and_none_depends_on_the_others_in_its_batch():
    """Dropless: a token's output is the same alone as among a batch routed mostly elsewhere."""
    config = tiny()
    mixture = seeded_mixture(config)
    x = torch.randn(4, 8, config.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        together = mixture(x)
        assert mixture.load.sum() == 4 * 8 * config.top_k  # every (token, slot) reached an expert
        alone = torch.stack([mixture(x[b : b + 1, t : t + 1]).view(-1) for b in range(4) for t in range(8)])
    torch.testing.assert_close(together.view(-1, config.dim), alone, rtol=1e-5, atol=1e-6)


def test_bfloat16_experts_run_as_grouped_products_equal_to_each_experts_own_product(monkeypatch):
    """The GPU's path, run here: in bfloat16 the experts take one grouped product per projection (torch's
    grouped_mm, which the CPU has too); its outputs and gradients are each expert's SwiGLU on its own tokens (an
    expert with none included), within bfloat16's tolerance. Float32 and unaligned widths keep the loop."""
    from project.model.families.moe.model import Experts, takes_grouped_products

    experts = Experts(4, 32, 24)  # rows of 64 and 48 bytes in bfloat16: multiples of 16
    with torch.no_grad():
        for w in experts.parameters():
            w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(w.numel())) * 0.2)
    experts = experts.to(torch.bfloat16)
    counts = torch.tensor([3, 0, 6, 1])
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).requires_grad_()
    calls = []
    grouped_mm = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *args, **kwargs: calls.append(1) or grouped_mm(*args, **kwargs))
    out = experts(x, counts)
    assert len(calls) == 3  # w1, w3 and w2, each once for all experts
    (out.float().square().sum()).backward()
    grads = [x.grad, *(w.grad for w in experts.parameters())]
    # Each expert alone on its own tokens, in bfloat16 as the grouped product computes.
    xs = x.detach().clone().requires_grad_()
    w1, w3, w2 = ws = [w.detach().clone().requires_grad_() for w in experts.parameters()]
    parts = xs.split(counts.tolist())
    reference = torch.cat([(F.silu(p @ w1[e].T) * (p @ w3[e].T)) @ w2[e].T for e, p in enumerate(parts)])
    reference.float().square().sum().backward()
    torch.testing.assert_close(out, reference)  # bfloat16's tolerance
    for got, want in zip(grads, [xs.grad, *(w.grad for w in ws)], strict=True):
        torch.testing.assert_close(got, want)
    assert not takes_grouped_products(x.float(), experts.w1.float())  # float32: the loop
    assert not takes_grouped_products(x[:, :12], experts.w1[:, :, :12])  # rows of 24 bytes: the loop


def test_the_balancing_loss_is_the_per_sequence_formula_and_one_when_balanced():
    config = tiny()
    mixture = seeded_mixture(config)
    x = torch.randn(2, 6, config.dim, generator=torch.Generator().manual_seed(2))
    mixture(x)
    expected = []
    for sequence in x:
        logits = sequence @ mixture.router.gate.weight.T
        scores = logits.softmax(-1)
        chosen = scores.topk(config.top_k, -1).indices
        share = torch.tensor([(chosen == e).sum().item() for e in range(4)]) / chosen.numel()
        expected.append(4 * (share * scores.mean(0)).sum())
    torch.testing.assert_close(mixture.aux_loss, torch.stack(expected).mean())
    # Uniform scores and an even spread of 4 tokens' 2 slots each: each share 1/4, each mean score 1/4.
    even = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])  # every expert chosen twice
    assert mixture.sequence_balance_loss(torch.full((1, 4, 4), 0.25), even) == pytest.approx(1)


def test_the_auxiliary_loss_adds_its_gradient_at_the_losss_scale_and_leaves_the_value_alone():
    loss, aux = torch.tensor(2.0, requires_grad=True), torch.tensor(1.5, requires_grad=True)
    joined = WithAuxiliaryGradient.apply(loss, aux, 0.01)
    assert joined.item() == 2.0
    (joined / 4).backward()  # as Lightning divides by the accumulated micro batches
    assert loss.grad.item() == pytest.approx(0.25) and aux.grad.item() == pytest.approx(0.0025)


def test_router_scores_are_float32_under_bf16_autocast():
    """bf16-mixed runs matrix products in bfloat16 under autocast whatever their inputs: the router's scores, and so
    each token's choice of experts, are those float32 computes."""
    mixture = seeded_mixture(tiny())
    x = torch.randn(64, TINY["dim"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, chosen, weights = mixture.router(x)
    expected, expected_chosen, _ = mixture.router(x)
    assert scores.dtype == weights.dtype == torch.float32
    assert torch.equal(scores, expected) and torch.equal(chosen, expected_chosen)


def test_counts_of_parameters_and_flops_are_the_built_models_and_mixtrals_published_ones():
    for config in (tiny(), tiny(shared_expert=True, moe_every=2)):
        model = build_model(config)
        assert count_parameters(config) == sum(p.numel() for p in model.parameters())
        unused = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) // config.n_experts
        unused *= config.n_experts - config.top_k  # of each mixture's routed experts, those a token skips
        assert count_parameters(config, active=True) == count_parameters(config) - unused
    mixtral = model_config(yaml.safe_load((CONF / "model" / "mixtral_8x7b.yaml").read_text()))
    # Mistral's announcement: 46.7B parameters, 12.9B used per token.
    assert count_parameters(mixtral) / 1e9 == pytest.approx(46.7, abs=0.05)
    assert count_parameters(mixtral, active=True) / 1e9 == pytest.approx(12.9, abs=0.05)
    dense = model_config({**TINY, "ffn_dim": 24 * 2})  # the width of two experts: a token's products alike
    assert training_flops_per_token(tiny(), 64) - training_flops_per_token(dense, 64) == 6 * 2 * 4 * TINY["dim"]


def test_routing_biases_move_toward_the_mean_load_after_a_step():
    config = tiny(bias_update_rate=0.5)
    model = build_model(config, init_seed=1).train()
    model(torch.randint(0, 96, (2, 16)), targets=torch.randint(0, 96, (2, 16))).backward()
    loads = model._statistics[:, :-2].clone()  # each mixture's routed (token, slot) pairs per expert
    assert loads.sum(dim=1).tolist() == [2 * 16 * config.top_k] * 2
    metrics = model.step_statistics(lambda t: t * 2, report=True)  # as two ranks of the same batch would sum
    for mixture, load in zip(model.mixtures(), loads, strict=True):
        expected = 0.5 * torch.sign(load.mean() - load)
        torch.testing.assert_close(mixture.router.expert_bias, expected)
    assert metrics["moe/layer0/load_max"] == pytest.approx((loads[0].max() / loads[0].mean()).item())
    assert metrics["moe/layer0/top_share"] == pytest.approx((loads[0].max() / 32).item())
    assert model.step_statistics(lambda t: t, report=True) == {}  # cleared: nothing since the step


def test_routing_biases_stay_on_a_step_whose_update_the_non_finite_guard_withholds():
    """The guard's flag (project.training.nonfinite, on the device) reaches the biases as it reaches the weights."""
    model = build_model(tiny(bias_update_rate=0.5), init_seed=1).train()
    model(torch.randint(0, 96, (2, 16)), targets=torch.randint(0, 96, (2, 16))).backward()
    optimizer = torch.optim.AdamW(model.parameters())
    withheld = NonFiniteGuard(max_skipped=1).before_update(torch.tensor(float("nan")), optimizer, 0, on_device=True)
    model.step_statistics(lambda t: t, report=False, applied=~withheld)
    assert all(not m.router.expert_bias.any() for m in model.mixtures())


def test_only_forwards_that_train_are_counted_and_a_stage_of_dense_blocks_still_joins_the_sum():
    """A pipeline finds its stages' shapes by a forward without gradients (project.parallel.strategies.pipeline),
    which trains nothing; a stage whose blocks are all dense gives zeros to the sum over ranks, which every rank must
    join alike."""
    from project.parallel.pipeline import split_into_stages

    model = build_model(tiny(moe_every=2), init_seed=1).train()  # block 1 a mixture, block 0 dense
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        model(tokens, targets=tokens)
    assert model._statistics is None and model._pending_aux is None
    chunks = split_into_stages(model, pipeline_rank=0, pipeline_parallel_size=2, schedule="1f1b", virtual_stages=1)
    assert list(chunks) == [0] and not model.mixtures()  # the first stage: block 0 alone
    chunks[0](tokens, seq_len=16)
    summed = []
    model.step_statistics(lambda t: summed.append(t.clone()) or t, report=True)
    assert [t.tolist() for t in summed] == [[[0.0] * (4 + 2)]]  # one mixture's row: no loads, losses or count here


def test_every_family_builds_from_its_presets_and_an_unknown_family_is_named():
    for preset in sorted((CONF / "model").glob("*.yaml")):
        fields = yaml.safe_load(preset.read_text())
        fields["vocab_size"] = 512 if isinstance(fields["vocab_size"], str) else fields["vocab_size"]
        assert family_of(fields).name == fields["family"] in FAMILIES
        assert type(model_config(fields)) is FAMILIES[fields["family"]].config
    with pytest.raises(ValueError, match="model.family=gpt is not a model family: it is one of llama, moe"):
        family_of({"family": "gpt"})
    assert family_of({}).name == "llama"  # checkpoints from before families


@dataclass
class ToyConfig(LlamaConfig):
    family: str = "toy"

    def feed_forward_tensors(self, index: int) -> list:
        return [TensorSpec("feed_forward.w.weight", (self.dim, self.dim), "rows", self.init_std)]


class ToyFormat(LlamaFormat):
    """A family's format as a new family would write one: one square matrix as its feed-forward."""

    architecture = "ToyForCausalLM"

    def config_dict(self, config: LlamaConfig, llama: dict) -> dict:
        return {**llama, "architectures": [self.architecture], "model_type": "toy"}

    def feed_forward_pieces(self, layer: str, name: str, config: LlamaConfig) -> list:
        return [(f"model.layers.{layer}.mlp.w.weight", None)]


TOY_FORMAT = ToyFormat()


def test_a_family_converts_to_hugging_face_by_the_format_its_entry_names(monkeypatch):
    from project.hf.conversion import hf_config_dict, hf_weight_shapes, to_hf_state_dict, weight_names

    architectures = {"llama": "LlamaForCausalLM", "moe": "MixtralForCausalLM"}  # transformers' class names
    assert {name: FAMILIES[name].format().architecture for name in architectures} == architectures
    toy = ModelFamily("toy", ToyConfig, "project.model.llama:Llama", "a toy", "Toy", f"{__name__}:TOY_FORMAT")
    monkeypatch.setitem(FAMILIES, "toy", toy)  # one entry: nothing else names the family
    config = model_config({"family": "toy", "dim": 16, "n_layers": 2, "n_heads": 2, "vocab_size": 32})
    assert hf_config_dict(config)["architectures"] == ["ToyForCausalLM"]
    assert hf_config_dict(config)["hidden_size"] == 16  # the rest a Llama's
    assert hf_weight_shapes(config)["model.layers.1.mlp.w.weight"] == (16, 16)
    assert "model.layers.1.self_attn.q_proj.weight" in hf_weight_shapes(config)
    state = {name: torch.zeros(1) for name in weight_names(config)}
    assert "layers.0.feed_forward.w.weight" in state and "model.layers.0.mlp.w.weight" in to_hf_state_dict(
        state, config
    )


def test_each_block_is_split_by_the_tensor_parallel_plan_its_tensors_give():
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, SequenceParallel

    from project.parallel.tensor_parallel import block_plan

    sizes = {"vocab_size": 64, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
    dense = model_config({"family": "llama", **sizes})
    mixed = model_config({"family": "moe", **sizes, "n_experts": 4, "top_k": 2, "moe_every": 2})  # block 1 a mixture
    whole = block_plan(dense, 0, False, None, 2)
    assert set(whole) == {f"attention.{p}" for p in ("wq", "wk", "wv", "wo")} | {"attention"} | {
        f"feed_forward.{p}" for p in ("w1", "w3", "w2")
    } | {"feed_forward"}
    assert isinstance(whole["attention.wk"], ColwiseParallel)
    assert set(block_plan(mixed, 0, False, None, 2)) == set(whole)  # a dense block of the mixture family: a Llama's
    mixture = block_plan(mixed, 1, True, None, 2)
    assert {"attention.wq", "attention_norm", "ffn_norm"} <= set(mixture)
    assert isinstance(mixture["ffn_norm"], SequenceParallel)
    # Neither the router (whole on every rank) nor the stacked experts (split by project.parallel.expert_parallel, not
    # by the plan) are in it: only the mixture's input and output, and a shared expert's projections where it has one.
    assert not any(k.startswith("feed_forward.") for k in mixture)
    shared = model_config({"family": "moe", **sizes, "n_experts": 4, "top_k": 2, "shared_expert": True})
    with_shared = block_plan(shared, 0, True, None, 2)  # the shared expert split as a dense feed-forward
    assert isinstance(with_shared["feed_forward.shared_expert.w1"], ColwiseParallel)
    assert not any(k.startswith("feed_forward.router") for k in with_shared)
    assert isinstance(mixture["feed_forward"], PrepareModuleInputOutput)  # the sequence gathered before it


# -- training: every layout the family takes equals one device ---------------------------------------------------

# STEPS steps, validated and saved at step AT (0-based; best-step00000{AT}.ckpt holds the weights before its update),
# where the numerics are logged too; the resumed runs go on from there, STEPS - AT steps.
STEPS, AT = 6, 4
BEST = f"best-step{AT:06d}.ckpt"
MOE = [
    *PARITY_RUN,
    f"trainer.max_steps={STEPS}",
    f"val_every_n_steps={AT}",
    f"ckpt_every_n_steps={AT}",
    "model=moe_debug",
    "model.expert_ffn_dim=48",
    f"stability.numerics_every_n_steps={AT + 1}",
]
EP = "strategy.expert_parallel_size"
LAYOUTS = {
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "fsdp2": ["strategy=fsdp2", "trainer.devices=2"],
    "ep2": ["strategy=fsdp2", "trainer.devices=2", f"{EP}=2"],  # each rank 2 of the 4 experts
    "ep2-dp4": ["strategy=fsdp2", "trainer.devices=4", f"{EP}=2"],  # and FSDP2 over the two groups
    "ep4": ["strategy=fsdp2", "trainer.devices=4", f"{EP}=4"],  # each rank one expert
    # Tensor parallelism: each expert's hidden units split over the group (with sequence parallelism and experts
    # split over the data-parallel ranks besides: BIASED).
    "tp2": ["strategy=tp", "trainer.devices=2"],
    # And FSDP2 over two such pairs: each expert's rows sharded again within the tensor-parallel split.
    "tp2-dp2": ["strategy=tp_fsdp", "trainer.devices=4"],
    # Blocks recomputed in the backward: the mixture runs again, its all-to-alls too.
    "ep2-recomputed": ["strategy=fsdp2", "trainer.devices=2", f"{EP}=2", "strategy.activation_checkpointing=true"],
    # One mixture per stage, each joining its balancing loss to the stage's output, over 8 microbatches.
    "pp2": ["strategy=pipeline", "trainer.devices=2"],
}
# New runs from the single run's export: each rank of ddp reads the whole model, of fsdp2 a slice of every expert's
# rows, of ep=2 its own experts, of tp=2 half of every expert's hidden units.
FROM_MIXTRAL = {"init-from-ddp": "ddp", "init-from-fsdp2": "fsdp2", "init-from-ep2": "ep2", "init-from-tp2": "tp2"}
# Routing biases, a shared expert, sigmoid scores and a strong balancing loss (its gradient as large as to show
# any error in the context-parallel sums' backward).
BIAS = ["model.bias_update_rate=0.01", "model.score_func=sigmoid", "model.shared_expert=true", "model.aux_loss_coef=1"]
BIASED = {
    "bias-cp2-ep4": ["strategy=fsdp2", "trainer.devices=4", "strategy.context_parallel_size=2", f"{EP}=4"],
    # Each stage's two data-parallel ranks split its mixture's experts; every rank's loads move the biases.
    "bias-pp2-dp2-ep2": ["strategy=pipeline", "trainer.devices=4", "strategy.data_parallel_size=2", f"{EP}=2"],
    # Each rank half of its expert group's experts' hidden units, and half of the shared expert's; the sequence
    # gathered before the mixture.
    "bias-tp2-sp-ep2": ["strategy=tp_fsdp", "trainer.devices=4", "strategy.sequence_parallel=true", f"{EP}=2"],
}
# Resumed at step AT (BEST) to the end under other expert-parallel degrees.
RESUMED = {
    "ep4-to-ep2": ("ep4", LAYOUTS["ep2"]),
    "ep4-to-single": ("ep4", []),
    "tp2-dp2-to-single": ("tp2-dp2", []),  # the split experts' checkpoint read whole
    "bias-single-to-ep2": ("bias-single", [*LAYOUTS["ep2"], *BIAS]),  # the biases come back with the checkpoint
}


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory) -> dict:
    names = ["single", "accumulated", "bias-single", *LAYOUTS, *BIASED, *RESUMED, *FROM_MIXTRAL]
    folders = {name: tmp_path_factory.mktemp(name) for name in names}

    def case(name: str, *overrides: str):
        return folders[name], train_overrides(tiny_shards, folders[name], *MOE, *overrides)

    def resumed(name: str):
        source, overrides = RESUMED[name]
        return case(name, *overrides, f"ckpt_path={folders[source] / 'checkpoints' / BEST}")

    def on(devices: int) -> list:
        return [case(name, *o) for name, o in LAYOUTS.items() if f"trainer.devices={devices}" in o]

    # Three groups of ranks, each started once: the 4-rank layouts, then one device (and a resume of ep=4 there),
    # then the 2-rank layouts (and resumes of the others, and starts from the one-device run's export).
    train_in_process(4, [*on(4), *(case(name, *overrides, *BIAS) for name, overrides in BIASED.items())])
    one = [case("single"), case("accumulated", "micro_batch_size=4"), case("bias-single", *BIAS)]
    train_in_process(1, [*one, resumed("ep4-to-single"), resumed("tp2-dp2-to-single")])
    # The single run's final weights in Mixtral's format, and new runs starting from them.
    folders["mixtral"] = tmp_path_factory.mktemp("exported") / "mixtral"
    export(str(folders["single"] / "checkpoints" / "last.ckpt"), str(folders["mixtral"]))
    from_mixtral = (f"init_from={folders['mixtral']}", "trainer.max_steps=2")
    two = [*on(2), resumed("ep4-to-ep2"), resumed("bias-single-to-ep2")]
    two += [case(name, *LAYOUTS[layout], *from_mixtral) for name, layout in FROM_MIXTRAL.items()]
    train_in_process(2, two)
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("layout", [*LAYOUTS, "accumulated"])
def test_a_mixture_of_experts_trains_in_every_layout_it_takes_like_one_device(runs, layout):
    """Dropless routing and a per-sequence balancing loss: a batch split over ranks or micro batches routes each
    token as one device does and sums the same loss."""
    assert_reproduces(runs[layout], runs["single"], steps=STEPS)
    assert_validates_like(runs[layout], runs["single"])  # validation through each layout's own forward


EXPERT_STATS = [
    f"numerics/block{b}/expert{e}/{stat}" for b in (0, 1) for e in range(4) for stat in ("param_norm", "grad_norm")
]


@pytest.mark.slow
def test_each_experts_numerics_are_its_checkpointed_weights_and_one_devices_in_every_layout(runs):
    """Per expert, at a numerics step: the parameter norm is that of its rows of the stacked weights in the step's
    checkpoint (computed here from the file); every layout that keeps rows apart gives one device's norms and update
    ratios, its expert-parallel, sharded, replicated and pipelined rows summed where they lie."""
    single = runs["single"]
    state = torch.load(single / "checkpoints" / BEST, map_location="cpu", weights_only=False)
    weights = state["state_dict"]
    for block, expert in ((0, 0), (1, 3)):
        rows = [weights[f"model.layers.{block}.feed_forward.experts.{w}"][expert] for w in ("w1", "w3", "w2")]
        by_hand = sum(float(r.double().square().sum()) for r in rows) ** 0.5
        logged = read_metrics(single, f"numerics/block{block}/expert{expert}/param_norm")
        assert logged == {AT: pytest.approx(by_hand, rel=1e-6)}
    ratio = "numerics/block1/expert2/update_ratio"
    references = {**dict.fromkeys(LAYOUTS, "single"), **dict.fromkeys(BIASED, "bias-single")}
    for layout, reference in references.items():
        for stat in [*EXPERT_STATS, ratio]:
            ours, theirs = read_metrics(runs[layout], stat)[AT], read_metrics(runs[reference], stat)[AT]
            assert ours == pytest.approx(theirs, rel=1e-3 if stat == ratio else 2e-4), (layout, stat)


@pytest.mark.slow
@pytest.mark.parametrize("layout", BIASED)
def test_routing_biases_moved_by_every_ranks_loads_train_like_one_device(runs, layout):
    """Under context or pipeline and expert parallelism at once, with a balancing loss 100 times the presets'
    weight (a pipeline's stages join it to their outputs, whose gradient the schedule does not scale)."""
    assert_reproduces(runs[layout], runs["bias-single"], steps=STEPS)
    assert_validates_like(runs[layout], runs["bias-single"])
    for metric in ("moe/aux_loss", "moe/layer1/load_max"):
        assert read_metrics(runs[layout], metric) == pytest.approx(read_metrics(runs["bias-single"], metric), rel=1e-5)
    assert read_metrics(runs["bias-single"], "train/loss") != read_metrics(runs["single"], "train/loss")


@pytest.mark.slow
@pytest.mark.parametrize("resume", RESUMED)
def test_a_mixture_resumes_under_another_expert_or_tensor_parallel_degree_as_if_never_stopped(runs, resume):
    source = "bias-single" if resume.startswith("bias") else "single"
    resumed, single = read_metrics(runs[resume], "train/loss"), read_metrics(runs[source], "train/loss")
    assert sorted(resumed) == list(range(AT, STEPS))
    for step, loss in resumed.items():
        assert loss == pytest.approx(single[step], rel=1e-5)


@pytest.mark.slow
def test_the_balancing_loss_and_each_blocks_expert_load_are_logged_every_step(runs):
    aux = read_metrics(runs["single"], "moe/aux_loss")
    assert len(aux) == STEPS and all(1 <= value < 4 for value in aux.values())  # 1 balanced, n_experts at worst
    for layer in (0, 1):
        most, least = (
            read_metrics(runs["single"], f"moe/layer{layer}/load_max"),
            read_metrics(runs["single"], f"moe/layer{layer}/load_min"),
        )
        share = read_metrics(runs["single"], f"moe/layer{layer}/top_share")
        assert all(least[s] <= 1 <= most[s] <= 4 and 2 / 4 <= share[s] <= 1 for s in most)
    for layout in ("ddp", "ep4", "pp2"):  # every rank's loads and losses counted, once (bias-cp2-ep4: below)
        assert read_metrics(runs[layout], "moe/aux_loss") == pytest.approx(aux, rel=1e-5)
        assert read_metrics(runs[layout], "moe/layer1/load_max") == pytest.approx(most, rel=1e-5)


@pytest.mark.slow
def test_a_trained_mixture_exports_as_mixtral_whose_logits_transformers_computes_alike(runs):
    transformers = pytest.importorskip("transformers")
    from project.training.lit_module import LlamaLitModule

    ours = LlamaLitModule.load_from_checkpoint(runs["single"] / "checkpoints" / "last.ckpt").model.eval()
    hf = transformers.MixtralForCausalLM.from_pretrained(runs["mixtral"]).eval()
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_init_from_a_mixtral_folder_starts_every_layout_from_its_weights(runs):
    """Each rank of ddp reads the whole model, of fsdp2 the rows of every expert it holds, of ep=2 its own experts;
    all start from the exported weights (a loss far below a random start's) and train alike."""
    one = read_metrics(runs["init-from-ddp"], "train/loss")
    assert sorted(one) == [0, 1]
    for split in ("init-from-fsdp2", "init-from-ep2", "init-from-tp2"):
        assert read_metrics(runs[split], "train/loss") == pytest.approx(one, rel=1e-5), split
    assert one[0] < read_metrics(runs["single"], "train/loss")[0] - 0.5


@pytest.mark.slow
def test_a_mixture_mixtrals_format_cannot_hold_is_refused_at_export(runs, tmp_path):
    from project.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"as MixtralForCausalLM, which cannot hold model.shared_expert=True, "):
        export(str(runs["bias-single"] / "checkpoints" / "last.ckpt"), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_settings_that_contradict_a_mixtral_folder_are_refused_and_the_rest_come_from_it(runs):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from project.hf.folder import apply_init_from
    from project.runtime.errors import ConfigError

    def composed(*overrides: str):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("train", overrides=["experiment=debug", f"init_from={runs['mixtral']}", *overrides])

    for overrides, refused in [
        (["model=moe_debug", "model.top_k=1"], r"model.top_k=1 contradicts init_from=.*num_experts_per_tok=2"),
        (["model=moe_debug", "model.score_func=sigmoid"], r"model.score_func=sigmoid contradicts .*Mixtral's routing"),
    ]:
        with pytest.raises(ConfigError, match=refused):
            apply_init_from(composed(*overrides), overrides)
    cfg = composed()  # the dense debug preset: the folder makes it a mixture, of the exported shape
    apply_init_from(cfg, [])
    fields = OmegaConf.to_container(cfg.model)
    assert model_config(fields) == model_config(
        {
            **yaml.safe_load((CONF / "model" / "moe_debug.yaml").read_text()),
            "vocab_size": 300,
            "expert_ffn_dim": 48,
            "ffn_dim": 48,
            "multiple_of": 32,
            "max_seq_len": 1024,
        }
    )

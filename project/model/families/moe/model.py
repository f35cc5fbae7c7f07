"""A Llama whose feed-forward is a mixture of SwiGLU experts (Mixtral, Llama 4): router, experts, the balancing.

Plain PyTorch like project.model.llama, whose attention, norms and head it keeps. Dropless: every token reaches
each of its `top_k` experts, however unevenly the router spreads them (no capacity, nothing dropped), so the
result never depends on how tokens are batched. The router's scores are computed in float32.

Balancing the experts' load, two ways (MoEConfig):
- an auxiliary loss, per sequence (DeepSeek-V3's sequence-wise form of the Switch Transformer's loss): for each
  sequence, the experts' shares of its routed tokens times their mean scores, summed and times n_experts (1 when
  balanced); averaged over sequences and mixture blocks. Per sequence, not per batch, so that it is the same sum
  however a layout splits a batch's sequences over ranks and micro batches (and, context parallelism summing each
  sequence's parts over its ranks, however a sequence is split: `SequenceSums`). Its gradient joins the loss's
  (`WithAuxiliaryGradient`) while the loss's value, and so train/loss, stays the next-token loss;
- a routing bias (bias_update_rate > 0): added to the scores only to choose experts, moved after each optimizer
  step toward the mean load (`step_statistics`, from every rank's loads).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from project.model.families.moe.config import MoEConfig
from project.model.llama import Block, FeedForward, Llama


class Router(nn.Module):
    """Each token's experts and their weights: scores of `gate`'s logits in float32 (softmax or sigmoid), the
    `top_k` highest (after the routing bias, where there is one), their scores renormalised if asked."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)
        self.top_k, self.score_func, self.normalize = config.top_k, config.score_func, config.normalize_top_k
        # Chooses experts only, never weighs them; moved by MoELlama.step_statistics. None: no bias (a buffer of
        # None is no state, so models without one keep their state dict's names).
        bias = torch.zeros(config.n_experts) if config.bias_update_rate > 0 else None
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (scores [N, n_experts] float32, chosen [N, top_k] expert indices, weights [N, top_k])."""
        # Autocast (bf16-mixed) would run the product in 16 bits whatever its inputs are: off for the scores.
        autocast = torch.is_autocast_enabled(x.device.type)
        with torch.autocast(x.device.type, enabled=False) if autocast else contextlib.nullcontext():
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, chosen, weights


def takes_grouped_products(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Whether torch's grouped matrix product takes these tokens and experts (w1 [n, hidden, dim]): both bfloat16
    (its kernel's dtype on GPUs from sm80, and torch.compile's on every device; the CPU's too), every row a multiple
    of 16 bytes (the kernel's alignment)."""
    rows = (x.shape[-1] * x.element_size(), w1.shape[1] * x.element_size())
    return x.dtype == w1.dtype == torch.bfloat16 and all(size % 16 == 0 for size in rows)


def expert_products(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """x [M, dim]: tokens sorted by expert, counts[e] of them for expert e of the stacked weights (w1, w3:
    [n, hidden, dim]; w2: [n, dim, hidden]) -> each token through its expert's SwiGLU, [M, dim]."""
    if takes_grouped_products(x, w1):
        # One grouped product per projection for all experts. The input is bf16 under bf16-true and under FSDP2's
        # bf16 gathers; under autocast (single, ddp with bf16-mixed) and in float32 the experts run one after
        # another, with a wait for the counts on the host.
        ends = counts.cumsum(0).to(torch.int32)
        hidden = F.silu(F.grouped_mm(x, w1.transpose(-2, -1), offs=ends))
        hidden = hidden * F.grouped_mm(x, w3.transpose(-2, -1), offs=ends)
        return F.grouped_mm(hidden, w2.transpose(-2, -1), offs=ends)
    parts = x.split(counts.tolist())
    return torch.cat(
        [F.linear(F.silu(F.linear(part, w1[e])) * F.linear(part, w3[e]), w2[e]) for e, part in enumerate(parts)]
    )


class Experts(nn.Module):
    """n SwiGLU experts, their weights stacked [n, out, in] (w1, w3: [n, hidden, dim]; w2: [n, dim, hidden]).

    Expert parallelism (project.parallel.expert_parallel) gives each rank some of them and sends it their tokens, and
    tensor parallelism part of each one's hidden units; a rank runs its tokens through `products` with the weights
    it holds."""

    products = staticmethod(expert_products)  # (x, counts, w1, w3, w2) -> [M, dim]: of any experts' stacked weights

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [M, dim]: the routed tokens sorted by expert, counts[e] of them for expert e -> [M, dim]."""
        return self.products(x, counts, self.w1, self.w3, self.w2)


class SequenceSums(nn.Module):
    """Per-sequence sums over a batch's tokens [B, ...], as given: each sequence's tokens are all here. A module of
    its own, without parameters, so that a strategy whose ranks each hold part of every sequence (context
    parallelism) can sum the parts."""

    def forward(self, sums: torch.Tensor) -> torch.Tensor:
        return sums


class MoEFeedForward(nn.Module):
    """The mixture: each token through its chosen experts, weighted, plus the shared expert where there is one.

    After each forward it holds that batch's auxiliary loss (`aux_loss`, with its graph) and the tokens each expert
    received (`load` [n_experts]), for the model to collect (MoELlama.forward)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k, self.weigh_inputs = config.n_experts, config.top_k, config.weigh_inputs
        self.router = Router(config)
        # An Experts, or what a strategy made of it (project.parallel.expert_parallel): (x, counts) -> [M, dim].
        self.experts: nn.Module = Experts(config.n_experts, config.dim, config.expert_hidden_dim)
        self.shared_expert = FeedForward(config, config.expert_hidden_dim) if config.shared_expert else None
        self.sequence_sums: nn.Module = SequenceSums()  # or a strategy's (project.parallel.context_parallel)
        self.aux_loss: torch.Tensor | None = None
        self.load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)
        scores, chosen, weights = self.router(tokens)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # the (token, slot) pairs grouped by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=self.n_experts)
        token = order // self.top_k
        weight = weights.reshape(-1)[order, None].to(x.dtype)
        if self.weigh_inputs:
            routed = self.experts(tokens[token] * weight, counts)
        else:
            routed = self.experts(tokens[token], counts) * weight
        out = torch.zeros_like(tokens).index_add_(0, token, routed)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        self.aux_loss = self.sequence_balance_loss(scores.view(B, T, -1), chosen.view(B, T * self.top_k))
        self.load = counts.detach().float()
        return out.view(B, T, D)

    def sequence_balance_loss(self, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Mean over sequences of n_experts * sum_e f_e P_e: f_e the share of the sequence's routed (token, slot)
        pairs that went to expert e, P_e the mean over its tokens of e's score (scores normalised to sum 1 per
        token, as sigmoid's do not)."""
        B, T, E = scores.shape
        routed = torch.zeros(B, E, device=scores.device).scatter_add_(
            1, chosen, torch.ones_like(chosen, dtype=torch.float)
        )
        probability = (scores / scores.sum(dim=-1, keepdim=True)).sum(dim=1)
        tokens = torch.full((B, 1), float(T), device=scores.device)
        sums = self.sequence_sums(torch.cat([routed, probability, tokens], dim=1))
        routed, probability, tokens = sums[:, :E], sums[:, E : 2 * E], sums[:, 2 * E :]
        share = routed / (tokens * self.top_k)
        return E * (share * probability / tokens).sum(dim=-1).mean()


class WithAuxiliaryGradient(torch.autograd.Function):
    """`x` itself, and in the backward pass the gradient of x + coef * aux: with `scaled` (x is the loss) at the
    loss's own scale (accumulation's division, a gradient scaler's factor) without either being known here, so that
    train/loss stays the next-token loss; without (x is a pipeline stage's output, whose loss is backpropagated from
    a gradient of 1), as coef."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, coef: float, scaled: bool = True) -> torch.Tensor:
        ctx.coef, ctx.scaled = coef, scaled
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_grad = grad * ctx.coef if ctx.scaled else grad.new_tensor(ctx.coef)
        return grad, aux_grad, None, None


class MoELlama(Llama):
    """Llama with MoEFeedForward in every `moe_every`-th block (MoEConfig); the rest is the dense model's."""

    config: MoEConfig

    def __init__(self, config: MoEConfig, init_seed: int = 0):
        super().__init__(config, init_seed)
        # Since the last optimizer step, per mixture block of the whole model (config.moe_layers, whichever this
        # model holds: a pipeline stage holds some): its routed tokens per expert, its auxiliary losses' sum and
        # their count, [mixtures, n_experts + 2] (read and cleared by step_statistics).
        self._statistics: torch.Tensor | None = None
        # The training forward's auxiliary loss so far (each mixture's, over the whole model's number of
        # mixtures), until with_auxiliary_losses or stage_output joins it to the objective.
        self._pending_aux: torch.Tensor | None = None

    def block(self, config: MoEConfig, index: int) -> Block:  # type: ignore[override]
        return Block(config, MoEFeedForward(config) if config.is_moe_layer(index) else None)

    @property
    def hooks(self) -> MoELlama:  # type: ignore[override]
        """What a mixture adds to training (project.model.llama.FamilyHooks): this model's own methods below."""
        return self

    def mixtures(self) -> list[MoEFeedForward]:
        return list(self.held_mixtures().values())

    def held_mixtures(self) -> dict[int, MoEFeedForward]:
        """The mixtures this model holds (a pipeline stage: some) by their position among config.moe_layers."""
        held = {}
        for position, index in enumerate(self.config.moe_layers):
            if str(index) in self.layers:
                mixture = self.layers[str(index)].get_submodule("feed_forward")
                assert isinstance(mixture, MoEFeedForward)
                held[position] = mixture
        return held

    def stacked_parameters(self) -> dict[str, tuple[int, list[nn.Parameter]]]:
        held = self.held_mixtures()
        return {
            f"block{index}": (self.config.n_experts, list(held[p].experts.parameters()) if p in held else [])
            for p, index in enumerate(self.config.moe_layers)
        }

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The routing biases start at zero (to_empty leaves buffers unset)."""
        for mixture in self.mixtures():
            if mixture.router.expert_bias is not None:
                mixture.router.expert_bias.zero_()

    def run_layers(self, h, layers, seq_len, document_ids=None, cache=None):
        layers = list(layers)
        h = super().run_layers(h, layers, seq_len, document_ids, cache)
        ran_now = {id(layer.get_submodule("feed_forward")) for layer in layers}
        ran = [(p, m) for p, m in self.held_mixtures().items() if id(m) in ran_now]
        aux = [m.aux_loss for _, m in ran if m.aux_loss is not None]
        rows = [
            torch.cat([m.load, m.aux_loss.detach()[None], m.load.new_ones(1)])
            for _, m in ran
            if m.load is not None and m.aux_loss is not None
        ]
        # The graph is the objective's now. (Activation checkpointing's recompute sets them again in the backward,
        # from the same tokens; the next forward replaces them: nothing is read from them before.)
        for _, m in ran:
            m.aux_loss = m.load = None
        # Only a training forward that a backward pass follows trains on its tokens: one without gradients (a
        # pipeline's probe of its stages' shapes, project.parallel.strategies.pipeline) counts nothing.
        if not (self.training and torch.is_grad_enabled()):
            return h
        # A table even where these layers hold no mixture (a pipeline stage of dense blocks): every rank that trained
        # then joins step_statistics' sum over ranks.
        statistics = torch.zeros(len(self.config.moe_layers), self.config.n_experts + 2, device=h.device)
        if rows:
            statistics[[p for p, _ in ran]] = torch.stack(rows)
        self._statistics = statistics if self._statistics is None else self._statistics + statistics
        if self.config.aux_loss_coef > 0 and aux:
            part = torch.stack(aux).sum() / len(self.config.moe_layers)
            self._pending_aux = part if self._pending_aux is None else self._pending_aux + part
        return h

    def with_auxiliary_losses(self, loss: torch.Tensor) -> torch.Tensor:
        # The loss as a plain tensor (the caller's: a tensor-parallel head's is a DTensor until then).
        aux, self._pending_aux = self._pending_aux, None
        return loss if aux is None else WithAuxiliaryGradient.apply(loss, aux, self.config.aux_loss_coef)

    def stage_output(self, h: torch.Tensor) -> torch.Tensor:
        # A pipeline's schedule backpropagates each microbatch's loss from a gradient of 1 (and scales every
        # gradient once at the end): the stage's auxiliary losses join with their own weight as gradient.
        aux, self._pending_aux = self._pending_aux, None
        return h if aux is None else WithAuxiliaryGradient.apply(h, aux, self.config.aux_loss_coef, False)

    @torch.no_grad()
    def step_statistics(
        self, sum_over_ranks, report: bool, applied: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """After the backward passes of an optimizer step: every rank's expert loads and auxiliary losses since the
        last step, summed by `sum_over_ranks` (the strategy's), move the routing biases (bias_update_rate > 0), and
        with `report` give the step's metrics: moe/aux_loss (the mean of each mixture's mean over batches and
        ranks), and per mixture block i moe/layer{i}/load_max and load_min (the most and least loaded expert's tokens
        over the mean) and moe/layer{i}/top_share (the share of the step's tokens routed to the most loaded expert).
        Every rank sums the whole model's table alike (a pipeline stage's rows of others' mixtures are zeros)."""
        statistics, self._statistics = self._statistics, None
        if statistics is None or not (report or self.config.bias_update_rate > 0):
            return {}
        statistics = sum_over_ranks(statistics)
        loads, aux_sums, counts = statistics[:, :-2], statistics[:, -2], statistics[:, -1]
        mean = loads.mean(dim=1)
        if self.config.bias_update_rate > 0:
            for position, mixture in self.held_mixtures().items():
                bias = mixture.router.expert_bias
                assert bias is not None  # every router has one where bias_update_rate > 0
                move = self.config.bias_update_rate * torch.sign(mean[position] - loads[position])
                bias += move if applied is None else move * applied  # not on a step whose update is withheld
        if not report:
            return {}
        tokens = loads.sum(dim=1) / self.config.top_k
        metrics = {"moe/aux_loss": (aux_sums / counts).mean()}
        for index, load, m, n in zip(self.config.moe_layers, loads, mean, tokens, strict=True):
            metrics[f"moe/layer{index}/load_max"] = load.max() / m
            metrics[f"moe/layer{index}/load_min"] = load.min() / m
            metrics[f"moe/layer{index}/top_share"] = load.max() / n
        return metrics

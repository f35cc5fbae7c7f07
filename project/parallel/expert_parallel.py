"""A mixture's experts split over ranks, two ways at once or either: expert parallelism and tensor parallelism.

Expert parallelism: the experts of each mixture split over a group of data-parallel ranks, tokens sent to them.

Each rank of an expert-parallel group of `ep` ranks holds n_experts / ep of every mixture's experts (its stacked
weights' dim-0 shard: a DTensor on the group's mesh dimension, so checkpoints hold every expert under its global
index and reshard to any layout). In a mixture's forward each rank routes its own tokens as one device would
(project.model.families.moe.model), then:
- dispatch: one all-to-all sends each token to the rank holding its expert (the counts first, so every rank knows
  what it receives);
- the rank's experts run on what they received, grouped by expert;
- combine: the inverse all-to-all brings each result back to its token's rank, in the order it left.
The backward passes are the same all-to-alls the other way. The ranks of a group read different sequences (they are
data-parallel ranks), so the experts see every token of the group, and an expert's gradient sums over them.

Gradients: an expert's gradient sums what every rank of its group sent it; the all-to-alls' backward passes scale
it to the mean over the group (SplitExperts._exchanged), and FSDP2, which shards each expert group's weights
again over the ranks holding the same experts (the other groups), averages it over them: the mean over every
data-parallel rank, as a dense weight's gradient is.

Tensor parallelism: each expert's hidden units split over the tensor-parallel group, as a dense SwiGLU's are (w1 and
w3 by rows, w2 by columns), so no expert's product is computed twice. Every rank of the group routes the same tokens
(the replicated residual stream, or the sequence gathered under sequence parallelism) and computes its units of every
routed token's experts: a part of each result, which one all-reduce over the group sums (its backward passes the
gradient on as it is, every rank holding the whole of it); the tokens' gradients are the same parts, summed by one
all-reduce in the backward. Both around the experts alone: the router and the weighing of the results stay whole on
every rank, with whole gradients. Under both, the all-to-alls exchange each tensor-parallel rank's parts among the
ranks holding its units of the group's experts.

Summing parts needs every rank of the group to have routed alike: the same tokens to the same experts in the same
order. Their routers compute the same values from the same inputs, but a router's copies can drift apart by a bit on
GPUs (ReplicaCheck finds it, every N steps), and a single flipped choice would then sum different tokens' parts,
silently. So the group routes as its first rank does: its scores, choices and weights broadcast to the others
(`RouteAlike`), each rank's own computation kept for the gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from project.model.llama import Llama, mixtures_of


class AllToAll(torch.autograd.Function):
    """torch.distributed's all_to_all_single of dim-0 pieces, with its backward: the same exchange reversed, the
    gradient times `scale` (SplitExperts._exchanged says why)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, sent: list[int], received: list[int], group: dist.ProcessGroup, scale: float
    ) -> torch.Tensor:
        ctx.sent, ctx.received, ctx.group, ctx.scale = sent, received, group, scale
        out = x.new_empty((sum(received), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(back, (grad * ctx.scale).contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return back, None, None, None, None


class SummedInBackward(torch.autograd.Function):
    """x itself; in the backward its gradient summed over `group` (each rank's is a part: Megatron-LM's f)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SummedInForward(torch.autograd.Function):
    """x summed over `group` (each rank's is a part); its gradient passed on as it is, whole on every rank
    (Megatron-LM's g)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


# How each way splits the stacked weights (w1, w3: [n, hidden, dim]; w2: [n, dim, hidden]): whole experts along dim 0;
# hidden units along each matrix's own dimension of them (the family's spec: w1 and w3 by "rows", w2 by "cols").
SPLIT_DIMS = {"experts": {"w1": 0, "w3": 0, "w2": 0}, "hidden": {"w1": 1, "w3": 1, "w2": 2}}


class RouteAlike:
    """A router's forward hook: its outputs (scores [N, n] float32, chosen [N, top_k], weights [N, top_k]) replaced
    by the group's first rank's, in one broadcast; the values are that rank's, the gradients flow through this rank's
    own computation of them (the same, but for a drift ReplicaCheck reports)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.first = group, dist.get_global_rank(group, 0)

    def __call__(self, module: nn.Module, args: tuple, output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        scores, chosen, weights = output
        # Expert indices are exact in float32 (far fewer than 2**24 experts): one message for the three.
        packed = torch.cat([scores.detach(), weights.detach().float(), chosen.float()], dim=-1).contiguous()
        dist.broadcast(packed, self.first, group=self.group)
        n, k = scores.shape[-1], chosen.shape[-1]
        first_scores, first_weights = packed[:, :n], packed[:, n : n + k].to(weights.dtype)
        return (
            scores + (first_scores - scores.detach()),
            packed[:, n + k :].to(chosen.dtype),
            weights + (first_weights - weights.detach()),
        )


class SplitExperts(nn.Module):
    """A mixture's Experts whose stacked weights are split over `mesh`, each of its dimensions one way of `ways`
    ("experts": whole experts per rank, the tokens exchanged; "hidden": each expert's hidden units, the results
    summed), run on the tokens routed to them. Its parameters are the Experts' (w1, w3, w2: the same names), as
    DTensor shards, so checkpoints hold every expert whole under its global index and reshard to any layout."""

    def __init__(self, experts: nn.Module, mesh: DeviceMesh, ways: tuple[str, ...]):
        super().__init__()
        for name, param in experts.named_parameters(recurse=False):
            placements = [Shard(SPLIT_DIMS[way][name]) for way in ways]
            sharded = distribute_tensor(param.data, mesh, placements, src_data_rank=None)
            self.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        groups = dict(zip(ways, mesh.get_all_groups(), strict=True))
        self.expert_group, self.hidden_group = groups.get("experts"), groups.get("hidden")
        self.ranks = mesh.size(ways.index("experts")) if "experts" in ways else 1
        # The family's products, of this rank's experts (project.model.llama.Mixture).
        self.products = cast(Callable[..., torch.Tensor], experts.products)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.hidden_group is not None:
            x = SummedInBackward.apply(x, self.hidden_group)
        out = self._exchanged(x, counts) if self.expert_group is not None else self._computed(x, counts)
        if self.hidden_group is not None:
            out = SummedInForward.apply(out, self.hidden_group)
        return out

    def _computed(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The products of this rank's part of the experts (counts: tokens per expert it holds)."""
        params = [self.get_parameter(name) for name in ("w1", "w3", "w2")]
        weights = [w.to_local() if isinstance(w, DTensor) else w for w in params]
        return self.products(x, counts, *weights)

    def _exchanged(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each token sent to the rank of the expert group holding its expert, computed there, and sent back."""
        group, ep = self.expert_group, self.ranks
        local = counts.numel() // ep
        # received[s, l]: the tokens rank s sends this rank's expert l (each rank's counts, laid out by rank).
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        # The all-to-alls take their sizes on the host: read both counts there at once (one wait for the device).
        sent_host, received_host = torch.stack([counts, received]).tolist()
        received = received.view(ep, local)
        sent_splits = [sum(sent_host[r * local : (r + 1) * local]) for r in range(ep)]
        received_splits = [sum(received_host[s * local : (s + 1) * local]) for s in range(ep)]
        # The experts' gradients sum what every rank of the group sent them; a dense weight's gradient is the mean
        # over data-parallel ranks. So the combine's backward divides the results' gradients by the group's size
        # (the experts' gradients come out as that mean) and the dispatch's multiplies the tokens' back (theirs
        # unchanged); FSDP2 then averages over the groups, as it does a dense weight's.
        arrived = AllToAll.apply(x, sent_splits, received_splits, group, float(ep))
        # Arrived by source rank, then expert; the experts take theirs together: regrouped by expert, then source.
        pieces = arrived.split(received_host)
        by_expert = torch.cat([pieces[s * local + e] for e in range(local) for s in range(ep)])
        out = self._computed(by_expert, received.sum(dim=0))
        results = out.split([received_host[s * local + e] for e in range(local) for s in range(ep)])
        by_source = torch.cat([results[e * ep + s] for s in range(ep) for e in range(local)])
        return AllToAll.apply(by_source, received_splits, sent_splits, group, 1.0 / ep)


def split_experts(model: Llama, mesh: DeviceMesh, ways: tuple[str, ...]) -> None:
    """Split the experts of every mixture the model holds (Llama.mixtures) over `mesh`, its dimensions in `ways`
    (SplitExperts), in place: parameter names stay the model's, their values each rank's shard. Where the hidden
    units are split, the group's ranks route as its first rank does (RouteAlike)."""
    for mixture in mixtures_of(model):
        mixture.experts = experts = SplitExperts(mixture.experts, mesh, ways)
        if experts.hidden_group is not None:
            mixture.router.register_forward_hook(RouteAlike(experts.hidden_group))

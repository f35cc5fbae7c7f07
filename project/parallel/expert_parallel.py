"""Expert parallelism: the experts of each mixture split over a group of data-parallel ranks, tokens sent to them.

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
it to the mean over the group (ExpertParallelExperts.forward), and FSDP2, which shards each expert group's weights
again over the ranks holding the same experts (the other groups), averages it over them: the mean over every
data-parallel rank, as a dense weight's gradient is.
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
    gradient times `scale` (ExpertParallelExperts says why)."""

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


class ExpertParallelExperts(nn.Module):
    """A mixture's Experts whose stacked weights are split over an expert-parallel mesh dimension (dim 0, whole
    experts per rank), run on the tokens every rank of the group routed to them. Its parameters are the Experts'
    (w1, w3, w2: the same names), as shards."""

    def __init__(self, experts: nn.Module, ep_mesh: DeviceMesh):
        super().__init__()
        for name, param in experts.named_parameters(recurse=False):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        self.group, self.ranks = ep_mesh.get_group(), ep_mesh.size()
        # The family's products, of this rank's experts (project.model.llama.Mixture).
        self.products = cast(Callable[..., torch.Tensor], experts.products)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ranks
        local = counts.numel() // ep
        # received[s, l]: the tokens rank s sends this rank's expert l (each rank's counts, laid out by rank).
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        # The all-to-alls take their sizes on the host: read both counts there at once (one wait for the device).
        sent_host, received_host = torch.stack([counts, received]).tolist()
        received = received.view(ep, local)
        sent_splits = [sum(sent_host[r * local : (r + 1) * local]) for r in range(ep)]
        received_splits = [sum(received_host[s * local : (s + 1) * local]) for s in range(ep)]
        # The experts' gradients sum what every rank of the group sent them; a dense weight's gradient is the mean
        # over data-parallel ranks. So the combine's backward divides the results' gradients by the group's size
        # (the experts' gradients come out as that mean) and the dispatch's multiplies the tokens' back (theirs
        # unchanged); FSDP2 then averages over the groups, as it does a dense weight's.
        arrived = AllToAll.apply(x, sent_splits, received_splits, self.group, float(ep))
        # Arrived by source rank, then expert; the experts take theirs together: regrouped by expert, then source.
        pieces = arrived.split(received_host)
        by_expert = torch.cat([pieces[s * local + e] for e in range(local) for s in range(ep)])
        params = [self.get_parameter(name) for name in ("w1", "w3", "w2")]
        weights = [w.to_local() if isinstance(w, DTensor) else w for w in params]
        out = self.products(by_expert, received.sum(dim=0), *weights)
        results = out.split([received_host[s * local + e] for e in range(local) for s in range(ep)])
        by_source = torch.cat([results[e * ep + s] for s in range(ep) for e in range(local)])
        return AllToAll.apply(by_source, received_splits, sent_splits, self.group, 1.0 / ep)


def apply_expert_parallel(model: Llama, ep_mesh: DeviceMesh) -> None:
    """Split the experts of every mixture the model holds (Llama.mixtures) over `ep_mesh` (a 1-D mesh of the group's
    ranks), in place: parameter names stay the model's, their values each rank's shard."""
    for mixture in mixtures_of(model):
        mixture.experts = ExpertParallelExperts(mixture.experts, ep_mesh)

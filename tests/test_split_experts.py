"""A mixture of experts under tensor parallelism (project.parallel.expert_parallel, project.parallel.tensor_parallel),
on two gloo processes started by the test itself: each rank holds and computes half of every expert's hidden units
(its products' FLOPs counted by torch's FlopCounterMode are half one device's: none is computed twice), and the
model's loss and every gradient are one device's; the ranks route as the first one does, whatever their routers."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_parallel_in_process import on_two_gloo_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode

from project.model.families import build_model
from project.model.families.moe.config import MoEConfig
from project.parallel.expert_parallel import split_experts
from project.parallel.recompute import recompute_blocks
from project.parallel.tensor_parallel import apply_tensor_parallel

pytestmark = pytest.mark.slow

CONFIG = MoEConfig(
    vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=16,
    n_experts=4, top_k=2, expert_ffn_dim=24, shared_expert=True, aux_loss_coef=0.5,
)  # fmt: skip


def experts_flops(model, tokens: torch.Tensor) -> int:
    """The FLOPs of the first mixture's stacked experts in one forward (their products run on plain tensors)."""
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    counts = counter.get_flop_counts()
    return sum(sum(ops.values()) for name, ops in counts.items() if name.endswith("layers.0.feed_forward.experts"))


def check_split_experts(sequence_parallel: bool, recompute: bool = False) -> None:
    reference = build_model(CONFIG, init_seed=3).train()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    apply_tensor_parallel(model, mesh, sequence_parallel, loss_parallel=False)
    if recompute:  # as the strategies order them: blocks wrapped before the experts are split
        recompute_blocks(model)
    split_experts(model, mesh, ("hidden",))
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, dims=1)

    if not recompute:  # (the recomputed blocks' modules are named within their wrappers)
        mixture = model.layers["0"].feed_forward
        for held, whole in ((mixture.experts.w1, (4, 12, 32)), (mixture.experts.w2, (4, 32, 12))):
            assert held.to_local().shape == whole  # half of each expert's 24 hidden units
        assert mixture.shared_expert.w1.weight.to_local().shape == (12, 32)
        assert not isinstance(mixture.router.gate.weight, DTensor)  # every rank routes (alike)
        assert experts_flops(model, tokens) * 2 == experts_flops(reference, tokens) > 0

    loss = model.hooks.with_auxiliary_losses(F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()))
    loss.backward()
    expected = reference.hooks.with_auxiliary_losses(
        F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())
    )
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def check_a_drifted_router_routes_as_the_first_rank() -> None:
    """Rank 1's router weights moved far enough to choose other experts: the group still routes as rank 0 does, so
    the model's output is one device's (whose router is rank 0's)."""
    reference = build_model(CONFIG, init_seed=3).eval()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    apply_tensor_parallel(model, mesh, sequence_parallel=False, loss_parallel=False)
    split_experts(model, mesh, ("hidden",))
    router = model.layers["0"].feed_forward.router
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    if dist.get_rank() == 1:
        with torch.no_grad():
            router.gate.weight.add_(torch.randn(router.gate.weight.shape, generator=torch.Generator().manual_seed(2)))
    own = router(torch.randn(32, CONFIG.dim, generator=torch.Generator().manual_seed(4)))[1]
    theirs = own.clone()
    dist.broadcast(theirs, 0)
    assert torch.equal(own, theirs)  # the hook's choices: rank 0's on both
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-5, atol=1e-6)


def check_split_experts_every_way() -> None:
    for sequence_parallel in (False, True):
        check_split_experts(sequence_parallel)
    check_split_experts(False, recompute=True)
    check_a_drifted_router_routes_as_the_first_rank()


def test_each_tensor_parallel_rank_computes_half_of_every_expert_and_trains_like_one_device():
    """Without sequence parallelism and with it (the sequence gathered before the mixture), with blocks recomputed in
    the backward (the routed all-reduce again), and with one rank's router drifted: on the same two ranks."""
    on_two_gloo_ranks(check_split_experts_every_way)

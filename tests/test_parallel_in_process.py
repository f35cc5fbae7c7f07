"""Parallel plans on two gloo processes started by the test itself (no Lightning): layouts, gradients, init."""

import contextlib
import copy
import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from project.model.config import LlamaConfig
from project.model.llama import Llama
from project.model.loss import IGNORED, target_scores
from project.parallel.fsdp2 import apply_fsdp2
from project.parallel.init import materialize
from project.parallel.tensor_parallel import apply_tensor_parallel
from project.training.callbacks.memory import SavedActivations

pytestmark = pytest.mark.slow

CONFIG = LlamaConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=16)


def on_two_gloo_ranks(check, *args) -> None:
    """Run `check(*args)` on two processes joined in a gloo group; an exception in either fails the test."""
    on_gloo_ranks(2, check, *args)


def on_gloo_ranks(ranks: int, check, *args) -> None:
    """Run `check(*args)` on `ranks` processes joined in a gloo group; an exception in any fails the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_join_and_check, args=(port, ranks, check, args), nprocs=ranks)


def _join_and_check(rank: int, port: int, ranks: int, check, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    try:
        check(*args)
    finally:
        dist.destroy_process_group()
    # The check passed: leave without the interpreter's shutdown, which gloo's threads abort now and
    # then ("terminate called without an active exception", about one run in 25 on this machine,
    # after both ranks had destroyed the process group) and which mp.spawn would report as a failure.
    os._exit(0)


def check_loss_parallel(sequence_parallel: bool) -> None:
    torch.manual_seed(0)
    reference = Llama(CONFIG)
    model = copy.deepcopy(reference)
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), sequence_parallel, loss_parallel=True)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, dims=1)

    logits = model(tokens)
    # The full logits never exist on a rank: each holds its half of the vocabulary.
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits
    assert logits.to_local().shape == (2, 16, CONFIG.vocab_size // 2)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    expected = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())
    expected.backward()

    torch.testing.assert_close(loss.full_tensor(), expected, rtol=1e-5, atol=0)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sequence-parallel"])
def test_loss_on_vocabulary_split_logits_matches_one_device(sequence_parallel):
    on_two_gloo_ranks(check_loss_parallel, sequence_parallel)


def check_chunked_loss(sequence_parallel: bool, vocabulary_split: bool, tied: bool = False) -> None:
    torch.manual_seed(0)
    reference = Llama(dataclasses.replace(CONFIG, tie_embeddings=tied))
    model = copy.deepcopy(reference)
    model.config.loss_chunk_tokens = 10  # 5 positions of 2 rows: 4 chunks of 16 positions, the last one short
    apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), sequence_parallel, loss_parallel=vocabulary_split)
    assert (model.output.weight is model.tok_embeddings.weight) == tied  # one matrix, split over the vocabulary
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, dims=1)

    with loss_parallel() if vocabulary_split else contextlib.nullcontext():
        loss = model(tokens, targets=targets)
        loss.backward()
    expected = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())  # whole logits, one device
    expected.backward()

    torch.testing.assert_close(loss.full_tensor() if isinstance(loss, DTensor) else loss, expected, rtol=1e-6, atol=0)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    check_target_scores(model, reference, tokens, vocabulary_split)


def check_target_scores(model, reference, tokens: torch.Tensor, vocabulary_split: bool) -> None:
    """Downstream tasks' row scores (project.model.loss.target_scores) from the model's chunks equal whole logits':
    row 0's targets are the reference's own first choices in its second half (each ranked first), row 1's the
    next tokens in its last 5 positions (the rest IGNORED)."""
    with torch.no_grad():
        log_probs = reference(tokens).double().log_softmax(dim=-1)
    targets = torch.full_like(tokens, IGNORED)
    targets[0, 8:] = log_probs[0, 8:].argmax(dim=-1)
    targets[1, 11:] = tokens.roll(-1, dims=1)[1, 11:]
    with loss_parallel() if vocabulary_split else contextlib.nullcontext():
        out = model(tokens, targets=targets, score_targets=True)
    scores = target_scores(out.full_tensor() if isinstance(out, DTensor) else out, targets)
    real = targets != IGNORED
    picked = log_probs.gather(2, targets.clamp(min=0)[..., None])[..., 0] * real
    first = (log_probs.argmax(dim=-1) == targets) & real
    expected = torch.stack([picked.sum(1), real.sum(1).double(), first.sum(1).double()], dim=1)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert scores[0, 2] == 8 and scores[1, 1] == 5  # row 0 greedy throughout


def check_chunked_loss_in_every_tensor_parallel_plan() -> None:
    for sequence_parallel in (False, True):
        for vocabulary_split in (True, False):  # loss parallel, then logits gathered whole
            check_chunked_loss(sequence_parallel, vocabulary_split)
    for vocabulary_split in (True, False):  # the head is the embedding: its gradient sums both uses, as on one device
        check_chunked_loss(True, vocabulary_split, tied=True)


def test_loss_in_chunks_of_tokens_under_tensor_parallelism_matches_whole_logits_tied_or_not():
    on_two_gloo_ranks(check_chunked_loss_in_every_tensor_parallel_plan)


def check_meta_init(plan: str) -> None:
    torch.manual_seed(0)
    reference = Llama(CONFIG)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(CONFIG)
    mesh = init_device_mesh("cpu", (2,))
    apply_tensor_parallel(model, mesh) if plan == "tp" else apply_fsdp2(model, mesh)
    materialize(model, torch.device("cpu"))
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert isinstance(p, DTensor) and p.to_local().numel() < q.numel() or name.endswith("norm.weight"), name
        torch.testing.assert_close(p.full_tensor() if isinstance(p, DTensor) else p, q, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("plan", ["tp", "fsdp2"])
def test_model_built_on_meta_and_sharded_starts_from_the_single_device_weights(plan):
    on_two_gloo_ranks(check_meta_init, plan)


def check_fsdp2_gathers() -> None:
    """In the dtype asked for; freed after each forward, or kept to the backward (a pipeline stage's setting)."""
    mesh = init_device_mesh("cpu", (2,))
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 16))
    for reshard_after_forward in (True, False):
        torch.manual_seed(0)
        model = Llama(CONFIG)
        apply_fsdp2(model, mesh, "bfloat16", None, reshard_after_forward)
        seen = []
        model.layers["0"].attention.wq.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
        logits = model(tokens)
        assert seen == [torch.bfloat16] and logits.dtype == torch.bfloat16
        # Sharded again (a DTensor, this rank's half) once the forward is over, or still whole.
        weight = model.layers["0"].attention.wq.weight
        assert isinstance(weight, DTensor) is reshard_after_forward, reshard_after_forward
        logits.float().sum().backward()
        weight = model.layers["0"].attention.wq.weight  # always sharded after the backward
        assert isinstance(weight, DTensor) and weight.grad.dtype == torch.float32  # reduced in float32


def test_fsdp2_gathers_in_the_dtype_asked_and_keeps_them_to_the_backward_when_told():
    on_two_gloo_ranks(check_fsdp2_gathers)


def split_over_the_ranks(
    regather: bool = False, ring: bool = False, recompute: bool = False
) -> tuple[int, int, Llama, Llama, torch.Tensor]:
    """(rank, size, one device's model, the same model with context parallelism over the group (its blocks recomputed
    in the backward with `recompute`), tokens [2, 8 x size]: two chunks of 4 positions per rank)."""
    from project.parallel.context_parallel import apply_context_parallel
    from project.parallel.recompute import recompute_blocks

    size = dist.get_world_size()
    torch.manual_seed(0)
    reference = Llama(dataclasses.replace(CONFIG, max_seq_len=8 * size))
    model = copy.deepcopy(reference)
    if recompute:  # as the strategies order them: the context-parallel hooks inside the recomputed blocks
        recompute_blocks(model)
    apply_context_parallel(model, dist.group.WORLD, regather, ring)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8 * size), generator=torch.Generator().manual_seed(1))
    return dist.get_rank(), size, reference, model, tokens


def check_context_parallel(
    documents: bool, regather: bool = False, ring: bool = False, recompute: bool = False
) -> None:
    from project.parallel.context_parallel import split_for_rank

    rank, size, reference, model, tokens = split_over_the_ranks(regather, ring, recompute)
    targets = tokens.roll(-1, dims=1)
    # Documents across the chunks' edges (chunks of 4 positions), one of a single token.
    length = tokens.shape[1]
    rows = [[0] * 3 + [1] * 6 + [2] + [3] * (length - 10), [0] * 11 + [1] * (length - 11)]
    ids = {"document_ids": torch.tensor(rows)} if documents else {}

    # Each rank: its two chunks of every sequence (4 tokens each), the loss over its tokens; the documents whole.
    loss = model(split_for_rank(tokens, rank, size), targets=split_for_rank(targets, rank, size), **ids)
    (loss / size).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # what data parallelism over the group does
    dist.all_reduce(loss)
    expected = reference(tokens, targets=targets, **ids)  # one device, the whole sequences
    expected.backward()

    torch.testing.assert_close(loss / size, expected, rtol=1e-6, atol=0)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


# A Llama-like head layout (eight query heads per key/value head, as Llama 3 70B) at 4,096 tokens.
LONG = LlamaConfig(vocab_size=300, dim=640, n_layers=2, n_heads=8, n_kv_heads=1, multiple_of=32, max_seq_len=4096)


def saved_activations(context_parallel: bool, config: LlamaConfig = LONG, ring: bool = False) -> int:
    from project.parallel.context_parallel import apply_context_parallel, split_for_rank

    torch.manual_seed(0)
    model = Llama(config)
    tokens = torch.randint(
        0, config.vocab_size, (1, config.max_seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if context_parallel:
        apply_context_parallel(model, dist.group.WORLD, ring=ring)
        rank, size = dist.get_rank(), dist.get_world_size()
        inputs, targets = split_for_rank(inputs, rank, size), split_for_rank(targets, rank, size)
    with SavedActivations().of(model.parameters()) as saved:
        loss = model(inputs, targets=targets)
    held = saved.bytes  # while the loss holds the graph, as between a forward pass and its backward
    del loss
    return held


def check_two_ranks_hold_at_most_six_tenths_of_one_devices_activations() -> None:
    one_device = saved_activations(context_parallel=False)  # each rank alone, the whole sequence
    split = saved_activations(context_parallel=True)
    assert split <= 0.6 * one_device, (split, one_device)


# LONG's head layout at a quarter of its length: the bytes kept are exact at any length.
KEPT = dataclasses.replace(LONG, max_seq_len=1024)


def kept_keys_and_values(regather: bool) -> tuple[int, int]:
    """Bytes autograd keeps for the backward of (the gathered keys and values, this rank's own) over KEPT's blocks."""
    from project.parallel import context_parallel
    from project.parallel.context_parallel import apply_context_parallel, split_for_rank

    sent, gathered, alive = set(), set(), []  # storages, kept alive so that no later tensor takes their address
    gather = context_parallel.gather_sequence

    def spy(x: torch.Tensor, *args) -> torch.Tensor:
        out = gather(x, *args)
        alive.extend([x, out])
        sent.add(x.untyped_storage().data_ptr())
        gathered.add(out.untyped_storage().data_ptr())
        return out

    context_parallel.gather_sequence = spy
    try:
        torch.manual_seed(0)
        model = Llama(KEPT)
        apply_context_parallel(model, dist.group.WORLD, regather)
        tokens = torch.randint(
            0, KEPT.vocab_size, (1, KEPT.max_seq_len + 1), generator=torch.Generator().manual_seed(1)
        )
        rank, size = dist.get_rank(), dist.get_world_size()
        inputs, targets = split_for_rank(tokens[:, :-1], rank, size), split_for_rank(tokens[:, 1:], rank, size)
        saved = {}

        def keep(t: torch.Tensor) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = model(inputs, targets=targets)
        # Counted before the backward, whose regathered tensors may take the addresses of the saved ones it frees.
        counted = (
            sum(n for ptr, n in saved.items() if ptr in gathered),
            sum(n for ptr, n in saved.items() if ptr in sent),
        )
        loss.backward()
    finally:
        context_parallel.gather_sequence = gather
    return counted


def check_the_planner_counts_the_keys_and_values_each_block_keeps() -> None:
    """Every block keeps the whole sequence's keys and values, or, regathered, its own part only: what the planner
    adds (the rest of the sequence per block, kept; or one block's whole sequence, regathered in its backward)."""
    from project.planning.candidates import Candidate
    from project.planning.memory import Allowance, estimate_memory

    kept = kept_keys_and_values(regather=False)
    regathered = kept_keys_and_values(regather=True)
    whole = KEPT.n_layers * KEPT.max_seq_len * KEPT.kv_heads * KEPT.head_dim * 2 * 4  # K and V, float32
    assert kept == (whole, 0) and regathered == (0, whole // 2), (kept, regathered)
    planned = [
        estimate_memory(
            KEPT,
            Candidate("fsdp2", 1, 1, 1, 1, 1, context_parallel=2, regather_kv=r),
            KEPT.max_seq_len,
            "32-true",
            "cpu",
            Allowance(),
        ).activations
        for r in (False, True)
    ]
    one_block = kept[0] // KEPT.n_layers
    assert planned[0] - planned[1] == kept[0] - regathered[1] - one_block


def check_a_ring_keeps_only_the_ranks_own_keys_and_values_as_the_planner_counts() -> None:
    """Ring attention keeps the rest of the sequence's keys and values less than the gather does: what the planner
    counts between the two. (The gather keeps more still: its two chunks' attention outputs apart from their
    concatenation, which the planner does not count.)"""
    from project.planning.candidates import Candidate
    from project.planning.memory import Allowance, estimate_memory, ring_working_bytes

    gathered, ring = (saved_activations(True, KEPT, ring) for ring in (False, True))
    planned = [
        estimate_memory(
            KEPT,
            Candidate("fsdp2", 1, 1, 1, 1, 1, context_parallel=2, context_parallel_kv=kv),
            KEPT.max_seq_len,
            "32-true",
            "cpu",
            Allowance(),
        ).activations
        for kv in ("gather", "ring")
    ]
    rest = KEPT.n_layers * KEPT.max_seq_len // 2 * KEPT.kv_heads * KEPT.head_dim * 2 * 4  # K and V, float32
    # The ring's backward holds one block's working copies besides (counted apart: not kept by autograd).
    working = ring_working_bytes(KEPT, Candidate("fsdp2", 1, 1, 1, 1, 1, context_parallel=2), KEPT.max_seq_len // 2, 4)
    assert planned[0] - (planned[1] - working) == rest and gathered - ring >= rest, (gathered - ring, rest, planned)


def check_context_parallel_attention() -> None:
    check_context_parallel(documents=False)
    check_context_parallel(documents=True)
    check_context_parallel(documents=True, regather=True)
    check_context_parallel(documents=False, ring=True)  # keys and values passed around, not gathered
    check_context_parallel(documents=True, ring=True)
    check_context_parallel(documents=True, ring=True, recompute=True)  # the ring's passes run again in the backward
    from project.parallel import ring_attention

    ring_attention.TILE = 3  # chunks of 4 positions in blocks of 3 and 1: ragged tiles, causal on the diagonal
    try:
        check_context_parallel(documents=False, ring=True)
        check_context_parallel(documents=True, ring=True)
    finally:
        ring_attention.TILE = 1024
    check_the_planner_counts_the_keys_and_values_each_block_keeps()
    check_a_ring_keeps_only_the_ranks_own_keys_and_values_as_the_planner_counts()
    check_two_ranks_hold_at_most_six_tenths_of_one_devices_activations()
    check_the_gpus_lower_right_kernel_path_under_bf16_autocast()  # last: it swaps the kernel choice of the process


def test_context_parallel_attention_matches_one_device_and_a_rank_of_two_holds_six_tenths_of_its_activations():
    """In one pair of processes (each start costs seconds): causal and within documents, as one device (keys and
    values kept, or regathered in the backward: the bytes each keeps, as the planner counts them); at 4,096
    tokens a rank of two holds at most 0.6 of one device's activations (MemoryMonitor's count: what autograd saved
    for backward, parameters left out; a stable quantity; not half: the keys and values of the whole sequence are
    gathered, and the CPU's causal masks are made once per length); the GPUs' kernel path under bf16 autocast."""
    on_two_gloo_ranks(check_context_parallel_attention)


def check_a_ring_of_three() -> None:
    for documents in (False, True):
        check_context_parallel(documents, ring=True)
    check_context_parallel(documents=True, ring=True, recompute=True)


def test_a_ring_of_three_ranks_attends_as_one_device():
    """An odd ring (each rank's keys and values passed on twice; the causal pairs of chunks 0..5 over 3 ranks), within
    documents and not, its blocks recomputed in the backward or not."""
    on_gloo_ranks(3, check_a_ring_of_three)


def check_the_gpus_lower_right_kernel_path_under_bf16_autocast() -> None:
    """What a GPU runs (torch's lower-right causal mask, which calls its kernels without autocast's casts) taken on
    the CPU: under bf16-mixed the rotary angles leave q and k in float32 beside a bfloat16 v, which torch refuses
    ("Expected query, key, and value to have the same dtype") unless they are brought to one dtype first; keys and
    values gathered in bfloat16."""
    from project.parallel import context_parallel
    from project.parallel.context_parallel import split_for_rank, zigzag_positions

    context_parallel.lower_right_kernel = lambda q: True  # this process only (spawned for the check)
    gathered = []
    gather = context_parallel.gather_sequence
    context_parallel.gather_sequence = lambda x, *args: gathered.append(x.dtype) or gather(x, *args)
    rank, size, reference, model, tokens = split_over_the_ranks()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = model(split_for_rank(tokens, rank, size))
        whole = reference(tokens)
    torch.testing.assert_close(mine, whole[:, zigzag_positions(16, rank, size)], rtol=2e-2, atol=2e-2)
    # Keys and values sent (and kept for backward) in the compute dtype: the keys leave the rotary angles in float32.
    assert gathered == [torch.bfloat16] * 2 * CONFIG.n_layers, gathered


def check_a_checkpoints_records_are_read_on_one_rank() -> None:
    from project.checkpoint.reshard import read_on_one_rank
    from project.runtime.errors import ConfigError

    def share(value):  # Lightning's Strategy.broadcast, from rank 0
        sent = [value]
        dist.broadcast_object_list(sent, src=0)
        return sent[0]

    reads = []

    def read():
        reads.append(dist.get_rank())
        return {"global_step": 7}

    assert read_on_one_rank(share, read) == {"global_step": 7}
    assert reads == ([0] if dist.get_rank() == 0 else [])

    def refuse():
        raise ConfigError("ckpt_path=x is not a checkpoint")

    with pytest.raises(ConfigError, match="ckpt_path=x is not a checkpoint"):  # on rank 1 too, which read nothing
        read_on_one_rank(share, refuse)


def test_a_checkpoints_metadata_is_read_and_verified_on_rank_zero_and_its_verdict_reaches_every_rank():
    on_two_gloo_ranks(check_a_checkpoints_records_are_read_on_one_rank)

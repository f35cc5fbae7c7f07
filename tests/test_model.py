import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from project.model.config import LlamaConfig
from project.model.flops import count_parameters, training_flops_per_token
from project.model.llama import Llama

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def tiny(**overrides) -> LlamaConfig:
    fields = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64)
    return LlamaConfig(**{**fields, **overrides})


def test_forward_returns_logits_over_vocabulary():
    model = Llama(tiny())
    tokens = torch.randint(0, 97, (3, 11))
    assert model(tokens).shape == (3, 11, 97)


def test_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = Llama(tiny()).eval()
    tokens = torch.randint(0, 97, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 97
    torch.testing.assert_close(model(tokens)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(tokens)[:, 10:], model(changed)[:, 10:])


def test_grouped_query_attention_equals_multi_head_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = Llama(tiny(n_kv_heads=2)).eval()
    mha = Llama(tiny(n_kv_heads=4)).eval()
    state = gqa.state_dict()
    head_dim = 32 // 4
    for name, value in list(state.items()):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            # each kv head serves 2 consecutive query heads
            state[name] = value.view(2, head_dim, 32).repeat_interleave(2, dim=0).reshape(4 * head_dim, 32)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 97, (2, 12))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_tokens", [7, 48, 96])  # uneven chunks of 2 positions x 3 rows; even ones; one chunk
def test_the_loss_in_chunks_of_tokens_equals_whole_logits_cross_entropy_with_the_same_gradients(chunk_tokens):
    import copy

    import torch.nn.functional as F

    torch.manual_seed(0)
    model = Llama(tiny(loss_chunk_tokens=chunk_tokens))
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 97, (3, 32), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, dims=1)
    loss = model(tokens, targets=targets)
    loss.backward()
    expected = F.cross_entropy(reference(tokens).flatten(0, 1).float(), targets.flatten())  # the whole logits
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6 * q.grad.abs().max().item(), msg=name)


def test_the_loss_holds_no_more_float32_logits_than_its_budget_whatever_the_vocabulary():
    from project.model.config import LOSS_CHUNK_LOGITS

    for vocab_size in (96, 32000, 128256, 256000):
        chunk = tiny(vocab_size=vocab_size).chunk_tokens
        assert chunk * vocab_size <= LOSS_CHUNK_LOGITS < 2 * chunk * vocab_size  # the largest power of two that fits
        assert chunk & (chunk - 1) == 0
    assert (
        tiny(vocab_size=128256).chunk_tokens == 1024
        and tiny(vocab_size=128256, loss_chunk_tokens=64).chunk_tokens == 64
    )
    # The debug preset at Llama 3's vocabulary, a micro batch of 2 x 1,100 tokens: no head output above the budget.
    model = Llama(tiny(vocab_size=128256, dim=16, n_layers=1, max_seq_len=1100))
    sizes = []
    model.output.register_forward_hook(lambda module, args, out: sizes.append(out.numel()))
    tokens = torch.randint(0, 128256, (2, 1100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens, targets=tokens)
    assert len(sizes) == 3 and max(sizes) == 2 * 512 * 128256 <= LOSS_CHUNK_LOGITS, sizes  # 512 positions of 2 rows


def test_document_mask_isolates_packed_documents():
    torch.manual_seed(0)
    model = Llama(tiny()).eval()
    tokens = torch.randint(0, 97, (1, 12))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    second_alone = model(tokens[:, 5:])
    packed = model(tokens, doc_ids)[:, 5:]
    # the second document sees none of the first, but sits at positions 5.. (RoPE is relative, so equal)
    torch.testing.assert_close(packed, second_alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model(tokens)[:, 5:], second_alone, atol=1e-4)


@pytest.mark.parametrize("n_kv_heads", [2, 4])
def test_flex_attentions_block_mask_attends_as_each_document_alone(n_kv_heads):
    """The block mask GPUs train with (project.model.document_mask), in FlexAttention's forward on the CPU (its
    only pass here: it has no CPU backward), against an independent reference: each document's causal attention
    computed by itself; and against the dense mask the CPU trains with."""
    from project.model.document_mask import dense_document_mask, document_block_mask
    from project.model.kernels import flex_attend

    torch.manual_seed(0)
    lengths = [37, 130, 1, 88]  # across the block mask's 128-position tiles, and a one-token document
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].repeat(2, 1)
    q = torch.randn(2, 4, sum(lengths), 16)
    k, v = torch.randn(2, n_kv_heads, sum(lengths), 16), torch.randn(2, n_kv_heads, sum(lengths), 16)
    out = flex_attend(q, k, v, document_block_mask(doc_ids), enable_gqa=n_kv_heads < 4)
    groups = 4 // n_kv_heads
    k_all, v_all = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    alone = [
        torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
        for qd, kd, vd in zip(*(t.split(lengths, dim=2) for t in (q, k_all, v_all)))
    ]
    torch.testing.assert_close(out, torch.cat(alone, dim=2), rtol=1e-5, atol=1e-5)
    dense = torch.nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=dense_document_mask(doc_ids))
    torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def random_documents(seq_len: int, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Document ids [batch, seq_len] of documents of random lengths, some shorter than a tile, some longer."""
    rows = []
    for _ in range(batch):
        cuts = torch.randperm(seq_len - 1, generator=generator)[: int(torch.randint(1, 12, (1,)))] + 1
        rows.append(torch.zeros(seq_len, dtype=torch.long).index_fill(0, cuts, 1).cumsum(0))
    return torch.stack(rows)


def test_the_block_mask_built_from_tile_edges_equals_torchs_built_from_every_pair_of_positions():
    """project.model.document_mask classifies tiles from the documents at their edges (O(tiles^2)); torch's
    create_block_mask evaluates the rule on all T x T pairs: the same tables, also where T is not a multiple of 128."""
    from torch.nn.attention.flex_attention import create_block_mask

    from project.model.document_mask import document_block_mask

    generator = torch.Generator().manual_seed(0)
    for seq_len in (256, 433, 510, 1024):
        doc_ids = random_documents(seq_len, 3, generator)

        def rule(b, h, q, kv):
            return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

        ours, torchs = document_block_mask(doc_ids), create_block_mask(rule, 3, None, seq_len, seq_len, device="cpu")
        for table in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks"):
            assert torch.equal(getattr(ours, table), getattr(torchs, table)), (seq_len, table)


@pytest.mark.parametrize("seq_len, size", [(1024, 2), (2048, 4), (160, 2)])
def test_a_context_parallel_ranks_block_mask_attends_as_its_rows_of_the_whole_sequence(seq_len, size):
    """Context parallelism's rank keeps queries at two chunks of the sequence (zigzag_positions) and attends over
    every key: its block mask (query_positions) in FlexAttention's forward gives the rows of the whole sequence's
    attention; where the chunks are whole tiles its tables are those torch's create_block_mask evaluates from every
    pair; where they are shorter (160 / 4 = 40 positions) its tiles cover the rule, which is applied inside them."""
    from torch.nn.attention.flex_attention import create_block_mask

    from project.model.document_mask import dense_document_mask, document_block_mask
    from project.model.kernels import flex_attend
    from project.parallel.context_parallel import zigzag_positions

    generator = torch.Generator().manual_seed(seq_len)
    doc_ids = random_documents(seq_len, 2, generator)
    q, k, v = (torch.randn(2, n, seq_len, 8, generator=generator) for n in (4, 2, 2))
    whole = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), attn_mask=dense_document_mask(doc_ids)
    )
    for rank in range(size):
        mine = zigzag_positions(seq_len, rank, size)
        mask = document_block_mask(doc_ids, query_positions=mine)
        torch.testing.assert_close(flex_attend(q[:, :, mine], k, v, mask, enable_gqa=True), whole[:, :, mine])
        assert torch.equal(dense_document_mask(doc_ids, mine), dense_document_mask(doc_ids)[:, :, mine])
        if (seq_len // (2 * size)) % 128 == 0:

            def rule(b, h, q, kv):
                return (mine[q] >= kv) & (doc_ids[b, mine[q]] == doc_ids[b, kv])

            torchs = create_block_mask(rule, 2, None, len(mine), seq_len, device="cpu")
            for table in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
                assert torch.equal(getattr(mask, table), getattr(torchs, table)), (rank, table)


def test_a_block_mask_holds_one_entry_per_tile_not_per_pair_of_positions():
    from project.model.document_mask import document_block_mask

    doc_ids = torch.repeat_interleave(torch.arange(8), 256)[None]  # 8 documents of 256 tokens in 2,048
    mask = document_block_mask(doc_ids)
    tiles = 2048 // 128
    assert max(t.numel() for t in (mask.kv_num_blocks, mask.kv_indices)) <= tiles * tiles
    # Each query tile sees its document's tiles up to itself: at most 2 of the 16, partial or full.
    assert int((mask.kv_num_blocks + mask.full_kv_num_blocks).max()) == 2


def test_the_cpu_trains_with_the_dense_document_mask():
    """FlexAttention has no backward on the CPU: the model's document masking must work there in training."""
    from project.model.document_mask import document_mask

    model = Llama(tiny())
    tokens = torch.randint(0, 97, (2, 20))
    doc_ids = torch.tensor([[0] * 8 + [1] * 12, [0] * 20])
    assert isinstance(document_mask(doc_ids), torch.Tensor)
    model(tokens, doc_ids).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_any_part_of_an_initial_value_is_drawn_alone_and_equals_that_part_of_the_whole():
    model = Llama(tiny(dim=64, n_heads=4, n_kv_heads=2, multiple_of=16, vocab_size=3000))
    name = "tok_embeddings.weight"  # [3000, 64]: tiles of 32 rows
    whole = model.initial_value(name)
    assert torch.equal(whole, model.get_parameter(name).detach())
    rows, cols = torch.arange(1000, 1750), torch.arange(16, 48)  # a dim-0 shard of a column split
    torch.testing.assert_close(model.initial_value(name, rows, cols), whole[1000:1750, 16:48], rtol=0, atol=0)
    scattered = torch.tensor([2999, 0, 64, 33])  # any order, any rows
    torch.testing.assert_close(model.initial_value(name, scattered, cols), whole[scattered][:, cols], rtol=0, atol=0)


def test_initial_values_are_drawn_on_the_host_whatever_the_default_device():
    """Lightning builds the model inside a `torch.device("cuda")` context on a GPU; the tiles' CPU generators
    then met CUDA tensors ("Expected a 'cuda' device type for generator", the H200's gpu-check of 2026-11-26).
    The meta device stands in for CUDA here: any tensor made on the default device would be one."""
    from project.parallel.init import materialize

    model = Llama(tiny(dim=64, n_heads=4, n_kv_heads=2, multiple_of=16, vocab_size=300))
    expected = {name: model.initial_value(name) for name, _ in model.named_parameters()}
    rows, cols = torch.arange(5, 40), torch.arange(3, 9)  # a shard's indices, on the host as init.py gives them
    with torch.device("meta"):
        drawn = {name: model.initial_value(name) for name, _ in model.named_parameters()}
        part = model.initial_value("tok_embeddings.weight", rows, cols)
        built = Llama(tiny(dim=64, n_heads=4, n_kv_heads=2, multiple_of=16, vocab_size=300))
        materialize(built, torch.device("cpu"))
    for name, value in expected.items():
        assert drawn[name].device.type == "cpu" and torch.equal(drawn[name], value), name
        assert torch.equal(built.get_parameter(name).detach(), value), name
    assert torch.equal(part, expected["tok_embeddings.weight"][5:40, 3:9])


def test_a_shard_draws_only_the_tiles_it_touches(monkeypatch):
    """O(shard), not O(model): counted in tiles drawn, as a stable quantity, not a timing."""
    from project.model import initial_values

    drawn = []
    original = initial_values.tile_generator
    monkeypatch.setattr(initial_values, "tile_generator", lambda *a: drawn.append(a[2:]) or original(*a))
    shape = (4096, 4096)  # 128 x 4 tiles of 32 x 1024
    initial_values.normal_values(0, "w", shape, 0.02)
    assert len(drawn) == 128 * 4
    for rank in range(4):  # FSDP2's dim-0 shards over 4 ranks, then tensor parallelism's column split over 4
        for rows, cols in (
            (torch.arange(1024 * rank, 1024 * (rank + 1)), None),
            (None, torch.arange(1024 * rank, 1024 * (rank + 1))),
        ):
            drawn.clear()
            initial_values.normal_values(0, "w", shape, 0.02, rows, cols)
            assert len(drawn) == 128 * 4 // 4
    drawn.clear()
    initial_values.normal_values(0, "w", shape, 0.02, torch.arange(100, 612), torch.arange(1000, 3000))  # off the grid
    assert len(drawn) == 17 * 3  # rows 96..639 and columns 0..3071: the tiles these ranges touch, no more


def test_initial_weights_depend_on_the_init_seed_alone():
    torch.manual_seed(7)
    a = Llama(tiny(), init_seed=7)
    # Whatever ran before in the process (preparing data, a conversion, an import) may have drawn from any
    # global generator, or seeded it otherwise: the weights must not move.
    torch.manual_seed(123)
    torch.rand(1000)
    np.random.seed(5)
    np.random.rand(1000)
    random.seed(9)
    random.random()
    b = Llama(tiny(), init_seed=7)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    other = Llama(tiny(), init_seed=8)
    assert not torch.equal(a.output.weight, other.output.weight)


def test_residual_projections_get_scaled_initialization():
    torch.manual_seed(0)
    config = tiny(dim=256, n_heads=4, n_kv_heads=4, n_layers=8, init_std=0.02)
    model = Llama(config)
    block = model.layers["0"]
    assert block.attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2*8)
    assert torch.equal(block.attention_norm.weight, torch.ones(256))


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_formula_matches_built_model(tie):
    config = tiny(tie_embeddings=tie)
    assert count_parameters(config) == sum(p.numel() for p in Llama(config).parameters())


@pytest.mark.parametrize(
    "preset, published",
    [("llama2_7b", 6.74e9), ("llama3_8b", 8.03e9), ("llama3_70b", 70.6e9)],
)
def test_preset_parameter_counts_match_published_sizes(preset, published):
    config = LlamaConfig(**yaml.safe_load((CONF / f"{preset}.yaml").read_text()))
    assert count_parameters(config) == pytest.approx(published, rel=0.002)


def test_training_flops_are_6n_plus_attention():
    config = tiny()
    n = sum(p.numel() for p in Llama(config).parameters()) - 97 * 32  # embedding lookup does no matmul
    assert training_flops_per_token(config, seq_len=64) == 6 * n + 12 * 2 * 32 * 64


def test_config_rejects_heads_that_do_not_group():
    with pytest.raises(ValueError, match="n_kv_heads"):
        tiny(n_heads=4, n_kv_heads=3)


def test_model_module_imports_no_distributed_lightning_or_hydra():
    # `import torch` itself loads parts of torch.distributed: compare against it.
    code = (
        "import sys, torch; before = set(sys.modules); import project.model.llama; "
        "print(sorted(m for m in set(sys.modules) - before "
        "if m.startswith(('torch.distributed', 'lightning', 'hydra'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    source = (Path(__file__).resolve().parents[1] / "project" / "model" / "llama.py").read_text()
    assert "import torch.distributed" not in source and "lightning" not in source and "hydra" not in source


def test_rotary_angles_stay_float32_precise_in_a_bfloat16_model():
    """bf16-true casts the model and makes bfloat16 the default dtype; FSDP casts buffers. The rotary
    angles of late positions must still be computed in float32: bfloat16's 8-bit mantissa would put
    them off by whole radians."""
    config = LlamaConfig(vocab_size=64, dim=64, n_layers=1, n_heads=4, max_seq_len=4096)
    cos32, sin32 = Llama(config).rope(4096, torch.device("cpu"), torch.float32)
    model = Llama(config).to(torch.bfloat16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        cos16, sin16 = model.rope(4096, torch.device("cpu"), torch.bfloat16)
    finally:
        torch.set_default_dtype(default)
    # Only the final cast to bfloat16 may differ: half a bf16 ulp on values within [-1, 1].
    torch.testing.assert_close(cos16.float(), cos32, atol=2**-8, rtol=0)
    torch.testing.assert_close(sin16.float(), sin32, atol=2**-8, rtol=0)

"""A dry run (`project.train ... dry_run=true`) shards a cluster-size layout on this one CPU with the run's own
code, on a fake process group, and reports each rank's share: checked against shares computed by hand, against
a real start's errors, against what MemoryMonitor records in real runs, and against the planner's formulas."""

import json
import math

import pytest
import yaml
from conftest import PARITY_RUN, PIPELINE_RUN, ROOT, run_module, train_overrides
from hydra import compose, initialize_config_dir
from test_pipeline import LAYOUTS as PIPELINES
from test_sharded_parity import LAYOUTS as SHARDED

from project.config.checks import preflight
from project.config.command_line import CONF
from project.config.float8 import check_float8
from project.config.layout import plan_layout
from project.config.values import model_config
from project.parallel.mesh import MeshShape
from project.planning.candidates import Candidate
from project.planning.cluster import Cluster
from project.planning.dry_run import build_meta_model, model_lines, rank_share, representative_ranks
from project.planning.memory import Allowance, estimate_memory
from project.planning.parameters import sharded_parameters
from project.planning.planner import Workload
from project.planning.render import model_arguments
from project.planning.render import train_overrides as planned_overrides
from project.runtime.errors import ConfigError


def compose_job(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def hand_share(config, shape, rank: int) -> int:
    """Parameters of `rank` by hand: Megatron's tensor-parallel cuts (q, k, v, w1, w3, the embedding and the
    head over their rows; wo and w2 over their columns; norms whole), the pipeline's even stage split (the
    embedding on the first stage, norm and head on the last), then FSDP2's dim-0 chunks of ceil(rows / dp)."""
    pp, dp, tp = shape.pipeline_parallel, shape.data_parallel, shape.tensor_parallel
    p, d = rank // (dp * tp), rank // tp % dp  # tensor parallelism innermost, stages outermost
    h, kv, f, v = config.dim, config.n_kv_heads * config.head_dim, config.ffn_hidden_dim, config.vocab_size
    block = [
        (h, 1),
        (h // tp, h),
        (kv // tp, h),
        (kv // tp, h),
        (h, h // tp),
        (h, 1),
        (f // tp, h),
        (f // tp, h),
        (h, f // tp),
    ]
    layers = config.n_layers // pp
    weights = block * layers + [(v // tp, h)] * (p == 0) + [(h, 1), (v // tp, h)] * (p == pp - 1)
    chunk = lambda rows: math.ceil(rows / dp)  # noqa: E731
    return sum(max(0, min(chunk(rows), rows - d * chunk(rows))) * cols for rows, cols in weights)


JOBS = {  # 64 and 512 devices of 8 per node
    "fsdp2": ["strategy=fsdp2"],
    "tp_fsdp": ["strategy=tp_fsdp", "strategy.tensor_parallel_size=8"],
    "pipeline-3d": [
        "strategy=pipeline",
        "strategy.tensor_parallel_size=8",
        "strategy.data_parallel_size=2",
        "micro_batch_size=1",
    ],
}


@pytest.mark.parametrize("model", ["llama3_8b", "llama3_70b"])
@pytest.mark.parametrize("nodes", [8, 64])
@pytest.mark.parametrize("job", JOBS)
def test_a_cluster_size_layout_shards_on_one_cpu_into_the_shares_computed_by_hand(model, nodes, job):
    cfg = compose_job(
        f"model={model}",
        "trainer=gpu",
        f"trainer.num_nodes={nodes}",
        "trainer.devices=8",
        "global_batch_size=1024",
        *JOBS[job],
    )
    layout = preflight(cfg, dry_run=True)
    world = layout.shape.world_size
    assert world == nodes * 8
    for rank in (0, world - 1):
        share = rank_share(cfg, layout, rank)
        assert share.parameters == hand_share(model_config(cfg), layout.shape, rank), rank
        assert share.param_bytes == share.grad_bytes == 4 * share.parameters  # float32 parameters (bf16-mixed)
    if (
        job == "tp_fsdp" and nodes == 8
    ):  # 70.55B (8.03B) over 8 x 8: each rank about a 64th, norms repeated per tensor-parallel rank
        total = sum(p.numel() for p in build_meta_model(cfg).parameters())
        assert share.parameters == pytest.approx(total / 64, rel=1e-3)


def test_mixtral_with_eight_way_expert_parallelism_shards_on_64_fake_ranks_into_the_shares_computed_by_hand():
    """Each rank of an expert group of 8 holds one of each block's 8 experts, its width split over the 8 ranks that
    hold the same expert (FSDP2 over the groups); the rest of the model FSDP2's dim-0 chunks over all 64 ranks."""
    cfg = compose_job(
        "model=mixtral_8x7b",
        "trainer=gpu",
        "trainer.num_nodes=8",
        "trainer.devices=8",
        "global_batch_size=64",
        "strategy=fsdp2",
        "strategy.expert_parallel_size=8",
    )
    layout = preflight(cfg, dry_run=True)
    config = model_config(cfg)
    h, kv, f, v = config.dim, config.n_kv_heads * config.head_dim, config.ffn_hidden_dim, config.vocab_size
    dense = [(h, 1), (h, h), (kv, h), (kv, h), (h, h), (h, 1), (config.n_experts, h)] * config.n_layers
    dense += [(v, h), (h, 1), (v, h)]
    expert = 3 * (f // 8) * h  # w1, w3 [1, f/8, h] and w2 [1, h/8, f]: one expert, an eighth of its width
    for rank in (0, 63):
        chunk = lambda rows: math.ceil(rows / 64)  # noqa: E731
        by_hand = sum(max(0, min(chunk(rows), rows - rank * chunk(rows))) * cols for rows, cols in dense)
        by_hand += expert * config.n_layers
        assert rank_share(cfg, layout, rank).parameters == by_hand, rank
    assert by_hand == pytest.approx(46.7e9 / 64, rel=0.01)
    # The planner's count of the fullest rank (rank 0: dim-0 chunks rounded up) is the dry run's.
    planned = sharded_parameters(config, Candidate("fsdp2", 64, 1, 1, 1, 1, expert_parallel=8))
    assert planned == rank_share(cfg, layout, 0).parameters


def mixtral_on_64(strategy: str, *overrides: str):
    """Mixtral 8x7B's job on 8 nodes of 8 H100s (global batch 512 in micro batches of 2): its config, model config,
    and the dry run's model lines and their record."""
    cfg = compose_job(
        "model=mixtral_8x7b", "trainer=gpu", "trainer.num_nodes=8", "trainer.devices=8", "global_batch_size=512",
        "micro_batch_size=2", f"strategy={strategy}", *overrides, "cluster=h100_80gb",
    )  # fmt: skip
    lines, record = model_lines(cfg, preflight(cfg, dry_run=True), strategy)
    return cfg, model_config(cfg), lines, record


def test_a_mixtures_dry_run_says_its_parameters_and_its_all_to_all_bytes_a_step():
    """Mixtral 8x7B with ep=8 on 64 fake ranks: 46.7B parameters, 12.9B active (Mistral's figures), and the tokens
    each rank sends to its experts' ranks a step, counted here by hand: per mixture block and microbatch, each of the
    rank's tokens goes to top_k experts and comes back, in the forward and again as gradients in the backward (4
    copies of dim values), besides each rank's int64 count per expert."""
    cfg, config, lines, record = mixtral_on_64("fsdp2", "strategy.expert_parallel_size=8")
    assert lines[0].startswith("model: 46.7B parameters, 12.9B active")
    microbatches = 512 // (2 * 64)
    tokens = int(cfg.data.seq_len) * 2
    per_block = 4 * tokens * config.top_k * config.dim * {"bf16-mixed": 2, "32-true": 4}[cfg.trainer.precision]
    per_block += config.n_experts * 8
    assert record["all_to_all_bytes_per_step"] == per_block * config.n_layers * microbatches
    assert record["expert_parallel"] == 8 and record["all_to_all_seconds_per_step"] > 0
    assert "each mixture's 8 split over the 8 ranks of an expert group (1 each)" in lines[1]
    dense, _ = model_lines(compose_job("model=llama3_8b"), preflight(compose_job("model=llama3_8b")), "single")
    assert dense == ["model: 8.03B parameters"]


def test_a_mixtures_dry_run_under_tensor_parallelism_says_each_ranks_share_of_every_expert_and_its_all_reduces():
    """Mixtral 8x7B under tp_fsdp with tp=4 on 64 fake ranks: each rank holds a quarter of every expert's 14,336
    hidden units, and the routed results' all-reduces over the group a step, counted here by hand: per mixture block
    and microbatch, the top_k copies of each of the sequence's tokens, in the forward and as gradients in the
    backward."""
    cfg, config, lines, record = mixtral_on_64("tp_fsdp", "strategy.tensor_parallel_size=4")
    microbatches = 512 // (2 * 16)
    copies = int(cfg.data.seq_len) * 2 * config.top_k
    per_block = 2 * copies * config.dim * {"bf16-mixed": 2, "32-true": 4}[cfg.trainer.precision]
    split = record["tensor_parallel_experts"]
    assert split["all_reduce_bytes_per_step"] == per_block * config.n_layers * microbatches
    assert split["hidden_units_per_rank"] == 14336 // 4
    assert "each expert's 14336 hidden units split over the 4 tensor-parallel ranks (3584 each" in lines[1], lines


@pytest.mark.parametrize("devices", [3, 5])
def test_experts_whose_widths_the_ranks_do_not_divide_are_sharded_along_another_dimension(devices):
    """moe_debug's experts are 96 wide and 64 deep: 3 ranks split w1 and w3 along 96 and w2 along its 96 inputs
    (FSDP2 splits only dim 0 unevenly), 5 ranks divide neither and split the 4 experts (dim 0, padded): every rank's
    shard is made, and together they hold the model once."""
    cfg = compose_job(
        "experiment=debug",
        "model=moe_debug",
        "strategy=fsdp2",
        f"trainer.devices={devices}",
        f"global_batch_size={devices}",
    )
    layout = preflight(cfg, dry_run=True)
    total = sum(p.numel() for p in build_meta_model(cfg).parameters())
    shares = [rank_share(cfg, layout, rank).parameters for rank in range(devices)]
    assert sum(shares) == total
    # The planner's count of the fullest rank, padded where FSDP2 pads, is the dry run's.
    assert sharded_parameters(model_config(cfg), Candidate("fsdp2", devices, 1, 1, 1, 1)) == max(shares)


def test_a_float8_job_dry_runs_into_the_shares_of_the_same_job_in_bf16():
    """strategy.float8 under tp_fsdp: torchao's float8 layers, its float8 styles and FSDP2's float8 gathers (the
    weights wrapped in torchao's tensor) shard on the fake process group into the parameters, of the same bytes, that
    bf16's hold (the conversion itself: tests/test_float8.py)."""
    job = ["model=llama3_8b", "trainer=gpu", "trainer.num_nodes=8", "trainer.devices=8", "global_batch_size=1024"]
    cfg = compose_job(*job, *JOBS["tp_fsdp"], "strategy.float8=tensorwise", "strategy.compile=true")
    layout = preflight(cfg, dry_run=True)
    for rank in (0, 63):
        share = rank_share(cfg, layout, rank)
        assert share.parameters == hand_share(model_config(cfg), layout.shape, rank), rank
        assert share.param_bytes == share.grad_bytes == 4 * share.parameters


def test_a_float8_job_is_refused_on_a_cluster_whose_gpus_have_no_float8_products():
    """An A100 or V100 cluster preset has no float8 peak: its float8 job is refused before the dry run shards it,
    and the same job on H100s passes. A real run ignores cluster= (its node's GPU is checked once seen)."""
    job = ["model=llama3_8b", "trainer=gpu", "trainer.num_nodes=8", "trainer.devices=8", "global_batch_size=1024"]
    for cluster in ("a100_80gb", "v100_32gb"):
        cfg = compose_job(*job, *JOBS["fsdp2"], "strategy.float8=tensorwise", f"cluster={cluster}")
        with pytest.raises(ConfigError, match=rf"cluster={cluster}.*no float8 matrix products.*strategy.float8=null"):
            preflight(cfg, dry_run=True)
        check_float8(cfg)  # a real run's: its node's GPU is checked once the Trainer sees it
    cfg = compose_job(*job, *JOBS["fsdp2"], "strategy.float8=tensorwise", "cluster=h100_80gb")
    assert preflight(cfg, dry_run=True).shape.data_parallel == 64
    cfg = compose_job(*job, *JOBS["fsdp2"], "cluster=a100_80gb")  # bf16 on A100s goes on
    assert preflight(cfg, dry_run=True).shape.data_parallel == 64


def test_a_float8_dry_run_says_what_float8_converts_and_the_bytes_its_gathers_save():
    """The dry run's float8 line: every block projection of llama3_8b under tp=8 is in float8, and FSDP2's float8
    gathers of one micro batch a step (gathered for the forward and again for the backward) carry one byte less per
    element of those matrices than bf16's, counted here by hand."""
    job = ["model=llama3_8b", "trainer=gpu", "trainer.num_nodes=8", "trainer.devices=8", "global_batch_size=1024"]
    cfg = compose_job(*job, *JOBS["tp_fsdp"], "strategy.float8=tensorwise", "micro_batch_size=128")
    layout = preflight(cfg, dry_run=True)
    lines, record = model_lines(cfg, layout, "tp_fsdp")
    config = model_config(cfg)
    heads, kv, ffn = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.ffn_hidden_dim
    assert record["float8"]["float8_matrices"] == record["float8"]["block_matrices"] == 7 * config.n_layers
    assert record["float8"]["kept"] == []
    per_block = 2 * config.dim * heads + 2 * config.dim * kv + 3 * config.dim * ffn
    saved = 2 * config.n_layers * per_block // 8  # two gathers a step of this tensor-parallel rank's matrices
    float8 = record["float8"]
    assert float8["all_gather_bytes_without_float8"] - float8["all_gather_bytes_per_step"] == saved
    said = next(line for line in lines if line.startswith("float8:"))
    assert "224 of the blocks' 224 weight matrices" in said and "FSDP2 gathers them as float8" in said, said
    small = ["model=debug", "model.n_heads=8", "trainer=gpu", "trainer.devices=4", "global_batch_size=8"]
    narrow = compose_job(*small, "strategy=tp_fsdp", "strategy.tensor_parallel_size=2", "strategy.float8=rowwise")
    lines, record = model_lines(narrow, preflight(narrow, dry_run=True), "tp_fsdp")
    # two key-value heads of 8: 8 wide on each of 2 ranks, which float8 kernels cannot take
    assert record["float8"]["kept"] == ["attention.wk", "attention.wv"]
    assert record["float8"]["float8_matrices"] == 5 * model_config(narrow).n_layers
    assert "all_gather_bytes_per_step" not in record["float8"]  # rowwise gathers in the parameters' dtype


def test_a_context_parallel_job_places_each_rank_on_the_4d_mesh_and_shards_over_data_x_context():
    """16 GPUs as 2 stages x 2 replicas x 2 context x 2 tensor: each rank's coordinates on the 4-D mesh (tensor
    innermost, then context, data, pipeline), its states those of a data-parallel degree of 4 (FSDP2 over data x
    context), by hand."""
    cfg = compose_job(
        "model=llama3_8b",
        "trainer=gpu",
        "trainer.num_nodes=2",
        "trainer.devices=8",
        "global_batch_size=64",
        "micro_batch_size=1",
        "data.seq_len=8192",
        "strategy=pipeline",
        "strategy.data_parallel_size=2",
        "strategy.tensor_parallel_size=2",
        "strategy.context_parallel_size=2",
    )
    layout = preflight(cfg, dry_run=True)
    assert layout.shape == MeshShape(2, 2, 2, 2)
    for rank, where in ((0, (0, 0, 0, 0)), (5, (0, 1, 0, 1)), (6, (0, 1, 1, 0)), (11, (1, 0, 1, 1))):
        share = rank_share(cfg, layout, rank)
        assert (share.pipeline, share.data_parallel, share.context_parallel, share.tensor_parallel) == where, rank
        assert share.parameters == hand_share(model_config(cfg), MeshShape(2, 4, 2), rank), rank


def test_representative_ranks_are_the_first_and_last_stage_and_the_last_tensor_and_data_parallel_ranks():

    shape = MeshShape(4, 2, 8)  # 64 ranks, tensor parallelism innermost
    assert representative_ranks(shape, last_stage=3) == [0, 7, 8, 48, 63]
    where = [tuple(shape.coordinate(r, d) for d in ("pipeline", "data", "tensor")) for r in (7, 8, 48)]
    assert where == [(0, 0, 7), (0, 1, 0), (3, 0, 0)]


INVALID = {  # what a real start refuses, before any process starts
    "tensor-parallel-over-kv-heads": [
        "model=llama3_8b",
        "strategy=tp",
        "strategy.tensor_parallel_size=16",
        "trainer.devices=16",
    ],
    "more-stages-than-layers": ["strategy=pipeline", "trainer.devices=4", "model.tie_embeddings=false"],
    "degrees-not-the-world": [
        "strategy=pipeline",
        "strategy.pipeline_parallel_size=3",
        "trainer.devices=4",
        "model.tie_embeddings=false",
    ],
}


@pytest.mark.parametrize("case", INVALID)
def test_an_invalid_layout_is_the_same_one_paragraph_error_as_a_real_start(tiny_shards, tmp_path, case):
    args = train_overrides(tiny_shards, tmp_path / "run", *INVALID[case], "model.n_layers=2")
    dry = run_module("project.train", [*args, "dry_run=true"])
    real = run_module("project.train", args)
    assert dry.returncode == real.returncode == 2, dry.stderr[-2000:]
    assert (
        dry.stderr.strip() == real.stderr.strip() and dry.stderr.startswith("error: ") and "Traceback" not in dry.stderr
    )
    assert not (tmp_path / "run").exists()


def test_an_offloaded_jobs_dry_run_holds_no_states_against_the_gpus_memory(tmp_path):
    """strategy.cpu_offload keeps the states in host memory: a dry run against a cluster says so, and no verdict."""
    job = ["model=llama3_8b", "strategy=fsdp", "strategy.cpu_offload=true", "trainer=gpu", "trainer.num_nodes=2",
           "trainer.devices=8", "global_batch_size=16", "micro_batch_size=1", "cluster=h100_80gb",
           f"hydra.run.dir={tmp_path}", "dry_run=true"]  # fmt: skip
    result = run_module("project.train", job)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the model states live in host memory (strategy.cpu_offload)" in result.stdout
    assert "fit" not in result.stdout.split("initialization:")[1]  # neither "fits" nor "does not fit"


def test_a_64_gpu_dry_run_prints_and_writes_each_ranks_share_against_the_cluster_and_nothing_else(tmp_path):
    run_dir = tmp_path / "run"
    job = [
        "model=llama3_8b",
        "strategy=tp_fsdp",
        "strategy.tensor_parallel_size=8",
        "trainer=gpu",
        "trainer.num_nodes=8",
        "trainer.devices=8",
        "global_batch_size=512",
        "micro_batch_size=1",
        "cluster=h100_80gb",
        f"hydra.run.dir={run_dir}",
    ]
    result = run_module("project.train", [*job, "dry_run=true"])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((run_dir / "dry_run.json").read_text())
    assert report["world_size"] == 64 and report["mesh"] == {
        "pipeline": 1,
        "data_parallel": 8,
        "context_parallel": 1,
        "tensor_parallel": 8,
        "expert_parallel": 1,
        "data_parallel_shard": 8,
    }
    # Tensor parallelism inside each node of 8; the 8 replicas' FSDP2 groups one rank of each node.
    assert report["groups"] == [
        {"name": "tensor", "ranks": 8, "nodes": 1},
        {"name": "data", "ranks": 8, "nodes": 8},
    ]
    assert "groups: tensor 8 (in 1 node), data 8 (across 8 nodes)" in result.stdout
    assert [r["rank"] for r in report["ranks"]] == [0, 7, 56, 63]
    config = model_config(compose_job(*job[:1]))

    assert all(r["parameters"] == hand_share(config, MeshShape(1, 8, 8), r["rank"]) for r in report["ranks"])
    # Against the cluster: the dry run's model states plus the planner's activations, working copies and allowance.
    cfg = compose_job(*job)
    layout = preflight(cfg, dry_run=True)
    candidate = Candidate("tp_fsdp", 8, 8, 1, 1, 64, recompute="selective")
    planned = estimate_memory(model_config(cfg), candidate, 256, "bf16-mixed", "cpu", Allowance(), 0)
    assert report["ranks"][0]["planned"]["total_bytes"] == pytest.approx(planned.total, rel=0.01)
    assert report["device_memory_bytes"] == 79.6 * 2**30 and "against h100_80gb's 79.6 GiB per device" in result.stdout
    assert f"rank 63: model states {report['ranks'][-1]['state_bytes'] / 2**30:.1f} + activations" in result.stdout
    assert layout.shape == MeshShape(1, 8, 8)
    # Initialization: each rank draws its own share (8B over 64 ranks), at the measured rate of one core.
    from project.planning.dry_run import INIT_VALUES_PER_SECOND

    assert all(r["init_seconds"] == round(r["parameters"] / INIT_VALUES_PER_SECOND, 1) for r in report["ranks"])
    slowest = max(report["ranks"], key=lambda r: r["parameters"])
    seconds = slowest["parameters"] / INIT_VALUES_PER_SECOND
    assert f"rank {slowest['rank']}'s {slowest['parameters'] / 1e9:.2f}B take about {seconds:.0f} s" in result.stdout
    assert [p.name for p in run_dir.iterdir()] == ["dry_run.json"]  # no checkpoint, metrics, config or Hydra record

    everyone = run_module(
        "project.train",
        [*job[:-1], "trainer.num_nodes=1", f"hydra.run.dir={tmp_path / 'all'}", "dry_run=true", "dry_run.ranks=all"],
    )
    assert everyone.returncode == 0, everyone.stderr[-3000:]
    assert [r["rank"] for r in json.loads((tmp_path / "all" / "dry_run.json").read_text())["ranks"]] == list(range(8))


# Real runs of 4 ranks that tests/test_sharded_parity.py and tests/test_pipeline.py train anyway (shared).
MEASURED = {
    "tp2-fsdp2-2d": [*PARITY_RUN, *SHARDED["tp2-fsdp2-2d"]],
    "pp2-dp2-fsdp2": [*PIPELINE_RUN, *PIPELINES["pp2-dp2-fsdp2"]],
}
TRAINED_TOGETHER = list(MEASURED.values())  # trained together before the first test (tests/conftest.py: trained)


@pytest.mark.slow
@pytest.mark.parametrize("layout", MEASURED)
def test_a_dry_run_reports_exactly_the_bytes_memory_monitor_records_in_the_real_run(
    trained, tiny_shards, tmp_path, layout
):
    run_dir = trained(*MEASURED[layout])
    cfg = compose_job(*train_overrides(tiny_shards, tmp_path, *MEASURED[layout]))
    layout_ = preflight(cfg, dry_run=True)
    for rank in range(layout_.shape.world_size):
        recorded = json.loads((run_dir / "memory" / f"rank{rank}.json").read_text())
        share = rank_share(cfg, layout_, rank)
        assert (share.param_bytes, share.grad_bytes, share.optimizer_bytes) == (
            recorded["param_bytes"],
            recorded["grad_bytes"],
            recorded["optimizer_bytes"],
        ), rank


PLANNED = {  # eight layouts of 64 H100s (tensor parallelism alone: of one node), each as the planner's candidate
    "ddp": Candidate("ddp", 64, 1, 1, 1, 1),
    "fsdp2": Candidate("fsdp2", 64, 1, 1, 1, 1),
    "tp": Candidate("tp", 1, 8, 1, 1, 1),
    "tp_fsdp": Candidate("tp_fsdp", 8, 8, 1, 1, 1, sequence_parallel=True),
    "pipeline": Candidate("pipeline", 1, 8, 8, 1, 8, schedule="1f1b"),
    "pipeline-3d": Candidate("pipeline", 2, 8, 4, 1, 16, schedule="interleaved_1f1b", virtual_stages=2),
    # HSDP: sharded within a node (8 ranks; 4 data-parallel ranks beside 2-way tensor parallelism), replicated across.
    "fsdp2-hsdp": Candidate("fsdp2", 64, 1, 1, 1, 1, data_shard=8),
    "tp_fsdp-hsdp": Candidate("tp_fsdp", 32, 2, 1, 1, 2, sequence_parallel=True, data_shard=4),
}


@pytest.mark.parametrize("model", ["llama3_8b", "llama3_70b"])
@pytest.mark.parametrize("name", PLANNED)
def test_the_planners_model_states_per_rank_agree_with_the_dry_run_within_two_percent(model, name):
    candidate = PLANNED[name]
    nodes = candidate.shape.world_size // 8
    h100 = Cluster.from_config(
        {**yaml.safe_load((ROOT / "conf" / "cluster" / "h100_80gb.yaml").read_text()), "nodes": nodes}
    )
    cfg = compose_job(
        *planned_overrides(candidate, Workload(None, 8192, 64, 1e12, "bf16-mixed"), h100, model_arguments(model, {}))
    )
    layout = plan_layout(cfg, nodes, 8)
    assert layout.shape == candidate.shape
    config = model_config(cfg)
    for pipeline_rank in {0, candidate.pipeline_parallel - 1}:
        predicted = estimate_memory(config, candidate, 8192, "bf16-mixed", "gpu", Allowance(), pipeline_rank)
        share = rank_share(cfg, layout, pipeline_rank * candidate.data_parallel * candidate.tensor_parallel)
        assert share.param_bytes == pytest.approx(predicted.params, rel=0.02), pipeline_rank
        assert share.grad_bytes == pytest.approx(predicted.grads, rel=0.02), pipeline_rank
        assert share.optimizer_bytes == pytest.approx(predicted.optimizer, rel=0.02), pipeline_rank


def test_a_dry_run_checks_the_shards_of_its_settings_and_says_which_it_did_not_check(tiny_shards, tmp_path, capsys):
    from project.planning.dry_run import dry_run, unchecked_shards
    from project.runtime.errors import ConfigError

    # Shards of the job's settings are checked as a real start checks them (here: a vocabulary too small for them).
    too_small = compose_job(*train_overrides(tiny_shards, tmp_path, "model.vocab_size=100"))
    with pytest.raises(ConfigError, match="model.vocab_size=100 is smaller") as real:
        preflight(too_small)
    with pytest.raises(ConfigError) as dry:
        preflight(too_small, dry_run=True)
    assert str(dry.value) == str(real.value)
    # Shards of other settings (`make train`'s, for a job of longer sequences) are not the job's: a real start here
    # refuses them, a dry run of the job says so in its report and goes on.
    longer = compose_job(*train_overrides(tiny_shards, tmp_path / "run", "data.seq_len=64", "trainer.devices=1"))
    with pytest.raises(ConfigError, match="data.seq_len: 32 there, 64 here"):
        preflight(longer)
    dry_run(longer, preflight(longer, dry_run=True), "single", tmp_path / "run")
    said = capsys.readouterr().out
    assert (
        f"Every check of a real start passed, but the shards': data.dir={tiny_shards} here holds shards prepared from "
        "other data settings (data.seq_len: 32 there, 64 here), not the job's" in said
    )
    elsewhere = compose_job(
        *train_overrides(
            tmp_path / "on-the-cluster", tmp_path, "data.auto_prepare=false", "trainer.devices=2", "strategy=ddp"
        )
    )
    with pytest.raises(ConfigError, match="on-the-cluster"):
        preflight(elsewhere)  # a real start here has no shards
    assert preflight(elsewhere, dry_run=True).shape == MeshShape(1, 2, 1)
    assert unchecked_shards(elsewhere) == f"data.dir={tmp_path / 'on-the-cluster'} is not on this machine"
    assert unchecked_shards(compose_job(*train_overrides(tiny_shards, tmp_path))) is None


def test_every_file_check_of_a_real_start_refuses_the_dry_run_too(single_reference, tiny_shards, tmp_path):
    from project.planning.dry_run import dry_run
    from project.runtime.errors import ConfigError

    not_a_checkpoint = tmp_path / "cut.ckpt"
    not_a_checkpoint.write_bytes(b"PK\x03\x04 cut short")
    before_preflight = {  # refused by the settings check, which a real start and a dry run share
        "ckpt_path=last": (["ckpt_path=last"], "ckpt_path=last: no checkpoint at .*last.ckpt"),
        "missing checkpoint": ([f"ckpt_path={tmp_path / 'none.ckpt'}"], "no checkpoint at"),
        "not a checkpoint": ([f"ckpt_path={not_a_checkpoint}"], "is not a checkpoint this platform can read"),
    }
    for case, (overrides, message) in before_preflight.items():
        cfg = compose_job(*train_overrides(tiny_shards, tmp_path / "run", *overrides))
        for dry in (False, True):
            with pytest.raises(ConfigError, match=message):
                preflight(cfg, dry_run=dry, run_dir=tmp_path / "run")
    # What a real start checks after its imports, a dry run checks too: Trainer arguments, the checkpoint's model.
    checkpoint = single_reference / "checkpoints" / "last.ckpt"
    after_imports = {
        "unknown trainer argument": (
            ["+trainer.max_stepz=3"],
            "trainer.max_stepz is not an argument of lightning.Trainer",
        ),
        "another model's checkpoint": ([f"ckpt_path={checkpoint}", "model.dim=32"], "holds a model of another shape"),
        "a callback's argument": (
            ["callbacks=early_stopping", "callbacks.early_stopping.patience=abc"],
            "callbacks.early_stopping.patience=abc is not a whole number",
        ),
    }
    for case, (overrides, message) in after_imports.items():
        cfg = compose_job(*train_overrides(tiny_shards, tmp_path / "run", *overrides, "trainer.devices=1"))
        layout = preflight(cfg, dry_run=True)
        with pytest.raises(ConfigError, match=message):
            dry_run(cfg, layout, "single", tmp_path / "run")
    assert not (tmp_path / "run").exists()

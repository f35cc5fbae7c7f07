"""`python -m benchmarks.model_step`, `benchmarks.train_step` and `benchmarks.pipeline` write
new result files and never edit one already there."""

import json
import statistics
from pathlib import Path

import pytest
from conftest import run_module

TINY = ["presets=debug", "steps=2", "batch=2", "seq_len=16", "error_latency=false"]


def run_bench(out: Path, *extra: str):
    result = run_module("benchmarks.model_step", [*TINY, f"out={out}", *extra], timeout=120)
    assert result.returncode == 0, f"bench failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_bench_writes_new_files_and_never_overwrites(tmp_path):
    run_bench(tmp_path)
    first = sorted(tmp_path.iterdir())
    assert [p.suffix for p in first] == [".json", ".md"]
    report = json.loads(first[0].read_text())
    assert report["command"].endswith(" ".join([*TINY, f"out={tmp_path}"]))
    assert report["machine"]["cpu_count"] >= 1 and report["threads"] >= 1 and report["torch"]
    [preset] = report["presets"]
    assert (preset["model"], preset["batch"], preset["seq_len"], preset["steps"], preset["vocab_size"]) == (
        "debug",
        2,
        16,
        2,
        512,
    )
    assert preset["tokens_per_sec"] > 0 and preset["model_tflops"] > 0
    assert "config_error_latency" not in report
    assert "| debug |" in first[1].read_text()
    before = {p: p.read_bytes() for p in first}

    run_bench(tmp_path)
    second = sorted(set(tmp_path.iterdir()) - set(first))
    assert [p.name for p in second] == [first[0].stem + "-2.json", first[0].stem + "-2.md"]
    assert {p: p.read_bytes() for p in first} == before
    assert json.loads(second[0].read_text())["presets"][0]["tokens_per_sec"] > 0


def test_unknown_preset_is_a_config_error(tmp_path):
    result = run_module("benchmarks.model_step", ["presets=debug,no_such_model", f"out={tmp_path}"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "no_such_model" in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_pipeline_bench_writes_its_rows_table_and_plot_where_out_says(tmp_path):
    argv = [
        "pp=2",
        "schedules=1f1b",
        "microbatches=2",
        "dim=64",
        "layers=2",
        "seq_len=16",
        "steps=1",
        f"out={tmp_path}",
    ]
    result = run_module("benchmarks.pipeline", argv, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    files = sorted(tmp_path.iterdir())
    assert [p.suffix for p in files] == [".jsonl", ".md", ".svg"] and files[0].stem.endswith("-pipeline-bubble-pp2")
    [row] = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert (row["schedule"], row["microbatches"], row["pp"]) == ("1f1b", 2, 2) and row["pipeline_seconds"] > 0
    assert "python -m benchmarks.pipeline " + " ".join(argv) in files[1].read_text()


def skip_without_litgpt():
    from benchmarks.litgpt_loop import available, reference_path

    if not available():
        pytest.skip(f"litgpt is not installed in {reference_path()}: `make test` installs it there")


@pytest.mark.slow
def test_platform_bench_times_project_train_beside_a_hand_loop_and_writes_both_commands(tmp_path):
    skip_without_litgpt()
    # Eager only: compiling adds a minute and its plumbing is proved below without running it.
    argv = [
        "presets=debug",
        "compiled=",
        "scaling=ddp",
        "scaling_preset=debug",
        "litgpt=true",
        "steps=2",
        "warmup=1",
        "repeats=1",
        "threads=1",
    ]
    result = run_module("benchmarks.train_step", [*argv, f"out={tmp_path}"], timeout=900)
    assert result.returncode == 0, f"bench failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    [report_file] = tmp_path.glob("*-platform.json")
    report, table = json.loads(report_file.read_text()), report_file.with_suffix(".md").read_text()
    [row] = report["rows"]
    assert (row["preset"], row["mode"], row["steps"], row["warmup"], row["threads"]) == ("debug", "eager", 2, 1, 1)
    assert len(row["runs"]["project_train"]) == len(row["runs"]["hand_loop"]) == 1
    assert row["project_train_tokens_per_sec"] == pytest.approx(
        statistics.median(row["runs"]["project_train"]), rel=1e-3
    )
    assert row["ratio"] == pytest.approx(
        row["project_train_tokens_per_sec"] / row["hand_loop_tokens_per_sec"], rel=1e-2
    )
    peak = report["matmul_peak"]["flops_per_sec"]  # the best of one measurement per alternation
    assert len(report["matmul_peak"]["runs"]) == 1 and peak == pytest.approx(
        max(report["matmul_peak"]["runs"]), rel=1e-6
    )
    assert row["project_train_mfu"] == pytest.approx(
        row["project_train_tokens_per_sec"] * row["flops_per_token"] / peak, rel=1e-2
    )
    assert 0 < row["hand_loop_mfu"] < 1.5  # against a measured peak; a wrong unit would be off by 1e3 or more
    assert "project.train" in row["commands"]["project_train"] and "--hand-loop debug" in row["commands"]["hand_loop"]
    assert row["commands"]["litgpt"].endswith(f"{row['mode']} litgpt") and len(row["runs"]["litgpt"]) == 1
    assert row["ratio_to_litgpt"] == pytest.approx(
        row["project_train_tokens_per_sec"] / row["litgpt_tokens_per_sec"], rel=1e-2
    )
    assert "strategy.compile" not in row["commands"]["project_train"] and row["commands"]["hand_loop"].endswith(
        "eager ours"
    )
    assert "| debug | eager | 8 x 256 | 2 |" in table
    [scaled] = report["scaling"]  # 2 processes x 1 thread against 1 x 2 threads
    assert scaled["strategy"] == "ddp" and "trainer.devices=2" in scaled["commands"]["two_processes"]
    assert "trainer.devices" not in scaled["commands"]["one_process"]
    assert scaled["ratio"] == pytest.approx(
        scaled["two_processes_tokens_per_sec"] / scaled["one_process_tokens_per_sec"], rel=1e-2
    )
    start = report["startup"]  # the debug experiment's first step, split at `import lightning`
    assert (
        len(start["runs"]["seconds_to_first_step"]) == 1
        and start["seconds_to_first_step"] > start["import_lightning_seconds"] > 0
    )
    assert start["rest_seconds"] == pytest.approx(
        start["seconds_to_first_step"] - start["import_lightning_seconds"], abs=0.011
    )
    assert start["peak_rss_mib"] > 100 and "import lightning" in table
    svg = report_file.with_suffix(".svg").read_text()  # a bar per ratio: hand loop and litgpt per row, then scaling
    assert svg.count('class="bar"') == 3 and "debug eager: project.train / litgpt" in svg


def test_platform_bench_alternates_the_sides_and_compiles_all_three_for_compiled_presets(monkeypatch, tmp_path):
    """compare() without running anything: A B C, C B A and the matmul rate per alternation; compiled rows pass
    strategy.compile=true to project.train and "compiled" to both loops; medians per side."""
    from benchmarks import train_step as bench_platform

    calls, rates = [], iter(range(100, 10_000, 100))

    def platform_run(preset, batch, steps, warmup, data, run_dir, env, *extra, micro_batch=None):
        calls.append(("A", preset, *extra))
        return {
            "tokens_per_sec": float(next(rates)),
            "command": " ".join(["-m project.train", f"model={preset}", *extra]),
        }

    def in_own_process(argv, env):
        calls.append(
            ("peak",) if argv == ["--matmul-peak"] else ("B" if argv[-1] == "ours" else "C", *argv[1:2], argv[-2])
        )
        return {"tokens_per_sec": float(next(rates)), "flops_per_sec": 1e9, "command": " ".join(argv)}

    monkeypatch.setattr(bench_platform, "platform_run", platform_run)
    monkeypatch.setattr(bench_platform, "in_own_process", in_own_process)
    args = {
        "presets": ["debug"],
        "compiled": ["debug"],
        "litgpt": True,
        "repeats": 2,
        "steps": 2,
        "warmup": 1,
        "threads": 1,
    }
    peaks = []
    eager, compiled = bench_platform.compare(args, tmp_path, tmp_path, peaks)
    # A B C, then C B A: drift during the runs favours no side.

    def sides(mode, extra):
        return [("A", "debug", *extra), ("B", "debug", mode), ("C", "debug", mode)]

    def two_alternations(mode, extra):
        return [*sides(mode, extra), ("peak",), *reversed(sides(mode, extra)), ("peak",)]

    assert calls == two_alternations("eager", []) + two_alternations("compiled", ["strategy.compile=true"])
    assert len(peaks) == 4
    assert eager["runs"] == {"project_train": [100.0, 700.0], "hand_loop": [200.0, 600.0], "litgpt": [300.0, 500.0]}
    assert (eager["project_train_tokens_per_sec"], eager["hand_loop_tokens_per_sec"], eager["ratio"]) == (
        400.0,
        400.0,
        1.0,
    )
    assert compiled["mode"] == "compiled" and "strategy.compile=true" in compiled["commands"]["project_train"]
    assert compiled["commands"]["hand_loop"].endswith("compiled ours") and compiled["commands"]["litgpt"].endswith(
        "compiled litgpt"
    )


def test_compile_effect_alternates_compiled_and_eager_runs_of_each_strategy_with_its_processes_and_settings(
    monkeypatch, tmp_path
):
    """compile_effect() without running anything: per strategy, compiled then eager, eager then compiled, ...; the
    strategy's launcher, settings, micro batch and threads on both sides, strategy.compile=true on one; medians."""
    from benchmarks import train_step as bench_platform

    calls = []
    # Per run, in call order: compiled runs fast, eager slow, one outlier each that a median sets aside.
    rates = iter([300.0, 200.0, 210.0, 900.0, 330.0, 10.0] + [150.0, 100.0, 110.0, 160.0, 155.0, 105.0] * 2)

    def platform_run(preset, batch, steps, warmup, data, run_dir, env, *extra, micro_batch=None, launcher=()):
        calls.append((run_dir.name, env["OMP_NUM_THREADS"], micro_batch, tuple(launcher), *extra))
        return {"tokens_per_sec": next(rates), "command": " ".join(["-m project.train", *extra])}

    monkeypatch.setattr(bench_platform, "platform_run", platform_run)
    args = {
        "compile_effect": ["single", "ddp", "pipeline"],
        "scaling_preset": "debug",
        "repeats": 3,
        "steps": None,
        "warmup": 1,
        "threads": 2,
    }
    single, ddp, pipeline = bench_platform.compile_effect(args, tmp_path, tmp_path)
    untied, compiled = "model.tie_embeddings=false", "strategy.compile=true"

    def one(mode, i, *extra):
        return (f"compile-single-{mode}-{i}", "2", None, (), untied, *extra)

    assert calls[:6] == [
        one("compiled", 0, compiled),
        one("eager", 0),
        one("eager", 1),
        one("compiled", 1, compiled),
        one("compiled", 2, compiled),
        one("eager", 2),
    ]
    two = ("threads_per_process=1", "strategy=ddp", "trainer.devices=2")
    assert calls[6:8] == [
        ("compile-ddp-compiled-0", "1", "null", (), untied, *two, compiled),
        ("compile-ddp-eager-0", "1", "null", (), untied, *two),
    ]
    staged = ("threads_per_process=1", "strategy=pipeline", "trainer.devices=2")
    assert calls[12] == ("compile-pipeline-compiled-0", "1", "2", (), untied, *staged, compiled)
    assert single["runs"] == {"compiled": [300.0, 900.0, 330.0], "eager": [200.0, 210.0, 10.0]}
    assert (single["compiled_tokens_per_sec"], single["eager_tokens_per_sec"], single["ratio"]) == (330.0, 200.0, 1.65)
    assert (ddp["compiled_tokens_per_sec"], ddp["eager_tokens_per_sec"], ddp["ratio"]) == (155.0, 105.0, 1.476)
    assert (
        pipeline["processes"],
        pipeline["threads_per_process"],
        single["processes"],
        single["threads_per_process"],
    ) == (2, 1, 1, 2)
    report = {
        "date": "d",
        "hostname": "h",
        "platform": "p",
        "torch": "t",
        "threads": 2,
        "repeats": 3,
        "command": "c",
        "matmul_peak": None,
        "rows": [],
        "compile_effect": [single, ddp, pipeline],
    }
    written = bench_platform.table(report)  # compile_effect alone: no comparison rows, no MFU line
    assert "| single | 1 x 2 | debug | 8 x 256 | 330 | 200 | 1.650 |" in written and "MFU" not in written
    assert bench_platform.plot(report).count('class="bar"') == 3


def test_the_platform_bench_times_only_the_strategies_when_presets_is_empty_and_refuses_nothing_to_time():
    from benchmarks import train_step as bench_platform
    from project.runtime.errors import ConfigError

    args = bench_platform.parse(["presets=", "scaling=", "compile_effect=ddp,pipeline"])
    assert (args["presets"], args["compiled"], args["scaling"], args["compile_effect"]) == (
        [],
        [],
        [],
        ["ddp", "pipeline"],
    )
    assert bench_platform.parse(["presets=", "compiled=debug"])["compiled"] == ["debug"]  # named, it still runs
    with pytest.raises(ConfigError, match="presets: empty, and so are scaling and compile_effect"):
        bench_platform.parse(["presets=", "scaling=", "compile_effect="])


@pytest.mark.parametrize(
    "setting, named",
    [
        ("presets=no_such_model", "presets: no model preset 'no_such_model'"),
        ("compiled=debug,no_such_model", "compiled: no model preset 'no_such_model'"),
        ("scaling=ddp,deepspeed", "scaling: 'deepspeed' is not one of ['ddp', 'fsdp2', 'tp', 'horovod']"),
        (
            "compile_effect=ddp,megatron",
            "compile_effect: 'megatron' is not one of ['single', 'ddp', 'fsdp2', 'tp', 'horovod', 'pipeline']",
        ),
    ],
)
def test_platform_bench_refuses_an_unknown_preset_or_strategy_before_running_anything(tmp_path, setting, named):
    result = run_module("benchmarks.train_step", [setting, f"out={tmp_path}"], timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and named in result.stderr, result.stderr
    assert not list(tmp_path.iterdir())


def test_litgpt_twin_has_each_presets_parameter_count():
    from benchmarks.litgpt_loop import litgpt_twin
    from benchmarks.runner import load_preset
    from project.model.llama import Llama

    skip_without_litgpt()
    for preset in ("debug", "small10m", "small50m"):
        config = load_preset(preset, 4096)
        ours, twin = Llama(config), litgpt_twin(config, seq_len=256)
        assert sum(p.numel() for p in twin.parameters()) == sum(p.numel() for p in ours.parameters()), preset
        assert (
            twin.config.n_query_groups == config.n_kv_heads and twin.config.intermediate_size == config.ffn_hidden_dim
        )


def test_init_bench_times_both_materializations_per_layout_and_refuses_bad_layouts(tmp_path):
    from benchmarks.init import parse
    from project.runtime.errors import ConfigError

    for bad in ("layouts=fsdp3:2", "layouts=tp:0", "model=no_such_model"):
        with pytest.raises(ConfigError):
            parse([bad])
    result = run_module("benchmarks.init", ["model=debug", "layouts=fsdp2:1,tp:2", f"out={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = tmp_path.glob("*-init.json")
    rows = json.loads(record.read_text())["rows"]
    assert [(r["plan"], r["ranks"]) for r in rows] == [("fsdp2", 1), ("tp", 2)]
    assert all(r["before_s"] > 0 and r["after_s"] > 0 for r in rows)
    assert "| tp | 2 |" in record.with_suffix(".md").read_text()


def test_loss_bench_finds_the_chunked_loss_equal_and_its_peak_under_40_percent_of_whole_logits(tmp_path):
    """The issue's goal as a stable quantity: at 2,048 tokens and vocabulary 32,000 the whole logits take
    262 MB each (logits, log-probabilities, gradient); chunks of 256 tokens take an eighth of that."""
    from benchmarks.loss import parse
    from project.runtime.errors import ConfigError

    for bad in ("chunks=0", "vocab=x", "seq_len=0"):
        with pytest.raises(ConfigError):
            parse([bad])
    sizes = ["vocab=32000", "dim=64", "seq_len=512", "micro_batch=4", "chunks=256"]
    result = run_module("benchmarks.loss", [*sizes, f"out={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = tmp_path.glob("*-loss.json")
    whole, chunked = json.loads(record.read_text())["rows"]
    assert (whole["chunk_tokens"], chunked["chunk_tokens"]) == (None, 256)
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert whole["peak_bytes"] > 3 * 2048 * 32000 * 4 * 0.9  # the three whole [tokens, vocab] float32 tensors
    assert chunked["peak_bytes"] < 0.4 * whole["peak_bytes"]
    assert "| chunks of 256 tokens |" in record.with_suffix(".md").read_text()


def test_host_sync_bench_refuses_unknown_layouts_and_too_few_steps():
    from benchmarks.host_sync import parse
    from project.runtime.errors import ConfigError

    for bad in ("layouts=zero3", "layouts=", "steps=1", "log_every=x"):
        with pytest.raises(ConfigError):
            parse([bad])
    assert parse(["layouts=tp,single"])["layouts"] == ["tp", "single"]


def test_document_mask_bench_builds_each_mask_and_the_tile_edges_one_holds_less_than_torchs(tmp_path):
    import torch

    from benchmarks.document_mask import parse
    from project.runtime.errors import ConfigError

    bad_inputs = ["seq_lens=64", "seq_lens=", "batch=0", "document=x", "device=tpu"]
    for bad in bad_inputs + ([] if torch.cuda.is_available() else ["device=cuda"]):  # attention rows need CUDA
        with pytest.raises(ConfigError):
            parse([bad])
    result = run_module("benchmarks.document_mask", ["seq_lens=1024", f"out={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = tmp_path.glob("*-document-mask.json")
    rows = {r["method"]: r for r in json.loads(record.read_text())["rows"]}
    assert sorted(rows) == ["create_block_mask", "dense", "tile edges"]
    # torch's evaluates the rule on every pair of the 2 x 1,024 x 1,024 positions; ours, on 8 x 8 tiles
    assert rows["tile edges"]["peak_bytes"] < rows["create_block_mask"]["peak_bytes"] / 2


def test_context_parallel_bench_refuses_bad_settings_and_halves_a_ranks_activations_beside_the_planner():
    from benchmarks.context_parallel import parse, predicted
    from project.runtime.errors import ConfigError

    for bad in ("seq_lens=30", "seq_lens=", "steps=3", "steps=x", "model=nope"):
        with pytest.raises(ConfigError):
            parse([bad])
    assert parse(["seq_lens=1024,4096"])["seq_lens"] == [1024, 4096]
    # The planner's side of the table: at 8,192 tokens a rank of two keeps well under one device's activations
    # (a half, plus the gathered keys and values), for about the same step (as many tokens per rank).
    whole, split = predicted("small4m", 8192, 1), predicted("small4m", 8192, 2)
    assert split["planned_activation_bytes"] < 0.6 * whole["planned_activation_bytes"]
    assert split["planned_step_seconds"] >= whole["planned_step_seconds"]  # plus the keys' and values' exchange


def test_stability_bench_refuses_unknown_corpora_and_poisons_about_five_percent_of_the_prose(tmp_path):
    from benchmarks.stability import POISON_SHARE, parse, table, write_prose
    from project.runtime.errors import ConfigError

    for setting in ("corpora=wiki", "actions=rewind", "steps=1", "seeds=two"):
        with pytest.raises(ConfigError, match=setting.split("=")[0]):
            parse([setting])
    clean, poisoned = write_prose(tmp_path / "clean", False), write_prose(tmp_path / "poisoned", True)
    size = {folder: sum(p.stat().st_size for p in folder.iterdir()) for folder in (clean, poisoned)}
    noise = size[poisoned] - size[clean]
    assert noise == pytest.approx(POISON_SHARE * size[clean], rel=0.1)
    assert sorted(p.name for p in clean.iterdir()) == sorted(
        p.name for p in poisoned.iterdir() if "noise" not in p.name
    )
    row = {"corpus": "prose", "spikes": [], "excursions_logged": 3, "rollbacks": [], "stopped": False}
    report = {"date": "d", "host": "h", "command": "c", "steps": 3, "rows": [
        {**row, "action": "log", "val_loss": 4.1, "clean_val_loss": 4.0},
        {**row, "action": "skip", "val_loss": 4.1, "clean_val_loss": 4.02},
    ]}  # fmt: skip
    assert "| prose | skip | 4.1000 | 4.0200 | +0.50% | none | 3 | none | no |" in table(report)


def test_checkpoint_bench_charges_each_save_to_the_step_after_it_and_refuses_runs_without_one(monkeypatch, tmp_path):
    """bench_checkpoint's arithmetic: a save after step k (every `every` steps, the last step's left out) shows in
    step k + 1's time; the time lost per save is the extra time of the timed steps over the run that saves none."""
    from benchmarks import checkpoint as bench_checkpoint
    from project.runtime.errors import ConfigError

    steps, every, stall = 14, 4, {"none": 0.0, "foreground": 0.5, "background": 0.1}

    def run(size, mode, steps, every, data, scratch):
        timed = {s: 1.0 + (stall[mode] if (s - 1) % every == 0 and s - 1 < steps - 1 else 0.0) for s in range(3, steps)}
        return timed, stall[mode] / 2  # the run's own checkpoint/stall_seconds, as it measured them

    monkeypatch.setattr(bench_checkpoint, "run", run)
    row = bench_checkpoint.measure("small", steps, every, tmp_path, tmp_path)
    assert row["saves"] == 3  # after steps 4, 8 and 12; the one after 13, the last, is waited for at the end
    assert row["lost_per_save"] == pytest.approx({"foreground": 0.5, "background": 0.1})
    assert row["background_over_foreground"] == pytest.approx(0.2)
    assert row["stall_per_save"] == pytest.approx({"foreground": 0.25, "background": 0.05})
    assert row["stall_background_over_foreground"] == pytest.approx(0.2)
    for bad in (["steps=4", "every=4"], ["every=2"], ["sizes=huge"]):
        with pytest.raises(ConfigError):
            bench_checkpoint.parse(bad)

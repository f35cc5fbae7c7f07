"""`make gpu-check` (tools.gpu_check): its plumbing on the CPU, its refusals, and what it needs on a node
without a package index. The GPU itself is not here: docs/performance.md says what it checks there."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_module

from benchmarks.runner import load_preset
from project.model.flops import training_flops_per_token
from project.runtime.errors import ConfigError
from tools.gpu_check import correctness, parse
from tools.gpu_check.check import prepare, section_ends
from tools.gpu_check.report import failures
from tools.gpu_check.wheels import closure


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    """`python -m tools.gpu_check device=cpu devices=2`: two processes stand in for two GPUs."""
    out = tmp_path_factory.mktemp("gpu-check")
    result = run_module("tools.gpu_check", ["device=cpu", "devices=2", f"out={out}"], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (record,) = out.glob("*-cpu-check.json")
    return json.loads(record.read_text()), record.with_suffix(".md").read_text(), result.stdout


@pytest.mark.slow
def test_the_cpu_check_runs_every_case_through_project_train_and_each_passes(cpu_check):
    report, _, _ = cpu_check
    results = {r["name"]: r for r in report["correctness"]}
    assert list(results) == [case.name for case in correctness.cases("cpu", 2)]
    # What needs a node of 4 (HSDP, a ring of 4, 2-D) is skipped on 2 devices, saying so; everything else passes.
    wider = [case.name for case in correctness.cases("cpu", 2) if case.min_devices > 2]
    assert wider == ["hsdp 2x2", "context ring x4", "tp_fsdp 2x2"]
    assert all(results[name]["detail"] == "needs 4 or more devices" for name in wider), results
    results = {name: r for name, r in results.items() if name not in wider}
    assert all(r["status"] == "pass" for r in results.values()), results
    for r in results.values():
        assert r["command"].startswith("python -m project.train experiment=debug")
        steps = range(correctness.RESUME_AT, 20) if r["name"].startswith("resumed") else range(len(r["losses"]))
        assert sorted(map(int, r["losses"])) == list(steps)
        if r["reference"]:
            reference = results[r["reference"]]["losses"]
            diff = max(abs(loss - reference[step]) / reference[step] for step, loss in r["losses"].items())
            assert diff == pytest.approx(r["max_rel_diff"], rel=1e-9, abs=1e-12) and diff <= r["tolerance"]
    # Each layout really ran as named: its command says so, and the runs of 2 devices started 2 processes.
    assert "strategy=tp" in results["tp x2"]["command"] and "trainer.devices=2" in results["tp x2"]["command"]
    assert "ckpt_path=" in results["resumed under fsdp2 x2"]["command"]
    assert failures(report) == []


@pytest.mark.slow
def test_the_cpu_check_times_the_step_compiled_and_eager_with_mfu_against_the_measured_peak(cpu_check):
    report, page, stdout = cpu_check
    peak = report["environment"]["peak_flops"]["fp32"]
    rows = report["speed"]
    assert [r["mode"] for r in rows] == ["eager", "compiled"] and peak > 0
    profiled = rows[1]["profile"]  # the compiled step, profiled: where its time goes, by kind
    assert rows[0]["profile"] is None and sum(profiled["kinds"].values()) == pytest.approx(1, abs=1e-3)
    assert profiled["kinds"]["matrix products"] > 0 and profiled["top"][0]["share"] >= profiled["top"][-1]["share"]
    for r in rows:
        assert r["loss_finite"] and r["tokens_per_sec"] > 0
        flops = training_flops_per_token(load_preset("debug", correctness.VOCAB_SIZE), r["seq_len"])
        assert r["mfu"] == pytest.approx(flops * r["tokens_per_sec"] / peak, rel=1e-2)
        assert r["planner"]["tokens_per_sec"] > 0 and r["planner"]["memory_gib"] > 0
        implied = r["planner"]["fraction"] * r["planner"]["tokens_per_sec"] / 0.5  # predicts what was measured
        assert implied == pytest.approx(r["tokens_per_sec"], rel=1e-2)
    data = report["data_path"]
    assert data["status"] == "measured" and data["headroom"] == pytest.approx(
        data["loader_tokens_per_sec"] / data["step_tokens_per_sec"], rel=1e-2
    )
    for heading in ("## Environment", "## Correctness", "## Speed", "### Where the time goes", "## Data path"):
        assert heading in page and heading in stdout
    assert "Every check that ran passed." in page
    names = [case.name for case in correctness.cases("cpu", 2)]
    count, last = len(names), names.index("document mask, tp x2") + 1
    assert f"[correctness 1/{count}] fp32: pass" in stdout
    assert f"[correctness {last}/{count}] document mask, tp x2: pass" in stdout
    assert f"[correctness {count}/{count}] tp_fsdp 2x2: skip: needs 4 or more devices" in stdout


@pytest.mark.slow
def test_the_cpu_check_measures_the_links_bus_bandwidth_and_the_rings_kernels_beside_their_references(cpu_check):
    """Two processes' all-reduce: its bus bandwidth is NCCL's measure of the time taken (2 (n - 1) / n of the buffer
    over the seconds), beside the CPU preset's link figure and the planner's time for the call; ring attention's
    forward and backward on one device against torch's fused kernel, their outputs alike."""
    from tools.gpu_check import links

    report, page, stdout = cpu_check
    (link,) = report["links"]
    assert link["status"] == "measured" and link["devices"] == 2 and link["preset"] == "cpu"
    assert link["bus_gbps"] == pytest.approx(link["megabytes"] * 2**20 / link["seconds"] / 1e9, rel=1e-2)
    cluster = links.cluster_for("cpu", "cpu")
    assert link["planner_gbps"] == cluster.intra_node_gbps
    bytes_over_link = link["megabytes"] * 2**20 / (cluster.intra_node_gbps * 1e9)  # ring: 2 (n - 1) / n = 1
    assert link["planner_seconds"] == pytest.approx(bytes_over_link + cluster.collective_latency_us * 1e-6)
    (ring,) = report["attention"]
    assert ring["status"] == "measured" and ring["length"] == 256 and ring["max_abs_diff"] < 1e-5
    assert ring["ring_over_fused"] == pytest.approx(ring["ring_ms"] / ring["fused_ms"], abs=0.01)
    for heading in ("## Links", "## Ring attention on one device"):
        assert heading in page
    assert "[links] all-reduce of 4 MiB over 2 devices" in stdout and "[attention] ring against fused" in stdout


def test_a_float8_step_is_timed_with_its_blocks_converted_as_a_run_converts_them():
    """`float8=tensorwise`'s rows, here emulated on the CPU (on a GPU: make gpu-check GPU_CHECK=float8=...)."""
    from tools.gpu_check import speed

    config = load_preset("debug", correctness.VOCAB_SIZE)
    setting = speed.Setting("debug", 64, 2, False, "32-true", "cpu", 2, 1, correctness.VOCAB_SIZE, float8="tensorwise")
    outcome = speed.step_in_this_process(setting)
    plain = speed.step_in_this_process(speed.Setting(**{**setting.__dict__, "float8": None}))
    assert outcome["ok"] and outcome["loss_finite"] and outcome["loss"] != plain["loss"]  # really converted
    row = speed.row(setting, outcome, config, 1e12, {})
    assert row["status"] == "measured" and row["mode"] == "eager, float8 tensorwise"


def test_without_a_gpu_the_check_says_so_in_one_line_and_writes_nothing(tmp_path):
    result = run_module("tools.gpu_check", [f"out={tmp_path}"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("no GPU here") and len(result.stdout.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
    asked = run_module("tools.gpu_check", ["device=cuda", f"out={tmp_path}"], env={"CUDA_VISIBLE_DEVICES": ""})
    assert asked.returncode == 2 and asked.stderr.strip().startswith("error: device=cuda: torch sees no GPU")


def test_float8_on_a_gpu_without_float8_products_is_refused_before_anything_runs(monkeypatch, capsys, tmp_path):
    from tools import gpu_check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(sys, "argv", ["gpu_check", "float8=tensorwise,rowwise", f"out={tmp_path}"])
    with pytest.raises(SystemExit) as exited:
        gpu_check.main()
    assert exited.value.code == 2 and list(tmp_path.iterdir()) == []
    said = capsys.readouterr().err
    assert said.startswith("error: float8=tensorwise,rowwise: NVIDIA A100") and "capability 8.0" in said


@pytest.mark.parametrize(
    "argument, message",
    [
        ("device=tpu", "device=tpu: choose auto"),
        ("minutes=0", "minutes=0: give the time budget"),
        ("minutes=soon", "minutes=soon"),
        ("devices=0", "devices=0: give a positive number"),
        ("speed=fast", "unknown argument 'speed=fast'"),
        ("sections=speed,lunch", "sections=speed,lunch: name one or more of correctness,speed,data"),
        ("float8=fp8", "float8=fp8: name tensorwise, rowwise or both"),
    ],
)
def test_bad_options_are_refused_by_name(argument, message):
    with pytest.raises(ConfigError, match=message):
        parse([argument])


def test_sections_left_out_give_their_time_to_the_others_in_proportion():
    everything = section_ends(0.0, 100.0, ("correctness", "speed", "data"))
    assert everything == pytest.approx({"correctness": 45.0, "speed": 90.0, "data": 100.0})
    assert section_ends(0.0, 100.0, ("correctness", "data")) == pytest.approx({"correctness": 45 / 0.55, "data": 100.0})
    assert section_ends(10.0, 60.0, ("speed",)) == pytest.approx({"speed": 70.0})
    assert parse(["sections=data,correctness"])["sections"] == ("correctness", "data")  # run in the check's order


def test_float8_cases_run_bf16s_settings_with_each_recipe_over_200_compiled_steps_on_a_gpu():
    assert not [case for case in correctness.cases("cuda", 1) if "float8" in case.proves]  # only when asked
    found = correctness.cases("cuda", 1, ("tensorwise", "rowwise"))
    reference, tensorwise, rowwise = found[-3:]
    assert reference.reference is None and reference.steps == 200
    assert {"trainer.precision=bf16-mixed", "strategy.compile=true"} <= set(reference.settings)
    for case, recipe in ((tensorwise, "tensorwise"), (rowwise, "rowwise")):
        assert case.settings == [*reference.settings, f"strategy.float8={recipe}"]
        assert (case.reference, case.steps, case.tolerance) == (reference.name, 200, correctness.TOLERANCE["float8"])
    argv = correctness.command(tensorwise, "cuda", {"dir": "d", "sources": "s"}, 1, Path("r"), None)
    assert "trainer.max_steps=200" in argv and "optim.decay_steps=200" in argv  # the schedule ends with the run


@pytest.mark.slow
def test_a_float8_run_tracks_bf16_through_project_train_within_the_checks_tolerance(tmp_path):
    """The float8 cases as the check runs them, here emulated on the CPU over 20 steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    data = prepare(tmp_path, 0.2, correctness.SEQ_LEN, env)
    done: dict[str, correctness.Result] = {}
    for case in correctness.float8_cases("cpu", ("tensorwise",)):
        done[case.name] = correctness.run_case(case, "cpu", 1, data, tmp_path / "runs", env, done, timeout=300)
        assert done[case.name].status == "pass", done[case.name].detail
    result = done["float8 tensorwise"]
    assert "strategy.float8=tensorwise" in result.command and len(result.losses) == correctness.FLOAT8_STEPS["cpu"]
    assert 0 < result.max_rel_diff <= correctness.TOLERANCE["float8"]  # float8's rounding, not bf16's run again


def test_a_run_outside_its_tolerance_fails_its_case():
    reference = {0: 6.0, 1: 5.0, 2: 4.0}
    assert correctness.compare({0: 6.0, 1: 5.001, 2: 4.0}, reference, 1e-3)[0]
    passed, diff, why = correctness.compare({0: 6.0, 1: 5.1, 2: 4.0}, reference, 1e-2)
    assert not passed and diff == pytest.approx(0.02) and why.startswith("step 1: 5.100000 against 5.000000")
    assert correctness.compare({0: 6.0, 1: math.nan}, reference, 1)[2] == "a loss is not finite"
    assert "did not fall" in correctness.compare({0: 6.0, 1: 5.0, 2: 6.5}, {0: 6.0, 1: 5.0, 2: 6.5}, 1)[2]
    assert "no loss at steps [3]" in correctness.compare({2: 4.0, 3: 3.0}, reference, 1)[2]


def test_a_run_that_fails_fails_its_case_with_the_runs_own_error(tmp_path, tiny_shards):
    case = correctness.Case("odd heads", "a refused setting", ["model.n_heads=3"], reference=None)
    data = {"dir": str(tiny_shards), "sources": f"{tiny_shards.parent / 'raw'}/*.txt"}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # tiny_shards' vocabulary and sequences are not the check's: the run is refused for them too, before training.
    result = correctness.run_case(case, "cpu", 1, data, tmp_path, env, {}, timeout=300)
    assert result.status == "fail" and "exit status 2" in result.detail and "error:" in result.detail
    assert failures({"correctness": [vars(result)]}) == ["correctness: odd heads"]


def test_the_offline_wheels_are_the_runs_imports_beyond_torch():
    wheels = closure()
    for needed in (
        "hydra-core", "omegaconf", "antlr4-python3-runtime", "litdata", "lightning", "lightning-utilities", "torchao"
    ):  # fmt: skip
        assert needed in wheels
    for provided in ("torch", "torchvision", "sympy", "networkx", "wandb", "triton"):
        assert provided not in wheels  # the node's torch brings its own; wandb is not imported with logger=csv


def test_the_offline_script_installs_what_does_not_import_and_runs_the_check_from_the_node_python(tmp_path):
    """A missing wheel folder is refused. Otherwise the node's packages are used where they import: an H200 node's
    Python listed boto3 (metadata) and could not import it, and the first gpu-check there failed to prepare its data;
    the script now asks whether each wheel's modules import, not only whether its metadata is there."""
    import zipfile

    script = ROOT / "scripts" / "gpu_check_offline.sh"
    missing = subprocess.run(
        ["bash", script, str(tmp_path / "nowhere")],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and missing.stderr.startswith("error: usage: scripts/gpu_check_offline.sh")
    wheels, broken = tmp_path / "wheels", tmp_path / "broken"
    wheels.mkdir()
    (broken / "fakemodule-1.0.dist-info").mkdir(parents=True)  # metadata, no module: what that node had
    metadata = "Metadata-Version: 2.1\nName: fakemodule\nVersion: 1.0\n"
    (broken / "fakemodule-1.0.dist-info" / "METADATA").write_text(metadata)
    with zipfile.ZipFile(wheels / "fakemodule-1.0-py3-none-any.whl", "w") as wheel:
        files = {
            "fakemodule/__init__.py": "VALUE = 1\n",
            "fakemodule-1.0.dist-info/METADATA": metadata,
            "fakemodule-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        }
        files["fakemodule-1.0.dist-info/RECORD"] = "".join(
            f"{name},,\n" for name in [*files, "fakemodule-1.0.dist-info/RECORD"]
        )
        for name, text in files.items():
            wheel.writestr(name, text)
    site = tmp_path / "site"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "SITE": str(site),
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(broken),
    }
    ran = subprocess.run(
        ["bash", script, str(wheels), f"out={tmp_path / 'out'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr
    # Only the package that does not import: this environment has every other one the check needs.
    assert f"installing into {site}: fakemodule\n" in ran.stdout and (site / "fakemodule" / "__init__.py").is_file()
    assert "no GPU here" in ran.stdout and not (tmp_path / "out").exists()


def test_a_node_of_four_gpus_or_more_checks_hsdp_a_ring_of_four_2d_and_ddps_copies_over_200_steps(tmp_path):
    """The commands the multi-device cases run on a GPU node (their layouts are proven on the CPU by the parity
    tests: tests/test_sharded_parity.py, tests/test_context_parallel.py)."""
    found = {case.name: case for case in correctness.cases("cuda", 8)}
    data = {"dir": "shards", "sources": "raw/*.txt"}

    def said(name: str) -> str:
        case = found[name]
        return " ".join(correctness.command(case, "cuda", data, 8, tmp_path / "run", None))

    assert "strategy.data_parallel_shard_size=2" in said("hsdp 2x2") and "trainer.devices=4" in said("hsdp 2x2")
    assert "strategy.context_parallel_kv=ring" in said("context ring x4")
    assert "strategy.context_parallel_size=4" in said("context ring x4")
    assert "strategy=tp_fsdp" in said("tp_fsdp 2x2")
    replicas = found["replicas equal x8"]
    assert replicas.steps == 200 and "trainer.devices=8" in said("replicas equal x8")
    assert "stability.replica_check_every_n_steps=50" in said("replicas equal x8")
    assert "replicas equal x2" not in {case.name for case in correctness.cases("cpu", 2)}  # a CPU's never part

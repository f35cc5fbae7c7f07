"""Shared fixtures: a small generated corpus, its shards, and a way to run training as a subprocess."""

from __future__ import annotations

import contextlib
import csv
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The checkout's data/ and outputs/ are the user's: `make train` leaves shards in data/ that other data settings
# refuse, and runs in outputs/. conf/paths roots both at PROJECT_ROOT, which this session (each xdist worker, and
# every run a test starts, which inherit it) sets to an empty folder of its own; pytest_sessionfinish checks that
# nothing in the checkout's own folders changed.
SESSION_ROOT = Path(tempfile.mkdtemp(prefix="llama-tests-root-"))
os.environ["PROJECT_ROOT"] = str(SESSION_ROOT)
# Every process a test starts prints its Python stacks if it dies of a signal (a segfault seen once in CI, in a run
# stopped by SIGTERM, said nothing of where it was).
os.environ["PYTHONFAULTHANDLER"] = "1"
USER_STATE = ("data", "outputs", "multirun", "lightning_logs", "wandb")


def user_state() -> dict[str, tuple[int, int]]:
    """(size, modification time) of every file under the checkout's state folders."""
    found = {}
    for folder in USER_STATE:
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                stat = path.stat()
                found[str(path.relative_to(ROOT))] = (stat.st_size, stat.st_mtime_ns)
    return found


USER_STATE_AT_START = user_state()
# transformers, the reference the export and parity tests compare with, lies beside the environment and
# not in it (see the Makefile): appended here, it is importable by the tests and by none of the runs they start.
sys.path.append(str(Path(sys.prefix) / "hf-reference"))

# Runs that several test files read, trained once per pytest session (fixtures below): under `make test`'s
# workers (pytest-xdist, --dist loadgroup) the tests that read one stay on one worker, and every other
# test stays with its file, so that module fixtures are not built twice either.
SHARED_RUNS = {
    "trained": "reference-runs",
    "single_reference": "reference-runs",
    "pipeline_reference": "reference-runs",
    "uninterrupted_reference": "uninterrupted-runs",
}


# The longest groups go to the workers first (longest processing time first): a long group handed out
# last would leave the other workers idle at the end. Roughly longest first by make test's slowest tests
# (2026-11-28: about 140 to 200 s for the first two, 50 to 110 s for the next ten); the others follow in file order.
LONGEST_FIRST = (
    "tests/test_documented_commands.py",
    "reference-runs",
    "tests/test_crashes.py",
    "tests/test_stability.py",
    "tests/test_gpu_check.py",
    "uninterrupted-runs",
    "tests/test_bench.py",
    "tests/test_float8.py",
    "tests/test_moe.py",
    "tests/test_comms.py",
    "tests/test_evaluation.py",
    "tests/test_object_storage.py",
    "tests/test_parallel_in_process.py",
    "tests/test_resharded_loading.py",
    "tests/test_planner.py",
    "tests/test_faults.py",
    "tests/test_clusters.py",
    "tests/test_train_end_to_end.py",  # 20 s alone, and last by file name: the suite would end on it
)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    groups = {}
    for item in items:
        group = next(
            (SHARED_RUNS[name] for name in item.fixturenames if name in SHARED_RUNS), item.nodeid.split("::")[0]
        )
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item.nodeid] = group
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(rank)))  # stable: the others keep their order


def pytest_configure(config):
    # pytest-xdist hands the groups out by their number of tests, most first (its --loadscope-reorder, on by
    # default), which would undo LONGEST_FIRST's order: the documented commands' one long test went out 57th of 68.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Workers share two cores: one thread each for what the tests compute in-process, as the runs they
        # start have (OMP_NUM_THREADS=1).
        torch.set_num_threads(1)


WORDS = (
    "the king queen lord lady sword crown night day love death war peace heart blood fair foul sweet "
    "bitter speak answer gentle noble villain honest fortune grave merry sorrow"
).split()


def write_corpus(directory: Path, documents: int = 8, lines: int = 300, seed: int = 0, suffix: str = ".txt") -> Path:
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for d in range(documents):
        text = "\n".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(lines)
        )
        (directory / f"doc{d}{suffix}").write_text(text + "\n")
    return directory


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory) -> Path:
    """Shards of a generated corpus: BPE vocab 300, 32-token sequences (blocks of 33)."""
    from project.data.prepare import prepare_shards

    root = tmp_path_factory.mktemp("tiny")
    corpus = write_corpus(root / "raw")
    prepare_shards([str(corpus / "*.txt")], root / "shards", vocab_size=300, seq_len=32, num_workers=1)
    return root / "shards"


@pytest.fixture(scope="session")
def short_document_shards(tmp_path_factory) -> Path:
    """Documents of about 30 tokens, so that every 32-token sequence spans two or more of them."""
    from project.data.prepare import prepare_shards

    root = tmp_path_factory.mktemp("short-documents")
    corpus = write_corpus(root / "raw", documents=60, lines=3)
    prepare_shards([str(corpus / "*.txt")], root / "shards", vocab_size=300, seq_len=32, num_workers=1)
    return root / "shards"


def train_overrides(shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "experiment=debug",
        f"data.dir={shards}",
        # The corpus the shards were prepared from (tiny_shards': raw/ beside them), so that a run's data settings
        # are the shards' (project.config.checks refuses others); where there is none, the shards are taken as they are.
        f"data.sources=[{Path(shards).parent / 'raw'}/*.txt]",
        "data.fetch=null",
        "data.seq_len=32",
        "data.vocab_size=300",
        f"hydra.run.dir={run_dir}",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        *extra,
    ]


def pytest_sessionfinish(session):
    from warm_start import close_shared_server

    close_shared_server()
    shutil.rmtree(SESSION_ROOT, ignore_errors=True)
    now = user_state()
    touched = sorted(p for p in now.keys() | USER_STATE_AT_START.keys() if now.get(p) != USER_STATE_AT_START.get(p))
    if touched:
        print(f"\nthe tests changed the checkout's own files (they must write under PROJECT_ROOT): {touched[:10]}")
        session.exitstatus = 1


def run_module(
    module: str,
    args: list[str],
    timeout: int = 600,
    warm: bool = True,
    env: dict[str, str] | None = None,
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess:
    """Run `python -m module args` in a process of its own; Lightning's DDP re-launches this same command per rank.

    `warm`: forked from a process that has done the imports (tests/warm_start.py), two to three seconds sooner;
    `warm=False` for a test of what a fresh interpreter does before the module runs (its imports, their output).
    `env`: variables set besides this process's; `file_size_limit`: writes past it fail, as on a full disk.
    A run still going after `timeout` seconds fails the test with the Python stacks of every process it
    started (ranks and loader workers alike), so that a hang seen once in CI says where it was.
    """
    # PYTHONFAULTHANDLER: SIGABRT makes each process print every thread's stack to its stderr.
    variables = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "offline",
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    variables.pop("PYTEST_CURRENT_TEST", None)
    command = [sys.executable, "-m", module, *args]
    if warm:
        from warm_start import shared_server  # tests/ is on the path: one module, whichever way conftest was imported

        process = shared_server().start(module, args, ROOT, variables, file_size_limit)
    else:
        assert file_size_limit is None, "a limit is set in the warm child only"
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        process = subprocess.Popen(command, cwd=ROOT, env=variables, **pipes, text=True, start_new_session=True)
    with process if not warm else contextlib.nullcontext():  # Popen's exit closes its pipes
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = stacks_of_hung_session(process)
            pytest.fail(
                f"`python -m {module} {' '.join(args)}` was still running after {timeout} s. Its processes' stacks "
                f"(SIGABRT), last lines of stderr:\n{stderr[-30000:]}\n--- last lines of stdout:\n{stdout[-3000:]}",
                pytrace=False,
            )
        except BaseException:  # Ctrl-C: its own session keeps the run from seeing it, so end the run here
            kill_session(process)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def stacks_of_hung_session(process: subprocess.Popen) -> tuple[str, str]:
    """SIGABRT every process of `process`'s session, so that each prints its stacks, then SIGKILL what is left;
    returns what they printed. A process outside the session may hold the pipes open (wandb's service runs
    in a session of its own): then what could be read in a minute."""
    kill_session(process, signal.SIGABRT)
    try:
        printed = process.communicate(timeout=30)  # read while they print, or a full pipe would stop them
    except subprocess.TimeoutExpired:
        kill_session(process)
        try:
            printed = process.communicate(timeout=30)  # a second call loses nothing the first one read
        except subprocess.TimeoutExpired as partial:
            text = [
                (b or b"").decode(errors="replace") if not isinstance(b, str) else b
                for b in (partial.stdout, partial.stderr)
            ]
            return text[0], text[
                1
            ] + "\n(the rest could not be read: a process outside the run's session holds its pipes open)"
    kill_session(process)  # those that did not hold the pipes
    return printed


def kill_session(process: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def run_train(shards: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    result = run_module("project.train", train_overrides(shards, run_dir, *extra))
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def read_metrics(run_dir: Path, column: str) -> dict[int, float]:
    """{step: value} for the rows of metrics.csv that carry `column`; a step logged twice fails the test."""
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [(int(row["step"]), float(row[column])) for row in csv.DictReader(f) if row.get(column)]
    steps = [step for step, _ in rows]
    assert len(steps) == len(set(steps)), f"{column} logged twice for a step in {run_dir / 'metrics.csv'}: {steps}"
    return dict(rows)


# Loss chunks of 64 tokens: a micro batch of 4 or 8 sequences of 32 tokens computes its loss in several
# (project.model.loss); each chunk costs a recomputation, so no more than that.
PARITY_STEPS = ["trainer.max_steps=12", "global_batch_size=8"]
PARITY_RUN = [*PARITY_STEPS, "model.loss_chunk_tokens=64"]


WEIGHT_ATOL = 1e-4  # final weights of a layout against one device's (assert_reproduces)


def assert_reproduces(run_dir, reference_dir, steps: int = 10):
    """Per-step train/loss to 1e-5 relative and train/grad_norm to 2e-4, and the final weights, as the reference run
    (of at least `steps` steps)."""
    reference, loss = read_metrics(reference_dir, "train/loss"), read_metrics(run_dir, "train/loss")
    assert sorted(loss) == sorted(reference) and len(loss) >= steps
    for step in reference:
        assert loss[step] == pytest.approx(reference[step], rel=1e-5), step
    norms, reference_norms = read_metrics(run_dir, "train/grad_norm"), read_metrics(reference_dir, "train/grad_norm")
    # The norm over shards is the global norm (gloo AVG did not sum: pytorch#162338, a 2x error). A norm
    # sums the squares of every gradient, so it moves more than the loss with reductions in another order:
    # measured, 2e-5 and 4e-5 at the one sensitive step of the pipeline layouts (the losses within 2e-7), and
    # 1.2e-4 for pp2 x dp2 x tp2 with sequence parallelism since the initial values of 2026-11-27.
    for step in reference_norms:
        assert norms[step] == pytest.approx(reference_norms[step], rel=2e-4), step
    from project.checkpoint.reshard import read_whole

    weights = read_whole(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    reference_weights = read_whole(reference_dir / "checkpoints" / "last.ckpt")["state_dict"]
    assert weights.keys() == reference_weights.keys()
    for name, value in reference_weights.items():
        # 12 AdamW steps of up to 3e-3 each: reductions summed in another order leave ~1e-6 differences, up to
        # 6.3e-5 (measured) at one element of the embedding under tensor parallelism, whose vocabulary-split loss adds
        # in another order (row 269, column 43, since the initial values of 2026-11-27; 2.6e-5 before, the 3-D
        # pipeline layout); WEIGHT_ATOL is still 30 times under a single step's change, so a wrong update fails.
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=WEIGHT_ATOL, msg=name)


def assert_validates_like(run_dir, reference_dir):
    """val/loss at the same steps as the reference run's, each to 1e-5 relative (and at least one)."""
    val, reference_val = read_metrics(run_dir, "val/loss"), read_metrics(reference_dir, "val/loss")
    assert val.keys() == reference_val.keys() and val
    for step in reference_val:
        assert val[step] == pytest.approx(reference_val[step], rel=1e-5), step


class TrainedRuns:
    """Runs trained once per session, by their overrides, for tests that only read a run (its metrics, its
    checkpoint): a parity test and a crash test of the same layout share one run instead of training it twice.

    `trained(*overrides)` trains a run not yet trained with `python -m project.train`, end to end.
    `trained.ahead([overrides, ...])` trains those not yet trained together, in process (tests/in_process.py):
    one group of gloo ranks per device count runs them all, without a process start per run.
    """

    def __init__(self, shards: Path, tmp_path_factory: pytest.TempPathFactory):
        self.shards, self.tmp_path_factory, self.runs = shards, tmp_path_factory, dict[tuple[str, ...], Path]()

    def __call__(self, *overrides: str) -> Path:
        if overrides not in self.runs:
            run_dir = self.tmp_path_factory.mktemp("trained")
            run_train(self.shards, run_dir, *overrides)
            self.runs[overrides] = run_dir
        return self.runs[overrides]

    def ahead(self, runs: list[tuple[str, ...]]) -> None:
        from in_process import train_in_process

        by_devices: dict[int, list[tuple[str, ...]]] = {}
        for overrides in dict.fromkeys(runs):  # in order, once each
            if overrides not in self.runs:
                devices = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("trainer.devices=")]
                by_devices.setdefault(devices[-1] if devices else 1, []).append(overrides)
        for devices, group in sorted(by_devices.items()):
            cases = [(self.tmp_path_factory.mktemp("trained"), overrides) for overrides in group]
            train_in_process(devices, [(d, train_overrides(self.shards, d, *o)) for d, o in cases])
            self.runs.update((overrides, run_dir) for run_dir, overrides in cases)


@pytest.fixture(scope="session")
def trained(request, tiny_shards, tmp_path_factory) -> TrainedRuns:
    """The session's shared runs. Those that the selected tests' modules list in TRAINED_TOGETHER (their overrides)
    are trained together, in process, when the first test asks for one: most of them are of 2 or 4 ranks, and
    started one by one each would cost its own process start-ups."""
    runs = TrainedRuns(tiny_shards, tmp_path_factory)
    modules = dict.fromkeys(item.module for item in request.session.items)
    runs.ahead([tuple(overrides) for module in modules for overrides in getattr(module, "TRAINED_TOGETHER", [])])
    return runs


@pytest.fixture(scope="session")
def single_reference(tiny_shards, tmp_path_factory) -> Path:
    """The one-process run every parallel layout must reproduce (12 steps, global batch 8)."""
    run_dir = tmp_path_factory.mktemp("single-reference")
    run_train(tiny_shards, run_dir, *PARITY_RUN)
    return run_dir


def assert_continues(run_dir: Path, uninterrupted: dict[int, float], steps: int) -> None:
    """The run's train/loss for steps 0 .. steps-1, each logged once, equals the uninterrupted run's."""
    resumed = read_metrics(run_dir, "train/loss")  # fails on a step logged twice
    assert sorted(resumed) == list(range(steps))
    for step in resumed:
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-5), step


# The schedule's length is fixed so that stopping early does not change the learning rates; micro
# batches of 2 make 4 accumulation steps on one process and 2 on two.
RESUME_RUN = [
    "optim.decay_steps=20",
    "global_batch_size=8",
    "micro_batch_size=2",
    "ckpt_every_n_steps=5",
    "model.loss_chunk_tokens=32",  # micro batches of 2 sequences: two chunks each
]


@pytest.fixture(scope="session")
def uninterrupted_reference(tiny_shards, tmp_path_factory) -> dict[int, float]:
    """Per-step train/loss of 20 uninterrupted single-process steps, which resumed runs must reproduce."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_train(tiny_shards, run_dir, *RESUME_RUN, "trainer.max_steps=20")
    return read_metrics(run_dir, "train/loss")


# Documents masked within packed sequences, on short_document_shards; four layers for the pipeline's two stages.
DOCUMENT_RUN = ["trainer.max_steps=4", "global_batch_size=8", "model.n_layers=4", "document_mask=true"]


@pytest.fixture(scope="session")
def document_mask_reference(short_document_shards, tmp_path_factory) -> Path:
    """One device's run with document masking (DOCUMENT_RUN), which the layouts that pass documents on reproduce."""
    run_dir = tmp_path_factory.mktemp("document-mask-reference")
    run_train(short_document_shards, run_dir, *DOCUMENT_RUN)
    assert_masks_matter(read_metrics(run_dir, "train/loss"), short_document_shards, tmp_path_factory)
    return run_dir


def assert_masks_matter(masked: dict[int, float], shards: Path, tmp_path_factory) -> None:
    """The same run without document masking ends at another loss: on these shards the masks change the training, so
    a layout that dropped them could not reproduce the masked run."""
    run_dir = tmp_path_factory.mktemp("document-mask-off")
    run_train(shards, run_dir, *DOCUMENT_RUN, "document_mask=false")
    assert read_metrics(run_dir, "train/loss")[3] != pytest.approx(masked[3], rel=1e-4)


# Four layers, so that two ranks can hold two stage chunks each (interleaved and V schedules) and
# four ranks one each.
# Micro batches of one sequence on the last stage: chunks of 16 tokens make two.
PIPELINE_RUN = [*PARITY_STEPS, "model.n_layers=4", "model.loss_chunk_tokens=16"]


@pytest.fixture(scope="session")
def pipeline_reference(tiny_shards, tmp_path_factory) -> Path:
    """The one-process run every pipeline layout must reproduce (PARITY_RUN with a 4-layer model)."""
    run_dir = tmp_path_factory.mktemp("pipeline-reference")
    run_train(tiny_shards, run_dir, *PIPELINE_RUN)
    return run_dir


S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def bucket():
    """A bucket on a server of our own, reached by this process and the runs it starts (the AWS_* environment)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = dict(os.environ)
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=f"http://{host}:{port}")
    boto3.client("s3").create_bucket(Bucket="corpus")
    yield "s3://corpus"
    os.environ.clear()
    os.environ.update(saved)
    server.stop()

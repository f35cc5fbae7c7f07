"""A plain run prints no warning a user cannot act on, and keeps what it printed in its run directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import run_module, train_overrides

# A warning in every form it takes: Python's (file.py:NN: or <frozen runpy>:NN: before it, or a bare
# `SomethingWarning:`), the project's own (`warning: ...`, project.runtime.console), torch's C++/logging
# ([rank0]:W1123 ...) and wandb's.
WARNING = re.compile(r"(\.py|<frozen [\w.]+>):\d+: |\w+Warning: |^warning: |\[rank\d+\]:W\d{4} |^W\d{4} |WARNING")
# Warnings that mean something and stay; each with the reason. project.runtime.console lists those silenced.
ALLOWED = [
    # The debug experiment on the tiny test corpus: 8 training sequences per step from 300-token data.
    # (None today: add a pattern here only with the reason it helps the user.)
]


def unexpected_warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if WARNING.search(line) and not any(re.search(p, line) for p in ALLOWED)]


def run(shards, run_dir, strategy, *extra, warm=True):
    args = train_overrides(shards, run_dir, f"strategy={strategy}", "logger=wandb", *extra)
    # The user's view: progress bar and model summary on, as in a plain `experiment=debug` run.
    args = [a for a in args if a not in ("trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")]
    if strategy != "single":
        args.append("trainer.devices=2")
    result = run_module("project.train", args, warm=warm)
    assert result.returncode == 0, f"training failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def debug_runs(tiny_shards, tmp_path_factory):
    """`debug_runs(strategy)`: (run folder, console of a 4-step debug run, console of its resume to step 6),
    run once per strategy for the tests below."""
    runs = {}

    def get(strategy: str) -> tuple[Path, str, str]:
        if strategy not in runs:
            run_dir = tmp_path_factory.mktemp(f"debug-{strategy}")
            # One schedule for both (optim.decay_steps): a resume that changed it would rightly warn.
            steps = ["val_every_n_steps=2", "ckpt_every_n_steps=2", "optim.decay_steps=8"]
            # What rank 0's imports print is part of what a user sees: the single run starts cold, as a user's does.
            # The imports are those of every layout (a strategy's own are made in the run, warm or not), and the
            # other ranks start cold under Lightning's launcher with the run's console as theirs.
            first = run(tiny_shards, run_dir, strategy, "trainer.max_steps=4", *steps, warm=strategy != "single")
            resumed = run(tiny_shards, run_dir, strategy, "trainer.max_steps=6", "ckpt_path=last", *steps)
            runs[strategy] = run_dir, first, resumed
        return runs[strategy]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "ddp", "tp_fsdp"])
def test_a_debug_run_and_its_resume_print_no_warning_a_user_cannot_act_on(tiny_shards, debug_runs, strategy):
    run_dir, first, resumed = debug_runs(strategy)
    assert unexpected_warnings(first) == [] and unexpected_warnings(resumed) == []
    if strategy == "single":  # and from another run's checkpoint, into a new run directory, checkpointing less often
        last = run_dir / "checkpoints" / "last.ckpt"
        elsewhere = run(
            tiny_shards,
            run_dir / "next",
            strategy,
            "trainer.max_steps=8",
            f"ckpt_path={last}",
            "val_every_n_steps=2",
            "optim.decay_steps=8",
        )
        assert unexpected_warnings(elsewhere) == []
    # The summary states the model, not "FLOPs: 0".
    assert re.search(r"model: Llama, [\d.]+ \w? ?parameters.*training FLOPs per token", first)
    assert "Total FLOPs" not in first


@pytest.mark.slow
def test_the_run_directory_keeps_what_each_rank_printed(debug_runs):
    run_dir, first, _ = debug_runs("ddp")  # 4 steps, then resumed to 6
    log = (run_dir / "train.log").read_text()
    assert "batch: global 8 = micro 4 x 1 accumulation x 2 data-parallel replicas" in log  # rank 0's console
    assert re.search(r"Epoch 0: 100%.*4/4", log) and "done: train/loss=" in log
    assert re.search(r"100%.*\| 6/6 \[", log)  # the resumed run's bar, from the checkpoint's step to max_steps
    assert "\r" not in log and "\x1b[" not in log  # progress bars kept as their last drawing, without escapes
    assert "[rank: 1]" in (run_dir / "train.rank1.log").read_text()  # the other rank's stderr, beside it
    assert log.count("== ") == 2 and log.count("done: train/loss=") == 2  # a resume appends to the record
    assert (
        log.index("batch: global 8") < log.index("done: train/loss=") < log.rindex("== ")
    )  # the first run's record first


@pytest.mark.slow
def test_ready_callbacks_stop_early_saying_where_and_bars_count_optimizer_steps(tiny_shards, tmp_path):
    """conf/callbacks' early_stopping (a fall of 100 asked of every validation: none comes), lr_monitor and
    layer_summary, under accumulation (two micro batches a step): the bar counts optimizer steps to max_steps, and
    after a resume goes on from the checkpoint's step, rich's (rich_progress) as tqdm's."""
    steps = ["global_batch_size=8", "micro_batch_size=4", "val_every_n_steps=1", "ckpt_every_n_steps=1"]
    ready = ["callbacks=[early_stopping,lr_monitor,layer_summary]", "callbacks.early_stopping.patience=1"]
    ready.append("callbacks.early_stopping.min_delta=100")
    first = run(tiny_shards, tmp_path, "single", "trainer.max_steps=10", *steps, *ready)
    assert unexpected_warnings(first) == []
    assert re.search(
        r"done: stopped early at step 2 of trainer.max_steps=10 by EarlyStopping \(Monitored metric val/loss did not "
        r"improve in the last 1 records. Best score: [\d.]+\.\); train/loss=[\d.]+, val/loss=[\d.]+; checkpoints in ",
        first,
    )
    assert re.search(r"\| 2/10 \[", first) and not re.search(r"/20 \[", first)  # steps, not micro batches
    assert "| Name" in first  # Lightning's table of the modules, after the summary
    assert {"lr-AdamW/pg1", "lr-AdamW/pg2"} <= set((tmp_path / "metrics.csv").read_text().splitlines()[0].split(","))
    resumed = run(
        tiny_shards, tmp_path, "single", "trainer.max_steps=4", "ckpt_path=last", *steps, "callbacks=rich_progress"
    )
    assert "Epoch 0 " in resumed and "4/4" in resumed and "/?" not in resumed and "done: train/loss=" in resumed


def test_the_rich_bar_in_a_terminal_keeps_its_figures_on_its_line_so_the_log_keeps_its_last_drawing():
    """rich redraws a display of several lines by moving the cursor up, and train.log would keep every drawing."""
    import io

    from rich.console import Console
    from rich.progress import Progress, TextColumn

    from project.training.callbacks import StepRichProgressBar

    figures = "val/loss: 4.956 train/loss: 4.981 train/tokens_per_sec: 27008.893"
    drawn = {}
    for one_line in (False, True):
        bar = StepRichProgressBar()
        terminal = Console(file=io.StringIO(), force_terminal=True, width=80)
        # Lightning's columns (description, bar, steps, times, speed), then its figures.
        bar.progress = Progress(*bar.configure_columns(None), TextColumn(figures), console=terminal)
        if one_line:
            bar._one_line()
        bar.progress.add_task("Epoch 0", total=6, completed=3)
        drawn[one_line] = [
            "".join(s.text for s in line) for line in terminal.render_lines(bar.progress.get_renderable())
        ]
    assert len(drawn[False]) > 1  # what Lightning's bar draws in a terminal of 80 columns
    [line] = drawn[True]
    assert re.fullmatch(r"Epoch 0 \S+ 3/6 0:00:00 • -:--:-- 0.00it/s val/loss: 4.956 tra…", line.rstrip())


def test_the_projects_own_warnings_print_as_one_warning_line_above_the_progress_bar(tiny_shards, capsys):
    """A rank_zero_warn of the project's own code: `warning: <message>`, without Python's source path and its
    `rank_zero_warn(` line, with the bar (tqdm's on stdout, as Lightning's) taken down for it and drawn again under it;
    a library's warnings go where they went before."""
    import json
    import sys
    import warnings

    from tqdm import tqdm

    from project.data.datamodule import TokenShardDataModule
    from project.runtime.console import silence_known_noise

    blocks = json.loads((tiny_shards / "manifest.json").read_text())["splits"]["train"]["blocks"]
    elsewhere = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, *_: elsewhere.append((str(message), filename))
        silence_known_noise()
        bar = tqdm(total=4, desc="Epoch 0", file=sys.stdout, mininterval=0)
        bar.update(1)
        capsys.readouterr()
        TokenShardDataModule(
            str(tiny_shards), seq_len=32, global_batch_size=2 * blocks, micro_batch_size=2, allow_repeats=True
        )  # more sequences a step than the split holds: warned
        warnings.warn_explicit("a library's own", UserWarning, "/elsewhere/library.py", 7)
        said = capsys.readouterr()
        bar.close()
    assert said.err == (
        f"warning: each step reads {2 * blocks} sequences from {blocks} training blocks (data.allow_repeats=true): "
        "every block is read about 2.0 times per step.\n"
    )
    taken_down, drawn_again = said.out.split("\r" + " " * 40)[0], said.out.rsplit("\r", 1)[-1]
    assert taken_down == "" and drawn_again.startswith("Epoch 0:  25%")
    assert elsewhere == [("a library's own", "/elsewhere/library.py")]


def test_what_torchao_logs_as_transformers_imports_it_is_filtered_and_nothing_else():
    """torchao's import (which transformers makes wherever torchao is installed) logs its optional CUDA kernels it
    could not load and torch's deprecation of its enums' registration: filtered (also in a process of the user's own
    with .venv/hf-reference on its path, whose sitecustomize is project/runtime/hf_reference_site.py); other lines of
    the same loggers are not."""
    import logging

    from project.runtime.console import silence_import_noise

    class Kept(logging.Handler):  # torch's loggers print with a handler of their own and do not propagate
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    kept: list[str] = []
    kernel = "/venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    silence_import_noise()
    silence_import_noise()  # once per run of a process that trains more than once: the same filters
    for logger in (torchao, pytree):
        logger.addHandler(Kept())
    try:
        torchao.warning(f"Failed to load {kernel}: Could not load this library: {kernel}")
        pytree.warning(
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
            "opaque value type. Calling register_constant() on Enum subclasses is deprecated and will be an error in "
            "a future release."
        )
        torchao.warning("a kernel failed to run")
        pytree.warning("another tree")
    finally:
        for logger in (torchao, pytree):
            logger.handlers = [h for h in logger.handlers if not isinstance(h, Kept)]
    assert kept == ["a kernel failed to run", "another tree"]
    assert len(torchao.filters) == 1

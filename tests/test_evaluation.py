"""Evaluation inside training (conf/eval, project.training.callbacks.evaluation): held-out sets' loss and bits per
byte every N steps, equal to a plain forward of the step's checkpoint, the same in every layout, and leaving the
training as it would be without it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import sentencepiece
import torch
import torch.nn.functional as F
from conftest import PARITY_RUN, read_metrics, train_overrides
from downstream_tasks import CHOICE, NEXT_WORD, write_tasks
from harness import harness_samples
from in_process import train_in_process

from project.data.blocks import TokenBlocks
from project.data.datamodule import TokenShardDataModule
from project.data.heldout import held_out_sets
from project.data.sampler import ValidationSampler
from project.data.shards import read_manifest
from project.data.tasks import encode_requests, load_task, request_rows
from project.data.tokenizer import load_tokenizer, train_bpe
from project.hf.export import main as export_main
from project.model.families import build_model, model_config
from project.runtime.errors import ConfigError

TEXT = "Now is the winter of our discontent — café, naïve, 日本語; ∑ 42!\n  Made glorious summer."


def test_token_bytes_add_up_to_the_texts_utf8_bytes(tmp_path):
    """Bits per byte divide by the text's bytes: a byte-level BPE's tokens and a sentencepiece model's pieces (with
    byte fallback for characters it has no piece for) stand for exactly the bytes of the text they encode."""
    corpus = [TEXT * 3, "To be, or not to be: that is the question.\n" * 20]
    bpe = train_bpe(corpus, 300, tmp_path / "bpe")
    (tmp_path / "corpus.txt").write_text("\n".join(corpus * 20))
    sentencepiece.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=400, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity",
        minloglevel=2,
    )  # fmt: skip
    for tokenizer in (bpe, load_tokenizer(tmp_path / "sp.model")):
        table = tokenizer.token_bytes()
        assert len(table) == tokenizer.vocab_size and table[tokenizer.eos_id] == 0
        assert sum(table[i] for i in tokenizer.encode(TEXT)) == len(TEXT.encode("utf-8")), tokenizer


@pytest.mark.parametrize(
    "sets, message",
    [
        ({"wiki": {"split": "val"}}, "eval.sets.wiki={'split': 'val'} needs a `dir`"),
        ({"wiki": {"dir": "x", "sequence": 8}}, "eval.sets.wiki has no setting sequence: it takes dir, split"),
        ({"wiki": {"dir": "x", "sequences": 0}}, "eval.sets.wiki.sequences=0: give a whole number"),
    ],
)
def test_malformed_held_out_sets_are_named(sets, message):
    with pytest.raises(ConfigError, match=message):
        held_out_sets(sets)


def test_reading_the_sets_draws_nothing_from_torchs_random_state(tiny_shards):
    data = TokenShardDataModule(
        str(tiny_shards), 32, 8, 4, dp_rank=0, dp_size=1, eval_sets={"heldout": {"dir": str(tiny_shards)}}
    )
    data.setup()
    state = torch.get_rng_state()
    batches = [batch for loader in data.eval_loaders().values() for batch in loader]
    assert batches and torch.equal(torch.get_rng_state(), state)


def test_a_set_prepared_with_another_tokenizer_or_without_shards_is_refused(
    tiny_shards, short_document_shards, tmp_path
):
    def start(sets):
        return TokenShardDataModule(str(tiny_shards), 32, 8, 4, dp_rank=0, dp_size=1, eval_sets=sets)

    with pytest.raises(ConfigError, match=r"eval.sets.other: the shards in .* were prepared with another tokenizer"):
        start({"other": {"dir": str(short_document_shards)}})
    with pytest.raises(ConfigError, match=r"eval.sets.none.dir=.* holds no prepared shards \(no manifest.json\)"):
        start({"none": {"dir": str(tmp_path)}})
    with pytest.raises(ConfigError, match=r"eval.sets.held.split=test: the shards in .* have the splits train, val"):
        start({"held": {"dir": str(tiny_shards), "split": "test"}})


# -- in training ---------------------------------------------------------------------------------------------------

EVERY = 4
SETS = ["eval.every_n_steps=4", "+eval.sets.train_part.split=train", "+eval.sets.train_part.sequences=6"]
LAYOUTS = {
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "fsdp2": ["strategy=fsdp2", "trainer.devices=2"],
    # Parameters kept gathered from a forward to its backward: the evaluation's forwards gather them between steps.
    "fsdp-shard-grad-op": ["strategy=fsdp", "trainer.devices=2", "strategy.sharding_strategy=SHARD_GRAD_OP"],
    "tp": ["strategy=tp", "trainer.devices=2"],
    "pipeline": ["strategy=pipeline", "trainer.devices=2"],
    # Each sequence split over 2 ranks: each holds the loss of its part, equally many tokens.
    "cp2": ["strategy=fsdp2", "trainer.devices=2", "strategy.context_parallel_size=2"],
    "fsdp2-documents": ["strategy=fsdp2", "trainer.devices=2", "document_mask=true"],
}
SINGLE = {  # the one-device runs each layout is held to
    "ddp": "single", "fsdp2": "single", "fsdp-shard-grad-op": "single", "tp": "single", "pipeline": "single",
    "cp2": "single",
    "fsdp2-documents": "documents",
}  # fmt: skip


@pytest.fixture(scope="module")
def task_files(tmp_path_factory) -> tuple[Path, list[Path]]:
    """The two downstream tasks of tests/downstream_tasks.py: their folder, and their YAML files."""
    folder = tmp_path_factory.mktemp("tasks")
    return folder, [folder / f"{name}.yaml" for name in write_tasks(folder)]


@pytest.fixture(scope="module")
def runs(tiny_shards, short_document_shards, task_files, tmp_path_factory) -> dict:
    names = ["single", "without", "documents", "resumed", "fsdp2-without", "tasks-at-end", *LAYOUTS]
    folders = {name: tmp_path_factory.mktemp(name) for name in names}
    tasks = f"eval.tasks=[{','.join(str(path) for path in task_files[1])}]"

    def case(name: str, *overrides: str, evaluated: bool = True):
        # Document masking on documents shorter than a sequence: else it masks nothing.
        shards = short_document_shards if "documents" in name else tiny_shards
        held_out = [
            f"+eval.sets.train_part.dir={shards}",
            "eval=heldout",
            "eval.sets.heldout.sequences=6",
            *SETS,
            tasks,
        ]
        return folders[name], train_overrides(shards, folders[name], *PARITY_RUN, "ckpt_every_n_steps=4",
                                              *(held_out if evaluated else []), *overrides)  # fmt: skip

    checkpoint = folders["single"] / "checkpoints" / "last.ckpt"
    train_in_process(
        1,
        [
            case("single", "ckpt_keep_last=3"),
            case("without", evaluated=False),
            case("documents", "document_mask=true"),
            case("tasks-at-end", tasks, evaluated=False),  # eval=none's every_n_steps=0, tasks given
        ],
    )  # fmt: skip
    resumed = case("resumed", f"ckpt_path={checkpoint.parent / 'step-000008.ckpt'}")
    without_fsdp = case("fsdp2-without", *LAYOUTS["fsdp2"], evaluated=False)
    train_in_process(2, [*(case(name, *overrides) for name, overrides in LAYOUTS.items()), without_fsdp])
    train_in_process(1, [resumed])
    return folders


def plain_losses(run_dir, shards, split: str, sequences: int, step: int) -> tuple[float, float]:
    """The mean next-token loss and bits per byte of a run's weights after `step` optimizer steps (its checkpoint)
    on the blocks a held-out set evaluates, by a plain forward and torch's cross entropy; the bytes decoded from the
    targets by the tokenizer."""
    name = "last.ckpt" if step == 12 else f"step-{step:06d}.ckpt"
    state = torch.load(run_dir / "checkpoints" / name, map_location="cpu", weights_only=False)
    model = build_model(model_config(state["hyper_parameters"]["model"]))
    model.load_state_dict({k.removeprefix("model."): v for k, v in state["state_dict"].items()})
    blocks_total = int(read_manifest(shards)["splits"][split]["blocks"])
    blocks = TokenBlocks(str(shards / split), 33, blocks_total)
    chosen = [i for batch in ValidationSampler(blocks_total, sequences, 4, 0, 1) for i in batch]
    tokens = torch.stack([torch.as_tensor(blocks[i]) for i in chosen]).long()
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    nats = F.cross_entropy(logits.flatten(0, 1).double(), tokens[:, 1:].flatten(), reduction="sum").item()
    tokenizer = load_tokenizer(shards / "tokenizer.json")
    text = [[t for t in row.tolist() if t != tokenizer.eos_id] for row in tokens[:, 1:]]  # the separators: no text
    text_bytes = sum(len(tokenizer.decode(row).encode("utf-8")) for row in text)
    return nats / tokens[:, 1:].numel(), nats / math.log(2) / text_bytes


@pytest.mark.slow
def test_held_out_losses_are_a_plain_forward_of_the_steps_weights(runs, tiny_shards):
    single = runs["single"]
    for metric, split in (("heldout", "val"), ("train_part", "train")):
        losses = read_metrics(single, f"eval/{metric}/loss")
        assert sorted(losses) == [3, 7, 11]  # after steps 4, 8 and 12, in the row of the step just ended
        for step in (8, 12):
            loss, bits = plain_losses(single, tiny_shards, split, 6, step)
            assert losses[step - 1] == pytest.approx(loss, rel=1e-5)
            assert read_metrics(single, f"eval/{metric}/bits_per_byte")[step - 1] == pytest.approx(bits, rel=1e-5)
    assert all(seconds > 0 for seconds in read_metrics(single, "eval/seconds").values())


@pytest.mark.slow
def test_a_run_with_evaluation_trains_exactly_as_one_without(runs):
    # Sharded too: FSDP2 gathers each block for the evaluation's forwards between steps, through its hooks.
    for evaluated, without in ((runs["fsdp2"], runs["fsdp2-without"]), (runs["single"], runs["without"])):
        for metric in ("train/loss", "train/grad_norm", "val/loss"):
            assert read_metrics(evaluated, metric) == read_metrics(without, metric), (evaluated, metric)
        assert not read_metrics(without, "eval/heldout/loss")
    ours = torch.load(evaluated / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    theirs = torch.load(without / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_evaluates_the_sets_as_one_device(runs, layout):
    reference = runs[SINGLE[layout]]
    for metric in (*HELD_OUT_METRICS, *TASK_METRICS):
        ours, theirs = read_metrics(runs[layout], metric), read_metrics(reference, metric)
        assert sorted(ours) == sorted(theirs) == [3, 7, 11]
        for step, value in theirs.items():
            # accuracies are counts of requests: equal log-likelihoods (to 1e-5) rank the choices alike
            assert ours[step] == pytest.approx(value, rel=1e-5), (metric, step)


HELD_OUT_METRICS = ("eval/heldout/loss", "eval/heldout/bits_per_byte", "eval/train_part/loss")
TASK_METRICS = (
    f"eval/{CHOICE}/acc", f"eval/{CHOICE}/acc_norm", f"eval/{NEXT_WORD}/acc", f"eval/{NEXT_WORD}/perplexity"
)  # fmt: skip


def plain_scores(run_dir, step: int, task, seq_len: int = 32) -> torch.Tensor:
    """[requests, 3] of a task's requests by a plain forward of the step's checkpoint: each continuation's summed
    log-probability (torch's log_softmax of the whole logits), its tokens, and those that are the logits' argmax."""
    state = torch.load(run_dir / "checkpoints" / f"step-{step:06d}.ckpt", map_location="cpu", weights_only=False)
    model = build_model(model_config(state["hyper_parameters"]["model"]))
    model.load_state_dict({k.removeprefix("model."): v for k, v in state["state_dict"].items()})
    data = state["datamodule_hyper_parameters"]["data_dir"]
    tokenizer = load_tokenizer(Path(data) / "tokenizer.json")
    encoded = encode_requests(task, tokenizer.encode, tokenizer.eos_id, seq_len, "eval.tasks")
    inputs, targets = request_rows(encoded, seq_len, tokenizer.eos_id)
    with torch.no_grad():
        log_probs = model(inputs).double().log_softmax(dim=-1)
    rows = []
    for row, target in zip(log_probs, targets):
        scored = target != -100
        picked = row[scored].gather(1, target[scored][:, None])[:, 0]
        greedy = row[scored].argmax(dim=1) == target[scored]
        rows.append([picked.sum().item(), float(scored.sum()), float(greedy.sum())])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.slow
def test_task_scores_equal_lm_evaluation_harness_on_the_steps_export(runs, task_files, tmp_path):
    """lm-evaluation-harness, run as its own process on the export of step 8's checkpoint with the same task files:
    each request's log-likelihood and greediness equal a plain forward of that checkpoint on the rows the loop builds
    (so the loop's encoding is the harness's), and the loop's metrics at step 8 equal the harness's."""
    folder, paths = task_files
    checkpoint = runs["single"] / "checkpoints" / "step-000008.ckpt"
    export_main([f"ckpt_path={checkpoint}", f"output_dir={tmp_path / 'hf'}"])
    samples = harness_samples(tmp_path / "hf", folder, [CHOICE, NEXT_WORD], tmp_path / "harness", max_length=32)
    for path in paths:
        task = load_task(path, "eval.tasks")
        theirs = samples[task.name]
        ours = plain_scores(runs["single"], 8, task)
        lls = [ll for sample in theirs for ll in sample["loglikelihoods"]]
        greedy = [flag for sample in theirs for flag in sample["is_greedy"]]
        torch.testing.assert_close(torch.tensor(lls, dtype=torch.float64), ours[:, 0], atol=1e-4, rtol=1e-5)
        assert greedy == (ours[:, 2] == ours[:, 1]).tolist()
        logged = {metric: read_metrics(runs["single"], f"eval/{task.name}/{metric}")[7] for metric in task.metrics}
        for metric, value in logged.items():
            expected = sum(sample["metrics"][metric] for sample in theirs) / len(theirs)
            if metric == "perplexity":  # the harness aggregates the samples' log-likelihoods as exp(-mean)
                expected = math.exp(-expected)
            assert value == pytest.approx(expected, rel=1e-4), (task.name, metric)


@pytest.mark.slow
def test_a_resumed_run_evaluates_on_as_the_uninterrupted_one(runs):
    """Resumed from the checkpoint of step 8 (written after that step's evaluation): the evaluation of step 12 equals
    the uninterrupted run's, and step 8's is not run again."""
    resumed, single = (
        read_metrics(runs["resumed"], "eval/heldout/loss"),
        read_metrics(runs["single"], "eval/heldout/loss"),
    )
    assert sorted(resumed) == [11] and resumed[11] == pytest.approx(single[11], rel=1e-6)


@pytest.mark.slow
def test_tasks_given_without_an_interval_are_scored_after_the_last_step_and_closing_line_says_so(runs):
    """eval.tasks with eval.every_n_steps=0 (eval=none's): one evaluation, after the last step, equal to the run that
    evaluates every 4 steps (the same weights: evaluating does not change training); its figures close train.log."""
    at_end, single = runs["tasks-at-end"], runs["single"]
    for metric in TASK_METRICS:
        ours = read_metrics(at_end, metric)
        assert sorted(ours) == [11], metric
        assert ours[11] == pytest.approx(read_metrics(single, metric)[11], rel=1e-6), metric
    done = [line for line in (at_end / "train.log").read_text().splitlines() if line.startswith("done: ")]
    acc = read_metrics(at_end, f"eval/{CHOICE}/acc")[11]
    assert len(done) == 1 and f"eval/{CHOICE}/acc={acc:.4f}" in done[0] and "eval/seconds" not in done[0], done

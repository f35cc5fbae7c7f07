"""Shards in object storage: an S3-compatible server on loopback (moto's server mode) stands in for S3."""

import json
import re
import signal

import boto3
import pytest
from conftest import read_metrics, run_module, run_train, train_overrides

from project.data.prepare import prepare_shards
from project.data.storage import upload_dataset
from project.runtime.errors import ConfigError


@pytest.fixture(scope="module")
def chunked_shards(tiny_shards, tmp_path_factory):
    """The tiny corpus in chunks of 10 KB (seven for training), for reads that move between chunks."""
    root = tmp_path_factory.mktemp("chunked")
    prepare_shards(
        [str(tiny_shards.parent / "raw" / "*.txt")],
        root / "shards",
        tokenizer=tiny_shards / "tokenizer.json",
        seq_len=32,
        num_workers=1,
        chunk_mb=0.01,
    )
    return root / "shards"


def objects(prefix, field="ETag"):
    listing = boto3.client("s3").list_objects_v2(Bucket="corpus", Prefix=prefix)
    return {item["Key"]: item[field] for item in listing.get("Contents", [])}


def test_training_from_object_storage_and_resuming_there_matches_a_local_folder(
    chunked_shards, tiny_shards, bucket, tmp_path
):
    upload_dataset(chunked_shards, f"{bucket}/tiny", None)
    chunks = len(json.loads((chunked_shards / "train" / "index.json").read_text())["chunks"])
    # Windows of 2 chunks, and a cache of 3 chunks (10 KB each): reads move between chunks, and chunks are evicted.
    common = ["data.shuffle_window=2", "data.cache_size=30KB", "global_batch_size=16", "val_sequences=8"]
    # The data settings the shards were prepared with (fixture above).
    common += [f"data.sources=[{tiny_shards.parent / 'raw'}/*.txt]", f"data.tokenizer={tiny_shards / 'tokenizer.json'}"]
    run_train(chunked_shards, tmp_path / "local", *common, "trainer.max_steps=4")
    local = read_metrics(tmp_path / "local", "train/loss")
    remote = [f"data.dir={bucket}/tiny", f"data.cache_dir={tmp_path / 'cache'}", "ckpt_every_n_steps=2", *common]
    run_train(chunked_shards, tmp_path / "s3", *remote, "trainer.max_steps=2")
    run_train(chunked_shards, tmp_path / "s3", *remote, "trainer.max_steps=4", "ckpt_path=last")
    assert read_metrics(tmp_path / "s3", "train/loss") == pytest.approx(local, rel=1e-6)
    assert sorted(local) == [0, 1, 2, 3] and chunks >= 6
    cached = list((tmp_path / "cache").rglob("chunk-*.bin"))
    assert 1 <= len([p for p in cached if p.parent.name != "views"]) <= chunks, "chunks cached under data.cache_dir"


def test_prepare_writes_straight_to_object_storage_the_shards_it_writes_locally(tiny_shards, bucket, tmp_path):
    raw = [str(tiny_shards.parent / "raw" / "*.txt")]
    settings = dict(tokenizer=tiny_shards / "tokenizer.json", seq_len=32, num_workers=1)
    local = prepare_shards(raw, tmp_path / "local", **settings)
    remote = prepare_shards(raw, f"{bucket}/prepared", **settings)
    assert remote == local
    uploaded = objects("prepared/")
    assert sorted(uploaded) == sorted(
        f"prepared/{p.relative_to(tmp_path / 'local').as_posix()}"
        for p in (tmp_path / "local").rglob("*")
        if p.is_file()
    )
    body = boto3.client("s3").get_object(Bucket="corpus", Key="prepared/train/chunk-0-0.bin")["Body"].read()
    assert body == (tmp_path / "local" / "train" / "chunk-0-0.bin").read_bytes()
    assert (
        prepare_shards(raw, f"{bucket}/prepared", **settings) == remote and objects("prepared/") == uploaded
    )  # up to date
    with pytest.raises(ConfigError, match="holds shards prepared from other settings: data.seq_len: 32 there, 16 here"):
        prepare_shards(raw, f"{bucket}/prepared", **{**settings, "seq_len": 16})
    boto3.client("s3").put_object(Bucket="corpus", Key="other/notes.txt", Body=b"not a dataset")
    with pytest.raises(ConfigError, match="holds objects but no manifest.json"):
        prepare_shards(raw, f"{bucket}/other", **settings)
    assert objects("other/") and "other/manifest.json" not in objects("other/")


CHECKPOINT_SECRET = "CheckpointEnvSecret0123456789abcdefEXAMPLE"  # moto takes any key: a distinctive one, looked for


def test_checkpoints_in_object_storage_resume_across_layouts_and_export_like_local_ones(
    tiny_shards, bucket, tmp_path, monkeypatch
):
    from in_process import train_in_process

    from project.hf.export import export

    ckpts = f"{bucket}/checkpoints"
    common = ["ckpt_every_n_steps=1", "ckpt_keep_last=2", "val_every_n_steps=2", f"ckpt_dir={ckpts}"]
    run_train(tiny_shards, tmp_path / "local", "trainer.max_steps=4", "val_every_n_steps=2")
    # fsdp2 on 2 ranks writes folders of shards in the background; a save killed earlier left a partial folder.
    boto3.client("s3").put_object(Bucket="corpus", Key="checkpoints/step-000009.ckpt/__0_0.distcp", Body=b"partial")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CHECKPOINT_SECRET)
    sharded = ["strategy=fsdp2", "trainer.devices=2", "ckpt_async=true", "trainer.max_steps=2", *common]
    train_in_process(2, [(tmp_path / "fsdp2", train_overrides(tiny_shards, tmp_path / "fsdp2", *sharded))])
    saved = objects("checkpoints/")
    assert (
        boto3.client("s3").get_object(Bucket="corpus", Key="checkpoints/latest")["Body"].read() == b"step-000002.ckpt"
    )
    assert {k.split("/")[1] for k in saved if k.split("/")[1].startswith("step-")} == {
        "step-000001.ckpt",
        "step-000002.ckpt",
    }, "the two newest saves kept, the partial one removed"
    assert "checkpoints/step-000002.ckpt/.metadata" in saved and any(k.endswith(".distcp") for k in saved)
    assert any(k.startswith("checkpoints/best-step") for k in saved)
    # One device resumes from the folder in object storage (`last`: the save `latest` names), and saves files there.
    resumed = run_module(
        "project.train",
        train_overrides(tiny_shards, tmp_path / "single", "trainer.max_steps=4", "ckpt_path=last", *common),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    local = read_metrics(tmp_path / "local", "train/loss")
    assert {**read_metrics(tmp_path / "fsdp2", "train/loss"), **read_metrics(tmp_path / "single", "train/loss")} == (
        pytest.approx(local, rel=1e-5)
    )
    saved = objects("checkpoints/", "Size")
    assert sorted({k.split("/")[1] for k in saved if k.split("/")[1].startswith("step-")}) == [
        "step-000003.ckpt",
        "step-000004.ckpt",
    ]
    assert read_metrics(tmp_path / "single", "checkpoint/gigabytes")[3] * 1e9 == pytest.approx(
        saved["checkpoints/step-000004.ckpt"], rel=1e-6
    )
    # Export reads the checkpoint where it lies: the same model as from a local copy of it.
    copy = tmp_path / "copy.ckpt"
    boto3.client("s3").download_file("corpus", "checkpoints/step-000004.ckpt", str(copy))
    export(f"{ckpts}/step-000004.ckpt", tmp_path / "hf-remote")
    export(str(copy), tmp_path / "hf-local")
    assert (tmp_path / "hf-remote" / "model.safetensors").read_bytes() == (
        tmp_path / "hf-local" / "model.safetensors"
    ).read_bytes()
    # No credential in what the runs wrote, there or in their folders.
    body = boto3.client("s3")
    leaks = [k for k in saved if CHECKPOINT_SECRET.encode() in body.get_object(Bucket="corpus", Key=k)["Body"].read()]
    leaks += [str(p) for p in tmp_path.rglob("*") if p.is_file() and CHECKPOINT_SECRET.encode() in p.read_bytes()]
    assert leaks == []


def test_checkpoints_refused_where_they_cannot_go_in_one_error(bucket):
    from omegaconf import OmegaConf

    from project.config.checkpoints import check_ckpt_dir

    for settings, said in [
        ({"ckpt_dir": "gs://b/c"}, "ckpt_dir=gs://b/c: checkpoints go to a local folder or to S3"),
        ({"ckpt_path": "s3:///c"}, "ckpt_path=s3:///c: checkpoints go to a local folder or to S3"),
    ]:
        with pytest.raises(ConfigError, match=said):
            check_ckpt_dir(OmegaConf.create(settings))
    fsdp = {"_target_": "project.parallel.strategies.fsdp.fsdp_strategy"}  # FSDP2's folders, as every strategy's
    check_ckpt_dir(OmegaConf.create({"ckpt_dir": "s3://b/c", "strategy": fsdp}))  # no error
    # A bucket that is not there: said before training starts (project.training.run.train asks first).
    from project.checkpoint.locations import check_reachable

    with pytest.raises(
        ConfigError, match=r"ckpt_dir=s3://no-such-bucket/c: could not reach it \(GenericError: .*404 Not Found"
    ):
        check_reachable("s3://no-such-bucket/c", "ckpt_dir")
    check_reachable(f"{bucket}/c", "ckpt_dir")


def test_a_run_killed_while_it_saves_to_object_storage_resumes_every_time(tiny_shards, bucket, tmp_path):
    """As tests/test_crashes.py kills local saves: fsdp2 writing its folder in the background to object storage,
    killed in the middle of its second save (its changes: each piece uploaded, each object put or removed, `latest`
    written), resumes from the save `latest` names, and the run ends as one never killed. (The other moments, a
    complete save not yet named and a lost `latest`, are the commit protocol's test in test_checkpoint_files.py.)"""
    from test_crashes import SAVE_RUN, assert_same_run, launch

    from project.checkpoint.files import checkpoint_step, resolve_ckpt_path

    steps = [s for s in SAVE_RUN if not s.startswith(("trainer.max_steps=", "optim.decay_steps="))]
    layout = [*steps, "strategy=fsdp2", "trainer.devices=1", "ckpt_async=true", "trainer.max_steps=8"]
    layout += ["optim.decay_steps=8"]
    reference = tmp_path / "reference"
    counted = launch("count-save-ops", tiny_shards, reference, *layout, f"ckpt_dir={bucket}/reference")
    assert counted.returncode == 0, counted.stderr[-3000:]
    changes = min(
        int(n) for s, n in re.findall(r"faults: save (\d+) of rank 0 made (\d+) changes", counted.stderr) if int(s) > 1
    )
    moments = [changes // 2]
    assert changes >= 4, f"a save makes only {changes} changes"
    run, ckpts = tmp_path / "run", f"{bucket}/killed"
    for kill in moments:  # ckpt_path=auto: the first start trains anew, the others resume from `latest`
        ended = launch(f"kill-in-save@2:{kill}", tiny_shards, run, *layout, f"ckpt_dir={ckpts}", "ckpt_path=auto")
        assert ended.returncode == -signal.SIGKILL and not ended.survivors, (
            f"killed before {kill}: {ended.stderr[-3000:]}"
        )
        found = resolve_ckpt_path("last", ckpts)  # as the next run does
        assert 1 <= checkpoint_step(found) < 8, f"killed before change {kill}"
    run_train(tiny_shards, run, *layout, f"ckpt_dir={ckpts}", "ckpt_path=last")
    assert_same_run(run, reference, (ckpts, f"{bucket}/reference"))


def test_a_failed_upload_leaves_no_object_and_only_the_folders_own_run_resumed_takes_over_its_saves(bucket):
    from project.checkpoint.latest import publish, refuse_another_runs, save_name
    from project.checkpoint.locations import exists, write_bytes, writing

    with pytest.raises(RuntimeError, match="torch failed"):
        with writing(f"{bucket}/uploads/step-000001.ckpt") as file:
            file.write(b"the first part")
            raise RuntimeError("torch failed")  # half way: the upload is abandoned, not completed
    assert not exists(f"{bucket}/uploads/step-000001.ckpt")
    refuse_another_runs(f"{bucket}/uploads", None)  # nothing saved there: a new run may start
    write_bytes(f"{bucket}/uploads/{save_name(3)}", b"a whole file")
    publish(f"{bucket}/uploads/{save_name(3)}", keep=1)
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(the latest: .*step-000003.ckpt\)"):
        refuse_another_runs(f"{bucket}/uploads", None)
    refuse_another_runs(f"{bucket}/uploads", "last")  # resuming it is what the folder is for
    refuse_another_runs(f"{bucket}/uploads", f"{bucket}/uploads/{save_name(3)}")  # and so is a save of its own
    for elsewhere in (f"{bucket}/other/{save_name(5)}", f"{bucket}/uploads-2/{save_name(5)}", "/runs/a/last.ckpt"):
        with pytest.raises(ConfigError, match=rf"which a run from ckpt_path={elsewhere}, another run's checkpoint,"):
            refuse_another_runs(f"{bucket}/uploads", elsewhere)


def test_one_local_copy_of_a_remote_file_at_a_time_and_a_remote_best_resumed_from_is_kept(bucket):
    from types import SimpleNamespace

    import torch

    from project.checkpoint.locations import local_file, use_object_storage, write_bytes
    from project.training.callbacks import BestCheckpoint

    for step in (1, 2):
        write_bytes(f"{bucket}/copies/step-{step}.ckpt", f"checkpoint {step}".encode())
    first = local_file(f"{bucket}/copies/step-1.ckpt")
    assert local_file(f"{bucket}/copies/step-1.ckpt") == first and first.read_bytes() == b"checkpoint 1"  # fetched once
    second = local_file(f"{bucket}/copies/step-2.ckpt")
    assert second.read_bytes() == b"checkpoint 2" and not first.exists()  # the one before removed
    # Lightning removes any URL a better best replaces: the best this run resumed from, and one elsewhere, stay.
    use_object_storage()  # as a run does before it builds its callbacks
    best = BestCheckpoint(dirpath=f"{bucket}/best")
    trainer = SimpleNamespace(strategy=None, is_global_zero=True, ckpt_path=f"{bucket}/best/best-step000002.ckpt")
    for name in ("best/best-step000002.ckpt", "best/best-step000004.ckpt", "elsewhere/best-step000001.ckpt"):
        write_bytes(f"{bucket}/{name}", torch.__version__.encode())
        best._remove_checkpoint(trainer, f"{bucket}/{name}")
    assert sorted([*objects("best/"), *objects("elsewhere/")]) == [
        "best/best-step000002.ckpt",
        "elsewhere/best-step000001.ckpt",
    ]

"""Shards in object storage: an S3-compatible server on loopback (moto's server mode) stands in for S3."""

import json
import os

import boto3
import pytest
from conftest import read_metrics, run_train

from project.data.prepare import prepare_shards
from project.data.storage import upload_dataset
from project.runtime.errors import ConfigError

S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def bucket():
    """A bucket on a server of our own, reached by this process and the runs it starts (the AWS_* environment)."""
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


def objects(prefix):
    listing = boto3.client("s3").list_objects_v2(Bucket="corpus", Prefix=prefix)
    return {item["Key"]: item["ETag"] for item in listing.get("Contents", [])}


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

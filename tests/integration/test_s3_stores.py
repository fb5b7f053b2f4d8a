"""What the platform reads from and writes to an S3-compatible store (moto's server on loopback):
a dataset export, a base model under an s3:// prefix, the promotion audit log."""

from __future__ import annotations

from pathlib import Path

import pytest

from clarifier.core.schema import Example
from clarifier.engine.models import ModelResolutionError, load_causal_lm, resolve_base_model
from clarifier.registry.audit import AuditLog
from support.paths import PUBLIC

pytestmark = [pytest.mark.integration]


@pytest.mark.skipif(not (PUBLIC / "claqua").is_dir(),
                    reason=f"public datasets not found at {PUBLIC} (../shared beside the repository)")
def test_export_to_s3_prefix(s3_bucket):
    from clarifier.runtime import storage
    from clarifier.data.importers.export import export_dataset

    out = f"s3://{s3_bucket}/public/claqua"
    report = export_dataset("claqua", PUBLIC / "claqua", out, {"variants": "single-turn", "splits": "dev"})
    assert report["examples"] == 853 and report["clarify"] == 431 and report["skipped"] == 0
    files = storage.list_files(out)
    assert files == [f"{out}/claqua-dev.jsonl", f"{out}/claqua-import-report.json"]
    lines = storage.read_text(f"{out}/claqua-dev.jsonl").splitlines()
    assert len(lines) == 853 and Example.model_validate_json(lines[0]).id == "claqua-single-turn-dev-t1-1"


@pytest.mark.timeout(180)
def test_s3_prefix_is_downloaded_once(tiny_model_dir, s3_bucket, tmp_path):
    from clarifier.runtime import storage

    uri = f"s3://{s3_bucket}/models/tiny"
    assert storage.upload_dir(tiny_model_dir, uri) >= 3
    path = resolve_base_model(uri, tmp_path)
    assert (Path(path) / "config.json").is_file() and (Path(path) / "model.safetensors").is_file()
    assert load_causal_lm(path).config.hidden_size == 64
    assert resolve_base_model(uri, tmp_path) == path  # cached
    with pytest.raises(ModelResolutionError, match="no objects"):
        resolve_base_model(f"s3://{s3_bucket}/models/missing", tmp_path)


def test_s3_audit_log_one_object_per_record(s3_bucket):
    import boto3

    log = AuditLog(f"s3://{s3_bucket}/clarifier/registry/audit")
    assert log.records() == []
    log.append({"model": "m", "alias": "champion", "decision": "promoted", "to_version": "1"})
    log.append({"model": "m", "alias": "champion", "decision": "refused"})
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=s3_bucket)["Contents"]
            if not o["Key"].endswith("/")]  # pyarrow also writes folder markers
    assert len(keys) == 2 and all(k.startswith("clarifier/registry/audit/") and k.endswith(".jsonl") for k in keys)
    assert [r["decision"] for r in log.records(model="m")] == ["promoted", "refused"]


@pytest.mark.skipif(not (PUBLIC / "clariq").is_dir(),
                    reason=f"public datasets not found at {PUBLIC} (../shared beside the repository)")
def test_dataset_ref_read_from_an_s3_mirror_and_verified(s3_bucket, tmp_path, monkeypatch):
    from clarifier.core.config import build_config
    from clarifier.data.datasets import DatasetError, DatasetNotFound
    from clarifier.data.sources import materialize_sources
    from clarifier.runtime import storage

    monkeypatch.setenv("CLARIFIER_CACHE", str(tmp_path / "cache"))  # an empty download cache
    mirror = f"s3://{s3_bucket}/public"
    assert storage.upload_dir(PUBLIC / "clariq", f"{mirror}/clariq") == 4

    def run(name: str):
        cfg = build_config({"data": {"input": str(tmp_path / name), "mirror": mirror,
                                     "sources": [{"importer": "clariq", "src": "dataset:clariq", "max_examples": 5}]}})
        return materialize_sources(cfg.data, lambda m: None)["clariq"]

    rep = run("in")
    assert rep["read_from"] == f"{mirror}/clariq" and rep["imported"] == 237 and rep["kept"] == 5
    storage.write_text(f"{mirror}/clariq/README.md", "not the published README\n")  # downloaded, then checked
    with pytest.raises(DatasetError, match=r"data.sources\[clariq\]: the copy of clariq in s3://.*/public/clariq does "
                                           r"not match the registry: README.md has 25 bytes, expected 33225"):
        run("in2")
    import boto3

    boto3.client("s3").delete_object(Bucket=s3_bucket, Key="public/clariq/train.tsv")
    with pytest.raises(DatasetNotFound, match=r"mirror s3://.*/public/clariq: train.tsv missing; download cache"):
        run("in3")


def test_a_missing_bucket_is_named_with_the_endpoint(s3_bucket):
    """A mistyped bucket says so (and where it looked), not only that the path does not exist."""
    from clarifier.cli import _hint
    from clarifier.runtime import storage

    with pytest.raises(FileNotFoundError) as info:
        storage.list_files(f"s3://{s3_bucket}-typo/logs")
    assert f"bucket '{s3_bucket}-typo' does not exist at {storage.s3_endpoint()}" in str(info.value)
    assert "create the bucket" in _hint(info.value)
    with pytest.raises(FileNotFoundError) as info:  # the bucket is there, the prefix is not
        storage.list_files(f"s3://{s3_bucket}/no/such/prefix")
    assert "bucket" not in str(info.value)

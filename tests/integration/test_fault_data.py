"""Fault: the S3-compatible store goes away in the middle of a data job.

The job retries (the S3 client's standard retry strategy, then Ray Data's own retries of IO errors
with exponential backoff: ten attempts, up to 32 s apart, about three minutes here), then fails with a ``DataJobError`` naming input and output; no manifest is written so
readers refuse the half-written output; once the store is back a rerun completes and its output is
identical to that of an uninterrupted run.
"""

from __future__ import annotations

import time

import pyarrow.dataset as pads
import pytest

from clarifier.runtime import storage
from clarifier.core.config import build_config
from clarifier.data.pipeline import DataJobError, prepare
from clarifier.data.outputs import read_manifest
from clarifier.data.synthetic import write_logs

pytestmark = [pytest.mark.integration, pytest.mark.reliability]


@pytest.fixture
def own_s3(monkeypatch):
    """A moto S3 server of this test's own, which the test can stop and restart on the same port."""
    from support.s3 import RestartableS3

    s3 = RestartableS3()
    for k, v in s3.env(CLARIFIER_S3_MAX_ATTEMPTS="3").items():
        monkeypatch.setenv(k, v)
    yield {"url": s3.url, "stop": s3.stop, "start": s3.start}
    s3.stop()


def _rows(uri: str, split: str) -> list[dict]:
    fs, path = storage.filesystem(storage.join(uri, split))
    t = pads.dataset(path, filesystem=fs, format="parquet").to_table(
        columns=["id", "split", "example_json", "input_ids", "labels"])
    return sorted(t.to_pylist(), key=lambda r: r["id"])


@pytest.mark.timeout(420)
def test_store_outage_fails_cleanly_and_rerun_matches(own_s3, ray_own, tiny_model_dir, reliability):
    import boto3

    boto3.client("s3", endpoint_url=own_s3["url"]).create_bucket(Bucket="faults")
    base = "s3://faults"
    write_logs(f"{base}/logs", 24, seed=4, shards=3)

    def cfg(out):
        return build_config({}, [f"data.input={base}/logs", f"data.output={base}/{out}",
                                 f"model.base_model={tiny_model_dir}"])

    reference = prepare(cfg("reference"), progress=lambda s: None)

    seen: list[str] = []
    t: dict[str, float] = {}

    def progress(msg: str) -> None:
        seen.append(msg)
        if msg.startswith("[data] read "):  # input parsed; the store dies before anything is written
            own_s3["stop"]()
            t["down"] = time.time()

    with pytest.raises(DataJobError) as info:
        prepare(cfg("faulty"), progress=progress)
    t["failed"] = time.time()
    msg = str(info.value)
    assert f"{base}/logs" in msg and f"{base}/faulty" in msg and "no manifest" in msg
    assert any(m.startswith("[data] read ") for m in seen)

    own_s3["start"]()
    t["up"] = time.time()
    with pytest.raises(FileNotFoundError, match="has not finished"):
        read_manifest(f"{base}/faulty")  # nothing is marked complete

    rerun = prepare(cfg("faulty"), progress=lambda s: None)
    t["recovered"] = time.time()
    assert rerun["counts"] == reference["counts"]
    assert read_manifest(f"{base}/faulty")["counts"] == reference["counts"]
    for split, c in reference["counts"]["splits"].items():
        if c["examples"]:
            assert _rows(f"{base}/faulty", split) == _rows(f"{base}/reference", split)
    rows = sum(c["examples"] for c in reference["counts"]["splits"].values())
    reliability(fault="S3 store unavailable mid data job",
                injected="S3 server (moto) stopped after the input was parsed, before any output was written; "
                         "restarted after the job failed",
                at_risk=f"{rows} output rows", lost="0 rows (no partial output is readable: no manifest)",
                recovered=f"{rows} rows, identical to an uninterrupted run, by a rerun once the store was back "
                          f"(the faulty job failed cleanly after {t['failed'] - t['down']:.0f} s of retries)",
                time_to_recover_s=round(t["recovered"] - t["up"], 1))

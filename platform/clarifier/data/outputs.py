"""What the data job writes, as every later stage reads it: the folder layout, column lists, the
manifest and the split readers. The job itself (:mod:`clarifier.data.pipeline`) writes these;
training, evaluation and recipes read them here, without importing the job.

    <data.output>/manifest.json          written last: its presence means the job finished
    <data.output>/<split>/*.parquet      SPLIT_COLUMNS (train, dev, test)
    <data.output>/train_packed/          packed train rows (data.packing.enabled)
    <data.output>/quarantine/            QUARANTINE_COLUMNS: malformed lines, with the reason
    <data.output>/filtered/              FILTERED_COLUMNS: valid turns dropped by a rule, with the reason
"""

from __future__ import annotations

import json

import pyarrow as pa

from clarifier.core.schema import Example
from clarifier.runtime import storage

QUARANTINE_DIR = "quarantine"
FILTERED_DIR = "filtered"
PACKED_DIR = "train_packed"
MANIFEST = "manifest.json"
SPLIT_COLUMNS = [
    "id", "conversation_id", "split", "example_json", "needs_clarification", "data_source",
    "input_ids", "labels", "loss_weights", "segment_ids", "num_tokens",
]
QUARANTINE_COLUMNS = ["source", "line", "reason", "raw"]
FILTERED_COLUMNS = ["source", "line", "reason", "raw", "id", "conversation_id", "split"]


def read_manifest(output_uri: str) -> dict:
    """The manifest of a finished data job (``FileNotFoundError`` when the job never finished)."""
    uri = storage.join(output_uri, MANIFEST)
    if not storage.exists(uri):
        raise FileNotFoundError(f"no {MANIFEST} under {output_uri}: the data job has not finished there")
    return json.loads(storage.read_text(uri))


def read_split_table(output_uri: str, split: str, columns: list[str] | None = None) -> pa.Table:
    """A split's Parquet as one Arrow table (empty table when the split has no examples)."""
    import pyarrow.dataset as pads

    fs, path = storage.filesystem(storage.join(output_uri, split))
    if fs.get_file_info(path).type.name == "NotFound":
        return pa.table({c: [] for c in (columns or SPLIT_COLUMNS)})
    return pads.dataset(path, filesystem=fs, format="parquet").to_table(columns=columns)


def load_split(output_uri: str, split: str) -> list[Example]:
    """The Examples of one split (sorted by id), as written by :func:`prepare`."""
    read_manifest(output_uri)  # refuse a half-written output
    table = read_split_table(output_uri, split, ["id", "example_json"])
    pairs = sorted(zip(table.column("id").to_pylist(), table.column("example_json").to_pylist()))
    return [Example.model_validate_json(js) for _, js in pairs]

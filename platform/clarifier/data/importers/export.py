"""Write an import as evaluation-set JSONL (local file/folder or ``s3://``) plus a report.

    report = export_dataset("pacific", "/data/public/pacific", "out/", {"passages": "false"})

``out`` ending in ``.jsonl`` is one file holding every example; anything else is a folder /
prefix that gets one ``<dataset>-<split>.jsonl`` per source split (``meta.split``). Beside the data
goes ``<dataset>-import-report.json`` (folder) or ``<file stem>.import-report.json`` (file): the
counts (per label, per split, skipped by reason) and every skipped record with its reason and
location. Examples are streamed to the output as the importer yields them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from clarifier.runtime import storage
from clarifier.data.importers import get_importer
from clarifier.data.importers.base import Skipped, label_key, summarize

REPORT_SUFFIX = "import-report.json"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "all"


class _Writers:
    def __init__(self):
        self.streams: dict[str, Any] = {}

    def write(self, uri: str, line: str) -> None:
        f = self.streams.get(uri)
        if f is None:
            fs, path = storage.filesystem(uri)
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
            f = self.streams[uri] = fs.open_output_stream(path)
        f.write(line.encode("utf-8"))

    def close(self) -> None:
        for f in self.streams.values():
            f.close()


def export_dataset(name: str, src: str | Path, out: str, options: Mapping[str, Any] | None = None,
                   progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Import ``src`` with importer ``name`` and write JSONL + report; returns the report (counts, files)."""
    imp = get_importer(name)
    opts = imp.parse_options(options)
    items = imp.run(Path(src), opts)  # validates the source before anything is written
    single = out.endswith(".jsonl")
    if single:
        report_uri = out[: -len(".jsonl")] + "." + REPORT_SUFFIX
    else:
        report_uri = storage.join(out, f"{imp.name}-{REPORT_SUFFIX}")
    writers = _Writers()
    files: dict[str, int] = {}
    counted: list[tuple[str, bool]] = []
    skipped: list[Skipped] = []
    try:
        for item in items:
            if isinstance(item, Skipped):
                skipped.append(item)
                continue
            uri = out if single else storage.join(out, f"{imp.name}-{_safe(str(item.meta.get('split') or 'all'))}.jsonl")
            writers.write(uri, item.model_dump_json(exclude_none=False) + "\n")
            files[uri] = files.get(uri, 0) + 1
            counted.append(label_key(item))  # only what the counts need, not whole examples
            if len(counted) % 5000 == 0:
                progress(f"[import] {len(counted)} examples written")
    finally:
        writers.close()
    report = summarize(imp.name, imp.unit, counted, skipped)
    report.update(source=str(src), options=opts.model_dump(mode="json"), files=files,
                  report=report_uri, skipped_records=[{"reason": s.reason, "where": s.where, "detail": s.detail}
                                                      for s in skipped])
    storage.write_text(report_uri, json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return report

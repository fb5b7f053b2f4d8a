"""Record a `clarifier quickstart` run as a result file (the README's quick start shows the recorded run).

    .venv/bin/python benchmarks/quickstart/record.py --out benchmarks/results/quickstart-<date>.json
        runs `clarifier quickstart --workdir .clarifier/quickstart-bench` (~15 min on 2 cores) and records it
    .venv/bin/python benchmarks/quickstart/record.py --summary .clarifier/quickstart/summary.json --out ...
        records a run that already happened on this machine (its summary.json; wall time from the summary)

The result holds the machine, the code version, the quickstart's summary (decision F1 / recall / over-asking of
the trained model and each baseline, within-source AUROC, LoRA steps, seconds) and the lines it ended with.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import result_file, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="Result JSON, e.g. benchmarks/results/quickstart-2026-12-06.json "
                                                 "(never overwritten).")
    ap.add_argument("--summary", type=Path, help="summary.json of a run that already happened (else: run one now).")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".clarifier" / "quickstart-bench",
                    help="Where a new run writes (its --workdir).")
    ap.add_argument("--note", default=None, help="What else was true of the run (e.g. other work on the machine).")
    ap.add_argument("overrides", nargs="*", help="Config overrides passed to the quickstart.")
    a = ap.parse_args()
    result_file("quickstart", a.out)  # refused now, before a 15-minute run, if the file exists
    summary_path = a.summary
    if summary_path is None:
        exe = Path(sys.executable).with_name("clarifier")
        proc = subprocess.run([str(exe), "quickstart", "--workdir", str(a.workdir), *a.overrides], cwd=ROOT)
        if proc.returncode != 0:
            sys.exit(f"error: clarifier quickstart exited {proc.returncode}; nothing recorded")
        summary_path = a.workdir / "summary.json"
    if not summary_path.is_file():
        sys.exit(f"error: {summary_path} does not exist (a quickstart run writes it at the end)")
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    for key in ("decision_f1", "recall", "over_asking_rate", "within_source_auroc", "seconds", "n_test"):
        if key not in summary:
            sys.exit(f"error: {summary_path} has no {key!r}: not a quickstart summary")
    from clarifier.cli import verdict_lines
    from clarifier.quickstart import result_lines

    summary = {k: v for k, v in summary.items() if k not in ("model_dir", "report")}  # paths of that machine
    path = write_result("quickstart", {"summary": summary, "summary_file": str(summary_path), "note": a.note,
                                       "lines": result_lines(summary) + [line for line, _ in verdict_lines(summary)]},
                        a.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

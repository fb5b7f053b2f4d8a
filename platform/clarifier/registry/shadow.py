"""Live evidence for the promotion gate: the challenger as the shadow model, read back from the request log.

With ``serve.shadow_model_uri`` the request log keeps, for every shadowed request, the champion's answer
(``meta.served``) and the challenger's (``meta.shadow``) on the query turn (clarifier.serving.request_log).
:func:`shadow_stats` compares them for one (challenger, champion) pair of versions: how many requests both
answered, the share each flagged as needing clarification, and -- of the turns the champion judged
clear -- the share the challenger also judged clear. ``clarifier models promote ... --shadow-log <uri>``
adds criteria on these to the gate (``registry.gate.shadow_*``), recorded in the audit log like the others.
"""

from __future__ import annotations

import json
from typing import Iterable, Iterator

from clarifier.data.validate import read_lines
from clarifier.runtime import storage


def read_records(uri: str) -> Iterator[dict]:
    """Every record of a request log (folder, file or ``s3://`` prefix of ``.jsonl[.gz]`` shards); a line that
    is not JSON is skipped (the data job is where bad lines are quarantined and reported)."""
    for f in storage.list_files(uri, (".jsonl", ".jsonl.gz")):
        for line in read_lines(*storage.filesystem(f)):
            if line.strip():
                try:
                    yield json.loads(line)
                except ValueError:
                    continue


def shadow_stats(records: Iterable[dict], challenger: str, champion: str | None) -> dict:
    """Champion vs shadow on the requests where ``challenger`` (a model version, e.g. ``clarifier/4``) was the
    shadow and, when given, ``champion`` answered."""
    n = flagged_champion = flagged_challenger = clear = clear_agree = failed = 0
    for rec in records:
        query = (rec.get("turns") or [{}])[-1]
        meta = query.get("meta") or {}
        served, shadow = meta.get("served"), meta.get("shadow")
        if not served or not shadow:
            continue
        if champion is not None and served.get("model_version") != champion:
            continue
        if "error" in shadow:  # the shadow call failed or timed out: no answer to compare
            failed += 1
            continue
        if shadow.get("model_version") != challenger:
            continue
        n += 1
        a, b = bool(served.get("needs_clarification")), bool(shadow.get("needs_clarification"))
        flagged_champion += a
        flagged_challenger += b
        if not a:
            clear += 1
            clear_agree += not b
    share = (lambda k, m: k / m if m else None)
    return {"challenger": challenger, "champion": champion, "requests": n, "failed": failed,
            "champion_flag_share": share(flagged_champion, n), "challenger_flag_share": share(flagged_challenger, n),
            "champion_clear": clear, "clear_agreement": share(clear_agree, clear)}

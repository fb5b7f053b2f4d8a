"""Live evidence for the gate: champion vs shadow challenger from request-log records (clarifier.registry.shadow)."""

from __future__ import annotations

import gzip
import json

from clarifier.core.config import GateConfig
from clarifier.core.schema import ClarifyRequest, ClarifyResponse
from clarifier.registry.promotion import shadow_criteria
from clarifier.registry.shadow import read_records, shadow_stats
from clarifier.core.request_record import answer_fields, request_record


def _rec(champ_asks: bool, shadow_asks: bool | None, champ="m/1", chal="m/2", error=None) -> dict:
    resp = ClarifyResponse(needs_clarification=champ_asks, confidence=0.9 if champ_asks else 0.1,
                           question="Which one?" if champ_asks else None, model_version=champ)
    shadow = None
    if error:
        shadow = {"error": error}
    elif shadow_asks is not None:
        shadow = answer_fields(ClarifyResponse(needs_clarification=shadow_asks, confidence=0.5,
                                               question="Which?" if shadow_asks else None, model_version=chal))
    return request_record(ClarifyRequest(query="reset it"), resp, route="clarify", request_id="r", at=0, shadow=shadow)


def test_flag_shares_and_agreement_on_clear_turns():
    recs = ([_rec(False, False)] * 80 + [_rec(False, True)] * 10 + [_rec(True, True)] * 10
            + [_rec(True, None)] * 5 + [_rec(False, False, champ="m/0")] * 7 + [_rec(False, False, chal="m/9")] * 3
            + [_rec(False, None, error="timeout")] * 2)
    s = shadow_stats(recs, "m/2", "m/1")
    assert s["requests"] == 100 and s["failed"] == 2 and s["champion_clear"] == 90
    assert s["champion_flag_share"] == 0.10 and s["challenger_flag_share"] == 0.20
    assert abs(s["clear_agreement"] - 80 / 90) < 1e-12

    crit = {c.name: c for c in shadow_criteria(s, GateConfig())}
    assert crit["shadow_min_requests"].passed
    assert not crit["shadow_max_flag_increase"].passed and "increase +0.1000 > 0.05" in crit["shadow_max_flag_increase"].rule
    assert not crit["shadow_min_clear_agreement"].passed
    loose = {c.name: c.passed for c in shadow_criteria(s, GateConfig(shadow_max_flag_increase=0.2,
                                                                        shadow_min_clear_agreement=0.85))}
    assert loose == {"shadow_min_requests": True, "shadow_max_flag_increase": True, "shadow_min_clear_agreement": True}


def test_too_little_live_evidence_fails_and_says_so():
    s = shadow_stats([_rec(False, False)] * 3, "m/2", "m/1")
    (only,) = shadow_criteria(s, GateConfig(shadow_min_requests=50))
    assert not only.passed and "3 shadowed requests of m/2 against m/1" in only.rule


def test_records_are_read_from_gzip_and_plain_shards(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl.gz").write_bytes(gzip.compress((json.dumps(_rec(False, False)) + "\n").encode()))
    (tmp_path / "d" / "b.jsonl").write_text(json.dumps(_rec(True, True)) + "\nnot json\n")
    assert shadow_stats(read_records(str(tmp_path)), "m/2", "m/1")["requests"] == 2

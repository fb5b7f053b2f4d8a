"""The promotion gate's criteria (pure) and the append-only audit log in a local file (S3: integration tests)."""

from __future__ import annotations

import json

import pytest

from clarifier.core.config import GateConfig, build_config
from clarifier.registry.audit import AuditLog, AuditLogError, alias_history
from clarifier.registry.promotion import gate_decision

GATE = GateConfig(max_f1_drop=0.01, max_over_asking=0.3, min_validity=0.95)


def _m(f1, oa, validity=1.0):
    return {"f1": f1, "over_asking_rate": oa, "validity": validity}


def _by_name(result):
    return {c.name: c for c in result.criteria}


def test_better_challenger_passes_every_criterion():
    r = gate_decision(_m(0.80, 0.20), _m(0.75, 0.25), GATE)
    assert r.promote and not r.failed
    c = _by_name(r)
    assert set(c) == {"max_f1_drop", "max_over_asking", "min_validity"}
    assert c["max_f1_drop"].value == pytest.approx(-0.05)


def test_f1_drop_within_tolerance_passes_beyond_fails():
    assert gate_decision(_m(0.745, 0.2), _m(0.75, 0.2), GATE).promote  # drop 0.005 <= 0.01
    r = gate_decision(_m(0.70, 0.2), _m(0.75, 0.2), GATE)
    assert not r.promote and [c.name for c in r.failed] == ["max_f1_drop"]
    assert "drop +0.0500 > 0.01" in r.summary()


def test_absolute_thresholds_fail_independently():
    r = gate_decision(_m(0.9, 0.5, validity=0.9), _m(0.5, 0.1), GATE)
    assert not r.promote
    assert {c.name for c in r.failed} == {"max_over_asking", "min_validity"}
    assert _by_name(r)["max_f1_drop"].passed


def test_no_champion_only_absolute_criteria_apply():
    r = gate_decision(_m(0.10, 0.2), None, GATE)
    assert r.promote
    c = _by_name(r)
    assert c["max_f1_drop"].skipped and c["max_f1_drop"].passed
    r = gate_decision(_m(0.10, 0.2), None, GATE.model_copy(update={"min_f1": 0.5}))
    assert not r.promote and [x.name for x in r.failed] == ["min_f1"]


def test_over_asking_increase_and_missing_metrics():
    gate = GateConfig(max_f1_drop=None, max_over_asking=None, min_validity=None, max_over_asking_increase=0.02)
    assert gate_decision(_m(0.5, 0.21), _m(0.5, 0.20), gate).promote
    assert not gate_decision(_m(0.5, 0.25), _m(0.5, 0.20), gate).promote
    r = gate_decision({"f1": 0.9}, _m(0.5, 0.2), GATE)  # challenger lacks over-asking and validity
    assert not r.promote and {c.name for c in r.failed} == {"max_over_asking", "min_validity"}
    assert "challenger has no validity metric" in r.summary()


def test_gate_config_is_typed_and_named_in_errors():
    cfg = build_config({}, ["registry.gate.max_f1_drop=0.05", "registry.gate.max_over_asking=null"])
    assert cfg.registry.gate.max_f1_drop == 0.05 and cfg.registry.gate.max_over_asking is None
    with pytest.raises(ValueError, match="registry.gate.min_validity"):
        build_config({}, ["registry.gate.min_validity=2"])
    with pytest.raises(ValueError, match="registry.gate.max_f1_dorp"):
        build_config({}, ["registry.gate.max_f1_dorp=0.1"])


# ---- audit log ---------------------------------------------------------------------------------


def test_local_audit_log_appends_and_never_rewrites(tmp_path):
    log = AuditLog(str(tmp_path / "reg" / "audit.jsonl"))
    assert log.records() == []
    a = log.append({"model": "m", "alias": "champion", "decision": "refused"})
    first_line = (tmp_path / "reg" / "audit.jsonl").read_text()
    log.append({"model": "m", "alias": "champion", "decision": "promoted", "to_version": "2"})
    log.append({"model": "other", "alias": "champion", "decision": "promoted"})
    text = (tmp_path / "reg" / "audit.jsonl").read_text()
    assert text.startswith(first_line) and len(text.splitlines()) == 3
    recs = log.records(model="m")
    assert [r["decision"] for r in recs] == ["refused", "promoted"]
    assert recs[0]["id"] == a["id"] and "time" in recs[0]
    assert all(json.loads(line) for line in text.splitlines())


def test_corrupt_audit_line_is_an_error_naming_the_line(tmp_path):
    p = tmp_path / "audit.jsonl"
    p.write_text('{"model": "m"}\nnot json\n')
    with pytest.raises(AuditLogError, match=r"audit.jsonl:2 is not valid JSON"):
        AuditLog(str(p)).records()


def test_alias_history_stack():
    recs = [
        {"decision": "promoted", "previous_version": "1", "to_version": "2"},  # v1 set outside the gate
        {"decision": "refused", "previous_version": "2", "to_version": "2"},
        {"decision": "promoted", "previous_version": "2", "to_version": "3"},
        {"decision": "rolled_back", "from_version": "3", "to_version": "2"},
        {"decision": "promoted", "previous_version": "2", "to_version": "4"},
    ]
    assert alias_history(recs) == ["1", "2", "4"]
    assert alias_history(recs[:4]) == ["1", "2"]
    assert alias_history([{"decision": "promoted", "previous_version": None, "to_version": "1"}]) == ["1"]

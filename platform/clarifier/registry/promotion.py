"""Promotion through the MLflow registry: a metrics gate, alias moves, rollback, every decision audited.

    clarifier models promote clarifier --from challenger --to champion [--data eval.jsonl]
    clarifier models rollback clarifier [--alias champion]

**The gate.** Challenger (the version behind ``--from``, or ``--version``) and champion (the
version behind ``--to``, if any) are compared on the *same* evaluation set:

* with ``--data``: the set is read and fingerprinted; a version that already has metrics logged
  for that fingerprint (tag ``eval.sets.<fp>``) reuses them, otherwise it is evaluated now
  (``clarifier eval`` without the zero-shot base-model baseline) and the metrics are tagged on it;
* without ``--data``: both versions' logged metrics on a common evaluation set are used (the
  challenger's registration eval set first); no common set is an error that says to pass ``--data``.

The criteria (``registry.gate``, :class:`clarifier.core.config.GateConfig`) are relative to the champion
(``max_f1_drop``, ``max_over_asking_increase``; skipped when there is no champion) and absolute
(``min_f1``, ``max_over_asking``, ``min_validity``). The alias moves only when every criterion
holds. Either way the decision and its evidence are tagged on the challenger
(``gate.<alias>.decision`` / ``.time`` / ``.against`` / ``.evidence``) and appended to the audit log
(:mod:`clarifier.registry.audit`) -- one record per decision, with both versions' metrics and each
criterion's pass/fail. Aliases are the only promotion mechanism (no stages).

**Rollback** points the alias back at the version it held before, as recorded in the audit log
(promotions push, rollbacks pop), and audits that too.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from clarifier.core.config import ClarifierConfig, GateConfig
from clarifier.registry.audit import AuditLog, alias_history, current_user, default_location, utc_now
from clarifier.registry.registry import _client, _not_found, eval_set_tags, key_metrics, logged_eval_sets
from clarifier.runtime.mlflow_uri import tracking_uri as resolve_tracking_uri

TAG_LIMIT = 5000  # characters of JSON evidence kept in a tag (MLflow caps tag values)


class PromotionError(RuntimeError):
    """Promotion or rollback cannot be decided; the message says what is missing and what to do."""


@dataclass
class Criterion:
    name: str
    passed: bool
    value: float | None
    limit: float | None
    rule: str
    skipped: bool = False  # relative criterion without a champion: not applicable, counts as passed


@dataclass
class GateResult:
    criteria: list[Criterion] = field(default_factory=list)

    @property
    def promote(self) -> bool:
        """Every criterion holds (a skipped one counts as passed)."""
        return all(c.passed for c in self.criteria)

    @property
    def failed(self) -> list[Criterion]:
        return [c for c in self.criteria if not c.passed]

    def summary(self) -> str:
        if self.promote:
            return "all criteria hold"
        return "; ".join(f"{c.name}: {c.rule}" for c in self.failed)


def _num(metrics: dict, key: str) -> float | None:
    v = (metrics or {}).get(key)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return float(v)


def gate_decision(challenger: dict, champion: dict | None, gate: GateConfig) -> GateResult:
    """Pure: apply ``gate`` to key metrics (``f1``, ``over_asking_rate``, ``validity``) of both versions.

    ``champion`` None means there is no champion yet: relative criteria are skipped (reported,
    counted as passed) and only the absolute thresholds apply. A metric the challenger lacks fails
    its criterion.
    """
    out: list[Criterion] = []
    f1, oa, val = _num(challenger, "f1"), _num(challenger, "over_asking_rate"), _num(challenger, "validity")

    def missing(name, key, limit):
        return Criterion(name, False, None, limit, f"challenger has no {key} metric")

    # Relative criteria: how much worse than the champion the challenger may be on one metric.
    # ``sign`` turns "worse" into a positive number (F1 drop = champion - challenger; over-asking
    # increase = challenger - champion).
    for name, key, label, what, limit, sign in (
        ("max_f1_drop", "f1", "F1", "drop", gate.max_f1_drop, -1.0),
        ("max_over_asking_increase", "over_asking_rate", "over-asking", "increase", gate.max_over_asking_increase, 1.0),
    ):
        if limit is None:
            continue
        v = {"f1": f1, "over_asking_rate": oa}[key]
        if champion is None:
            out.append(Criterion(name, True, v, None, "no champion: not applicable", skipped=True))
            continue
        c_v = _num(champion, key)
        if v is None:
            out.append(missing(name, key, limit))
        elif c_v is None:
            out.append(Criterion(name, False, v, None, f"champion has no {key} metric to compare with"))
        else:
            worse = sign * (v - c_v)
            ok = worse <= limit + 1e-12
            out.append(Criterion(name, ok, worse, limit,
                                 f"{label} {v:.4f} vs champion {c_v:.4f}: {what} {worse:+.4f} "
                                 f"{'<=' if ok else '>'} {limit}"))
    for name, key, limit, floor in (("min_f1", "f1", gate.min_f1, True),
                                    ("max_over_asking", "over_asking_rate", gate.max_over_asking, False),
                                    ("min_validity", "validity", gate.min_validity, True)):
        if limit is None:
            continue
        v = {"f1": f1, "over_asking_rate": oa, "validity": val}[key]
        if v is None:
            out.append(missing(name, key, limit))
            continue
        ok = v >= limit - 1e-12 if floor else v <= limit + 1e-12
        op = (">=" if ok else "<") if floor else ("<=" if ok else ">")
        out.append(Criterion(name, ok, v, limit, f"{key} {v:.4f} {op} {limit}"))
    return GateResult(out)


def shadow_criteria(stats: dict, gate: GateConfig) -> list[Criterion]:
    """Pure: the gate's live-evidence criteria on :func:`clarifier.registry.shadow.shadow_stats`."""
    out: list[Criterion] = []
    n = stats["requests"]
    if n < gate.shadow_min_requests:
        out.append(Criterion("shadow_min_requests", False, float(n), float(gate.shadow_min_requests),
                             f"{n} shadowed requests of {stats['challenger']} against {stats['champion']} in the "
                             f"request log < {gate.shadow_min_requests}: too little live evidence"))
        return out
    out.append(Criterion("shadow_min_requests", True, float(n), float(gate.shadow_min_requests),
                         f"{n} shadowed requests >= {gate.shadow_min_requests}"))
    if gate.shadow_max_flag_increase is not None:
        inc = stats["challenger_flag_share"] - stats["champion_flag_share"]
        ok = inc <= gate.shadow_max_flag_increase + 1e-12
        out.append(Criterion("shadow_max_flag_increase", ok, inc, gate.shadow_max_flag_increase,
                             f"live flagged share {stats['challenger_flag_share']:.4f} vs champion "
                             f"{stats['champion_flag_share']:.4f}: increase {inc:+.4f} "
                             f"{'<=' if ok else '>'} {gate.shadow_max_flag_increase}"))
    if gate.shadow_min_clear_agreement is not None:
        agree = stats["clear_agreement"]
        if agree is None:
            out.append(Criterion("shadow_min_clear_agreement", False, None, gate.shadow_min_clear_agreement,
                                 "the champion judged no shadowed turn clear: agreement on clear turns unknown"))
        else:
            ok = agree >= gate.shadow_min_clear_agreement - 1e-12
            out.append(Criterion("shadow_min_clear_agreement", ok, agree, gate.shadow_min_clear_agreement,
                                 f"agreement on the {stats['champion_clear']} live turns the champion judged clear "
                                 f"{agree:.4f} {'>=' if ok else '<'} {gate.shadow_min_clear_agreement}"))
    return out


# ---- the registry side ---------------------------------------------------------------------------


def audit_log_for(cfg: ClarifierConfig) -> AuditLog:
    return AuditLog(cfg.registry.audit_log or default_location(cfg.storage.root))


def _version_by_alias(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if not _not_found(exc):  # an outage is not "no champion yet"
            raise
        return None


def _get_version(client, name: str, version: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(name, str(version))
    except MlflowException as exc:
        if not _not_found(exc):
            raise
        raise PromotionError(f"model {name!r} has no version {version} ({exc.message if hasattr(exc, 'message') else exc})") from None


def _common_logged_set(challenger_tags: dict, champion_tags: dict | None) -> dict | None:
    """The evaluation set both versions have metrics for (challenger's primary set first)."""
    ch = logged_eval_sets(challenger_tags)
    if not ch:
        return None
    primary = challenger_tags.get("eval.data_fingerprint")
    order = ([primary] if primary in ch else []) + [fp for fp in ch if fp != primary]
    if champion_tags is None:
        return ch[order[0]]
    cp = logged_eval_sets(champion_tags)
    for fp in order:
        if fp in cp:
            return ch[fp]
    return None


def _evaluate_version(cfg: ClarifierConfig, name: str, version: str, data: str, out_dir: Path, progress) -> dict:
    from clarifier.evaluation.evaluate import evaluate

    gate_cfg = cfg.model_copy(deep=True)
    gate_cfg.eval.baselines = [b for b in cfg.eval.baselines if b != "base_model"]
    report = evaluate(gate_cfg, f"models:/{name}/{version}", data, out_dir=str(out_dir), progress=progress)
    return report


def _evidence_tag(obj: dict) -> str:
    text = json.dumps(obj, separators=(",", ":"), default=str)
    return text if len(text) <= TAG_LIMIT else text[: TAG_LIMIT - 3] + "..."


@dataclass
class PromotionDecision:
    model: str
    alias: str
    decision: str  # "promoted" | "refused"
    challenger_version: str
    champion_version: str | None
    gate: GateResult
    challenger_metrics: dict
    champion_metrics: dict | None
    eval_set: dict
    record: dict


def promote(cfg: ClarifierConfig, name: str, *, to_alias: str = "champion", from_alias: str | None = None,
            version: str | None = None, data: str | None = None, user: str | None = None,
            shadow_log: str | None = None, progress: Callable[[str], None] = print) -> PromotionDecision:
    """Run the promotion gate for ``name``: move ``to_alias`` to the challenger only if every criterion holds.

    The challenger is ``version`` or the version behind ``from_alias``. ``shadow_log``: a request log the
    challenger was the shadow model in; its live comparison with the champion adds the
    ``registry.gate.shadow_*`` criteria (:mod:`clarifier.registry.shadow`). See the module docstring.
    """
    from clarifier.runtime import storage

    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    tracking_uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    client = _client(tracking_uri)
    if not (from_alias or version):
        raise PromotionError("say which version to promote: --from ALIAS or --version N")
    if from_alias:
        mv = _version_by_alias(client, name, from_alias)
        if mv is None:
            raise PromotionError(f"model {name!r} has no alias {from_alias!r} (set it with "
                                 f"`clarifier models register --alias {from_alias}` or pass --version)")
    else:
        mv = _get_version(client, name, str(version))
    if from_alias and from_alias == to_alias:
        raise PromotionError(f"--from and --to are both {to_alias!r}")
    champ = _version_by_alias(client, name, to_alias)
    if champ is not None and str(champ.version) == str(mv.version):
        raise PromotionError(f"{name}@{to_alias} already points at version {mv.version}; nothing to promote")

    # ---- metrics of both on one evaluation set ----
    sources = {}
    if data:
        from clarifier.evaluation.evaluate import load_eval_data

        ed = load_eval_data(data, cfg.eval.split, max_examples=cfg.eval.max_examples, report=progress)
        if not ed.examples:
            raise PromotionError(f"no evaluation examples in {data} (split {cfg.eval.split!r})")
        eval_set = {"data": ed.name, "fingerprint": ed.fingerprint, "n": len(ed.examples),
                    "skipped_lines": len(ed.skipped)}
        metrics = {}
        # the reports are scratch: what the gate keeps is each version's metrics, tagged on it below
        with tempfile.TemporaryDirectory(prefix="clarifier-gate-") as scratch:
            out_root = Path(scratch)
            for role, v in (("challenger", mv), ("champion", champ)):
                if v is None:
                    continue
                logged = logged_eval_sets(v.tags).get(ed.fingerprint)
                if logged is not None:
                    metrics[role], sources[role] = logged["metrics"], "logged"
                    progress(f"[gate] {role} v{v.version}: metrics already logged on this evaluation set")
                    continue
                progress(f"[gate] evaluating {role} v{v.version} on {ed.name}")
                rep = _evaluate_version(cfg, name, str(v.version), data, out_root / f"v{v.version}", progress)
                if rep["data_fingerprint"] != ed.fingerprint:  # the file changed between reads
                    raise PromotionError(f"evaluation set {data} changed while the gate was running")
                metrics[role], sources[role] = key_metrics(rep["models"]["model"]["metrics"]), "evaluated"
                for k, val in eval_set_tags(ed.name, ed.fingerprint, metrics[role]).items():
                    client.set_model_version_tag(name, str(v.version), k, val)
        ch_metrics, cp_metrics = metrics["challenger"], metrics.get("champion")
    else:
        common = _common_logged_set(mv.tags, champ.tags if champ is not None else None)
        if common is None:
            who = f"v{mv.version}" + (f" and champion v{champ.version}" if champ is not None else "")
            raise PromotionError(
                f"no evaluation metrics logged for {who} on a common evaluation set; pass --data "
                "EVAL.jsonl (or a data-job folder) to evaluate "
                + ("both" if champ is not None else "it") + " on the same set")
        eval_set = {"data": common["data"], "fingerprint": common["fingerprint"]}
        ch_metrics = common["metrics"]
        cp_metrics = logged_eval_sets(champ.tags)[common["fingerprint"]]["metrics"] if champ is not None else None
        sources = {"challenger": "logged", **({"champion": "logged"} if champ is not None else {})}

    result = gate_decision(ch_metrics, cp_metrics, cfg.registry.gate)
    shadow = None
    if shadow_log:
        from clarifier.registry.shadow import read_records, shadow_stats

        if champ is None:
            raise PromotionError(f"--shadow-log compares the challenger with the champion, but {name} has no "
                                 f"@{to_alias} version")
        shadow = shadow_stats(read_records(shadow_log), f"{name}/{mv.version}", f"{name}/{champ.version}")
        shadow["log"] = shadow_log
        progress(f"[gate] live evidence from {shadow_log}: {shadow['requests']} shadowed requests "
                 f"({shadow['failed']} shadow calls failed)")
        result.criteria.extend(shadow_criteria(shadow, cfg.registry.gate))
    decision = "promoted" if result.promote else "refused"
    now = utc_now()
    record = {
        "time": now, "user": user or current_user(), "action": "promote", "model": name, "alias": to_alias,
        "from_alias": from_alias, "decision": decision,
        "from_version": str(champ.version) if champ is not None else None,  # what the alias held before
        "to_version": str(mv.version) if result.promote else (str(champ.version) if champ is not None else None),
        "challenger": {"version": str(mv.version), "run_id": mv.run_id, "metrics": ch_metrics,
                       "metrics_source": sources.get("challenger")},
        "champion": ({"version": str(champ.version), "run_id": champ.run_id, "metrics": cp_metrics,
                      "metrics_source": sources.get("champion")} if champ is not None else None),
        "previous_version": str(champ.version) if champ is not None else None,
        "eval_set": eval_set,
        **({"shadow": shadow} if shadow else {}),
        "gate": cfg.registry.gate.model_dump(),
        "criteria": [asdict(c) for c in result.criteria],
        "reason": result.summary(),
    }
    log = audit_log_for(cfg)
    tags = {
        f"gate.{to_alias}.decision": decision,
        f"gate.{to_alias}.time": now,
        f"gate.{to_alias}.against": str(champ.version) if champ is not None else "none",
        f"gate.{to_alias}.evidence": _evidence_tag({"eval_set": eval_set, "criteria": record["criteria"]}),
        f"gate.{to_alias}.reason": result.summary()[:TAG_LIMIT],
    }
    for k, v in tags.items():
        client.set_model_version_tag(name, str(mv.version), k, v)
    if result.promote:
        client.set_registered_model_alias(name, to_alias, str(mv.version))
        try:
            record = log.append(record)
        except Exception:
            # The audit record is the commit point: without it, put the alias back.
            if champ is not None:
                client.set_registered_model_alias(name, to_alias, str(champ.version))
            else:
                client.delete_registered_model_alias(name, to_alias)
            raise
        if champ is not None:
            client.set_model_version_tag(name, str(champ.version), f"gate.{to_alias}.replaced_by", str(mv.version))
    else:
        record = log.append(record)
    progress(f"[gate] {name} v{mv.version} -> @{to_alias}: {decision.upper()} ({result.summary()}); "
             f"audit log {log.location}")
    return PromotionDecision(name, to_alias, decision, str(mv.version),
                             str(champ.version) if champ is not None else None, result, ch_metrics, cp_metrics,
                             eval_set, record)


def rollback(cfg: ClarifierConfig, name: str, *, alias: str = "champion", user: str | None = None,
             reason: str | None = None, progress: Callable[[str], None] = print) -> dict:
    """Point ``alias`` back at the version it held before the current one (per the audit log); audited."""
    from clarifier.runtime import storage

    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    client = _client(resolve_tracking_uri(cfg.tracking.tracking_uri))
    log = audit_log_for(cfg)
    history = alias_history(log.records(model=name, alias=alias))
    current = _version_by_alias(client, name, alias)
    if current is None:
        raise PromotionError(f"model {name!r} has no alias {alias!r}; nothing to roll back")
    if not history or history[-1] != str(current.version):
        raise PromotionError(
            f"{name}@{alias} points at version {current.version}, but the audit log {log.location} "
            + (f"last recorded version {history[-1]}" if history else "has no promotion of it")
            + "; the alias was moved outside the gate -- set it explicitly with `clarifier models promote`")
    if len(history) < 2:
        raise PromotionError(f"{name}@{alias} (version {current.version}) has no earlier version in the audit log "
                             f"{log.location}; nothing to roll back to")
    target = history[-2]
    _get_version(client, name, target)  # still registered
    client.set_registered_model_alias(name, alias, target)
    now = utc_now()
    try:
        record = log.append({"time": now, "user": user or current_user(), "action": "rollback", "model": name,
                             "alias": alias, "decision": "rolled_back", "from_version": str(current.version),
                             "to_version": target, "previous_version": str(current.version),
                             "reason": reason or "manual rollback"})
    except Exception:
        client.set_registered_model_alias(name, alias, str(current.version))
        raise
    client.set_model_version_tag(name, str(current.version), f"gate.{alias}.rolled_back", now)
    progress(f"[rollback] {name}@{alias}: version {current.version} -> {target}; audit log {log.location}")
    return record

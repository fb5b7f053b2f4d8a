"""Does the decision read the retrieval? A model's skill over the surface control, and what the retrieval's
geometry adds, inside each source, with paired bootstrap intervals. JSON out.

    .venv/bin/python benchmarks/recipe/rag_signal.py --data .clarifier/recipes/joint-public/data \
        --scores shipped=benchmarks/results/recipe-retrain-plain.json:shipped-v3.2 \
        --dev-model shipped=builtin:clarifier-smollm2-135m --out benchmarks/results/recipe-rag-signal-<date>.json

Rows, each scored on every turn of ``--split`` (default test) and summarised inside each source:

* ``surface_control``: position and length only (``clarifier.core.surface``), fitted on the train split;
* ``geometry``: the retrieval's geometry only, fitted on the train split: the turn's passages and query embedded
  with all-MiniLM-L6-v2, then passage-to-passage cosine similarity (min, mean, spread), query-to-passage
  similarity (max, the gap between the top two, how many passages sit within 0.05 of the top), the number of
  passages, and the query's largest similarity to an earlier user turn;
* ``surface+geometry``: both feature sets in one regression;
* each model (``--scores NAME=RESULT.json[:MODEL]``: scores kept by ``paired.py`` on the same split, or
  ``--model NAME=URI``), and, with ``--dev-model NAME=URI`` (the same model, scored on the dev split here),
  ``NAME+geometry``: the model's logit stacked with the geometry features in a regression fitted on the dev
  split, per source where a source has the turns (the test split is only scored, never fitted on).

Every row gets its skill over the surface control (mean within-source AUROC minus the control's, paired bootstrap
over the split's turns, resampled inside each source); ``NAME+geometry`` also its difference from ``NAME``. Sources
where fewer than half the turns have two or more passages are reported but flagged (``with_passages``): geometry
can say nothing there.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_file, write_result  # noqa: E402

GEOMETRY = ("pp_min", "pp_mean", "pp_std", "qp_max", "qp_gap", "qp_near_top", "passages_log", "q_history_max")


def geometry_features(encoder, examples, batch: int = 64, progress=print) -> list[list[float]]:
    """The retrieval-geometry features of each turn (:data:`GEOMETRY`), from one embedding pass over every text."""
    import numpy as np

    texts: list[str] = []
    index: dict[str, int] = {}

    def idx(t: str) -> int:
        t = (t or "").strip()[:2000]
        if t not in index:
            index[t] = len(texts)
            texts.append(t)
        return index[t]

    plan = []
    for e in examples:
        q = idx(e.query)
        ps = [idx(p.text) for p in e.passages]
        hs = [idx(t.text) for t in e.history if getattr(t.role, "value", t.role) == "user"]
        plan.append((q, ps, hs))
    vecs = []
    for i in range(0, len(texts), batch):
        vecs.append(encoder.encode(texts[i:i + batch]))
        if (i // batch) % 20 == 0:
            progress(f"[rag] embedded {min(i + batch, len(texts))}/{len(texts)} texts")
    emb = np.concatenate(vecs) if vecs else np.zeros((0, 384))
    out = []
    for q, ps, hs in plan:
        qv = emb[q]
        if len(ps) >= 2:
            pv = emb[ps]
            sims = pv @ pv.T
            upper = sims[np.triu_indices(len(ps), 1)]
            pp = [float(upper.min()), float(upper.mean()), float(upper.std())]
        else:
            pp = [1.0, 1.0, 0.0]  # one passage (or none) cannot disagree with itself
        if ps:
            qp = np.sort(emb[ps] @ qv)[::-1]
            qpf = [float(qp[0]), float(qp[0] - qp[1]) if len(qp) > 1 else 1.0, float(np.sum(qp >= qp[0] - 0.05))]
        else:
            qpf = [0.0, 0.0, 0.0]
        qh = float(max(emb[hs] @ qv)) if hs else 0.0
        out.append([*pp, *qpf, math.log1p(len(ps)), qh])
    return out


def fit_rows(train_x, train_y, train_src, x, src, seed: int):
    """Scores of ``x`` by a regression fitted on ``train_x``: the surface control's procedure on other features."""
    from clarifier.core.surface import fit_features

    return fit_features(train_x, train_y, train_src, seed=seed).scores_of(x, src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="a data-job output folder (train, dev and the scored split)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--scores", action="append", default=[], metavar="NAME=RESULT.json[:MODEL]",
                    help="a model's scores on --split kept by paired.py (same split and examples)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=URI", help="a model to score on --split")
    ap.add_argument("--dev-model", action="append", default=[], metavar="NAME=URI",
                    help="the model behind NAME, scored on the dev split to fit NAME+geometry there")
    ap.add_argument("--encoder", default=None, help="sentence encoder (default: the packaged all-MiniLM-L6-v2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="result JSON (default results/recipe-rag-signal.json)")
    a = ap.parse_args()
    result_file("recipe-rag-signal", a.out)

    from clarifier.core.metrics import paired_bootstrap, within_source_summary
    from clarifier.core.schema import source_of
    from clarifier.core.surface import fit_surface_control, skill_over_control
    from clarifier.data.outputs import load_split
    from clarifier.engine.loading import load_engine
    from clarifier.engine.similarity import SentenceEncoder
    from clarifier.evaluation.evaluate import fingerprint_examples
    from paired import stored_scores

    t0 = time.time()
    train, dev, test = (load_split(a.data, s) for s in ("train", "dev", a.split))
    gold = [bool(e.needs_clarification) for e in test]
    src = [source_of(e) for e in test]
    fp, ids = fingerprint_examples(test), [e.id for e in test]
    print(f"[rag] {len(train)} train, {len(dev)} dev, {len(test)} {a.split} turns of {a.data}", flush=True)
    with_passages = {s: sum(1 for e, t in zip(test, src) if t == s and len(e.passages) >= 2) / src.count(s)
                     for s in sorted(set(src))}
    print("[rag] share of turns with 2+ passages: " + ", ".join(f"{s} {v:.2f}" for s, v in with_passages.items()))

    scores: dict[str, list[float]] = {}
    info: dict[str, dict] = {}
    ctl = fit_surface_control(train, [e.needs_clarification for e in train], [source_of(e) for e in train], seed=a.seed)
    scores["surface_control"] = ctl.scores(test, src)
    info["surface_control"] = {"fitted_on": "train split", **ctl.info}

    encoder = SentenceEncoder(a.encoder)
    t1 = time.time()
    gx_train = geometry_features(encoder, train)
    gx_dev = geometry_features(encoder, dev)
    gx = geometry_features(encoder, test)
    geo_seconds = time.time() - t1
    n_feat_turns = len(train) + len(dev) + len(test)
    tr_y, tr_src = [bool(e.needs_clarification) for e in train], [source_of(e) for e in train]
    scores["geometry"] = fit_rows(gx_train, tr_y, tr_src, gx, src, a.seed)
    from clarifier.core.surface import surface_features

    sx_train = [surface_features(e) for e in train]
    sx = [surface_features(e) for e in test]
    scores["surface+geometry"] = fit_rows([s + g for s, g in zip(sx_train, gx_train)], tr_y, tr_src,
                                          [s + g for s, g in zip(sx, gx)], src, a.seed)

    for item in a.scores:
        name, _, ref = item.partition("=")
        path, _, key = ref.partition(":")
        sc, row = stored_scores(path, key or name, split=a.split, fingerprint=fp, ids=ids)
        scores[name], info[name] = [float(v) for v in sc], row
    for item in a.model:
        name, _, uri = item.partition("=")
        engine = load_engine(uri)
        scores[name] = [float(v) for v in engine.score_examples(test, batch_size=8)]
        info[name] = {"model_uri": uri}
    stacked = []
    for item in a.dev_model:
        name, _, uri = item.partition("=")
        if name not in scores:
            raise SystemExit(f"--dev-model {name}: give its {a.split} scores with --scores or --model first")
        engine = load_engine(uri)
        print(f"[rag] scoring {name} on the dev split ({len(dev)} turns)", flush=True)
        dev_sc = [float(v) for v in engine.score_examples(dev, batch_size=8, progress=lambda d, n: print(
            f"[rag] {name} dev: {d}/{n}", flush=True) if d == n or d % 128 == 0 else None)]

        def logit(p):
            p = min(max(p, 1e-6), 1 - 1e-6)
            return math.log(p / (1 - p))

        dev_y, dev_src = [bool(e.needs_clarification) for e in dev], [source_of(e) for e in dev]
        scores[f"{name}+geometry"] = fit_rows([[logit(p)] + g for p, g in zip(dev_sc, gx_dev)], dev_y, dev_src,
                                              [[logit(p)] + g for p, g in zip(scores[name], gx)], src, a.seed)
        scores[f"{name}+surface"] = fit_rows([[logit(p)] + surface_features(e) for p, e in zip(dev_sc, dev)], dev_y,
                                             dev_src, [[logit(p)] + s for p, s in zip(scores[name], sx)], src, a.seed)
        info[f"{name}+geometry"] = {"stacked_on": "dev split", "dev_model": uri}
        info[f"{name}+surface"] = {"stacked_on": "dev split", "dev_model": uri}
        stacked.append(name)

    rows = {}
    for name, sc in scores.items():
        ws = within_source_summary(gold, sc, src)
        rows[name] = {**info.get(name, {}), "within_source": ws}
        if name != "surface_control":
            rows[name]["skill"] = skill_over_control(gold, sc, scores["surface_control"], src, model=name, seed=a.seed)
            print(f"[rag] {rows[name]['skill']['verdict']}", flush=True)
        print(f"[rag] {name}: mean within-source AUROC {ws['macro_auroc']:.3f} ("
              + ", ".join(f"{s} {v['auroc']:.2f}" for s, v in ws["by_source"].items() if v["auroc"] is not None) + ")",
              flush=True)
    added = {}
    for name in stacked:
        for extra in ("geometry", "surface"):
            both = f"{name}+{extra}"
            systems = {k: ([False] * len(gold), scores[k]) for k in (name, both)}
            boot = paired_bootstrap(gold, systems, reference=name, sources=src, seed=a.seed)["systems"][both]
            per = {}
            for s in sorted(set(src)):
                idx = [i for i, t in enumerate(src) if t == s]
                sub = {k: ([False] * len(idx), [scores[k][i] for i in idx]) for k in systems}
                per[s] = paired_bootstrap([gold[i] for i in idx], sub, reference=name, seed=a.seed)["systems"][both]["auroc_diff"]
            added[both] = {"macro_auroc_diff": boot["macro_auroc_diff"], "auroc_diff_by_source": per}
            print(f"[rag] {both} minus {name}: mean within-source AUROC {boot['macro_auroc_diff']}; "
                  + ", ".join(f"{s} {v}" for s, v in per.items()), flush=True)
    path = write_result("recipe-rag-signal", {
        "data": a.data, "split": a.split, "n": len(test), "fingerprint": fp, "ids": ids,
        "with_passages": with_passages, "geometry_features": list(GEOMETRY),
        "geometry_seconds": round(geo_seconds, 1), "geometry_turns": n_feat_turns,
        "encoder": a.encoder or "all-minilm-l6-v2", "rows": rows, "added": added,
        "scores": {k: [round(float(v), 6) for v in sc] for k, sc in scores.items()},
        "seconds": round(time.time() - t0, 1)}, a.out)
    print(f"[rag] wrote {path}")


if __name__ == "__main__":
    main()

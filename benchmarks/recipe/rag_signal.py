"""Does the decision read the retrieval? A model's skill over the surface control, and what the retrieval's
geometry adds, inside each source, with paired bootstrap intervals. JSON out.

    .venv/bin/python benchmarks/recipe/rag_signal.py --data .clarifier/recipes/joint-public/data \
        --scores shipped=benchmarks/results/recipe-retrain-plain.json:shipped-v3.2 \
        --dev-model shipped=builtin:clarifier-smollm2-135m --out benchmarks/results/recipe-rag-signal-<date>.json

Rows, each scored on every turn of ``--split`` (default test) and summarised inside each source:

* ``surface_control``: position and length only (``clarifier.core.surface``), fitted on the train split;
* ``geometry``: the retrieval's geometry only (``clarifier.core.retrieval.GEOMETRY``), fitted on the train split:
  the turn's passages and query embedded with all-MiniLM-L6-v2, then passage-to-passage cosine similarity (min,
  mean, spread), query-to-passage similarity (max, the gap between the top two, how many passages sit within 0.05
  of the top), the number of passages, and the query's largest similarity to an earlier user turn;
* ``retriever_scores``: the profile of the retriever's own scores (``clarifier.core.retrieval.PROFILE``: best,
  top-two gap, near-top count, spread, count): the passages' ``score`` where every passage has one, else the
  encoder's query-to-passage cosine, i.e. the profile a dense retriever with this encoder would return;
* ``surface+geometry``, ``surface+retriever_scores``: both feature sets in one regression;
* each model (``--scores NAME=RESULT.json[:MODEL]``: scores kept by ``paired.py`` on the same split, or
  ``--model NAME=URI``), and, with ``--dev-model NAME=URI`` (the same model, scored on the dev split here),
  ``NAME+geometry``, ``NAME+retriever_scores`` and ``NAME+surface``: the model's logit stacked with those features
  in a regression fitted on the dev split, per source where a source has the turns (the test split is only
  scored, never fitted on).

``leave_one_source_out``: the feature rows and the control fitted on the other sources' train turns, scored on the
left-out source (AUROC), to set beside the recipe's own leave-one-out runs. ``latency``: per-request p50 of the
decision alone and of the retrieval features' embedding pass, one turn at a time, with the first ``--dev-model``.

Every row gets its skill over the surface control (mean within-source AUROC minus the control's, paired bootstrap
over the split's turns, resampled inside each source); ``NAME+geometry`` also its difference from ``NAME``. Sources
where fewer than half the turns have two or more passages are reported but flagged (``with_passages``): geometry
can say nothing there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_file, write_result  # noqa: E402

def embed_turns(encoder, examples, batch: int = 64, progress=print):
    """One embedding pass over every distinct text of ``examples``: per turn ``(query, passages, user history)``
    as arrays of unit rows."""
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
        plan.append((idx(e.query), [idx(p.text) for p in e.passages],
                     [idx(t.text) for t in e.history if getattr(t.role, "value", t.role) == "user"]))
    vecs = []
    for i in range(0, len(texts), batch):
        vecs.append(encoder.encode(texts[i:i + batch]))
        if (i // batch) % 20 == 0:
            progress(f"[rag] embedded {min(i + batch, len(texts))}/{len(texts)} texts")
    emb = np.concatenate(vecs) if vecs else np.zeros((0, 384))
    return [(emb[q], emb[ps], emb[hs]) for q, ps, hs in plan]


def geometry_features(embedded) -> list[list[float]]:
    """:data:`clarifier.core.retrieval.GEOMETRY` of each embedded turn."""
    from clarifier.core.retrieval import geometry

    return [geometry(q, p, h) for q, p, h in embedded]


def profile_features(examples, embedded) -> list[list[float]]:
    """:data:`clarifier.core.retrieval.PROFILE` of each turn: from its passages' own ``score`` where every passage
    has one, else from the encoder's query-to-passage cosine (the encoder as the retriever)."""
    from clarifier.core.retrieval import passage_scores, score_profile

    out = []
    for e, (q, p, _h) in zip(examples, embedded):
        given = passage_scores(e.passages)
        out.append(score_profile(given if given is not None else [float(v) for v in (p @ q)]))
    return out


def latency(engine, encoder, examples, n: int, progress=print) -> dict:
    """Per-request p50 (one turn at a time, as a request arrives) of the decision alone (``engine.score``) and of
    embedding the turn's texts for the retrieval features, on the first ``n`` turns with passages."""
    import numpy as np

    from clarifier.core.retrieval import geometry

    turns = [e for e in examples if e.passages][:n]
    dec, emb = [], []
    engine.score([(turns[0].history, turns[0].query, turns[0].passages)])  # warm-up
    for e in turns:
        t = time.perf_counter()
        engine.score([(e.history, e.query, e.passages)])
        dec.append(time.perf_counter() - t)
        t = time.perf_counter()
        users = [x.text for x in e.history if getattr(x.role, "value", x.role) == "user"]
        v = encoder.encode([e.query] + [p.text for p in e.passages] + users)
        geometry(v[0], v[1:1 + len(e.passages)], v[1 + len(e.passages):])
        emb.append(time.perf_counter() - t)
    p50d, p50e = float(np.median(dec)), float(np.median(emb))
    progress(f"[rag] per request p50: decision {p50d * 1000:.0f} ms, retrieval features {p50e * 1000:.0f} ms")
    return {"turns": len(turns), "decision_p50_ms": round(p50d * 1000, 1), "features_p50_ms": round(p50e * 1000, 1),
            "features_over_decision": round(p50e / p50d, 3), "threads": __import__("torch").get_num_threads()}


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
    ap.add_argument("--latency-turns", type=int, default=48,
                    help="turns with passages timed one at a time with the first --dev-model (0: skip)")
    ap.add_argument("--out", default=None, help="result JSON (default results/recipe-rag-signal.json)")
    a = ap.parse_args()
    result_file("recipe-rag-signal", a.out)

    from clarifier.core.metrics import auroc, logit, paired_bootstrap, within_source_summary
    from clarifier.core.schema import source_of
    from clarifier.core.retrieval import GEOMETRY, PROFILE
    from clarifier.core.surface import fit_features, fit_surface_control, skill_over_control, surface_features
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
    em_train, em_dev, em = (embed_turns(encoder, x) for x in (train, dev, test))
    gx_train, gx_dev, gx = (geometry_features(x) for x in (em_train, em_dev, em))
    px_train, px_dev, px = (profile_features(x, e) for x, e in ((train, em_train), (dev, em_dev), (test, em)))
    geo_seconds = time.time() - t1
    n_feat_turns = len(train) + len(dev) + len(test)
    tr_y, tr_src = [bool(e.needs_clarification) for e in train], [source_of(e) for e in train]
    sx_train = [surface_features(e) for e in train]
    sx = [surface_features(e) for e in test]
    feature_rows = {"geometry": (gx_train, gx), "retriever_scores": (px_train, px),
                    "surface+geometry": ([s + g for s, g in zip(sx_train, gx_train)], [s + g for s, g in zip(sx, gx)]),
                    "surface+retriever_scores": ([s + g for s, g in zip(sx_train, px_train)],
                                                 [s + g for s, g in zip(sx, px)])}
    for name, (fx, x) in feature_rows.items():
        scores[name] = fit_rows(fx, tr_y, tr_src, x, src, a.seed)
        info[name] = {"fitted_on": "train split"}

    # Leave one source out: each row fitted on the other sources' train turns (pooled, no per-source fits), scored
    # on the left-out source's turns of the split. Models are compared with the recipe's own leave-one-out runs.
    loo: dict[str, dict] = {}
    loo_rows = {"surface_control": (sx_train, sx), **feature_rows}
    for left in sorted(set(src)):
        keep = [i for i, t in enumerate(tr_src) if t != left]
        idx = [i for i, t in enumerate(src) if t == left]
        g = [gold[i] for i in idx]
        loo[left] = {"n": len(idx), "clarify": sum(g)}
        for name, (fx, x) in loo_rows.items():
            fit = fit_features([fx[i] for i in keep], [tr_y[i] for i in keep], None, seed=a.seed)
            loo[left][name] = auroc(g, fit.scores_of([x[i] for i in idx]))
        print(f"[rag] left out {left}: " + ", ".join(f"{k} {v:.3f}" for k, v in loo[left].items()
                                                        if k not in ("n", "clarify") and v is not None), flush=True)

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
    stacked, timing = [], {}
    for item in a.dev_model:
        name, _, uri = item.partition("=")
        if name not in scores:
            raise SystemExit(f"--dev-model {name}: give its {a.split} scores with --scores or --model first")
        engine = load_engine(uri)
        print(f"[rag] scoring {name} on the dev split ({len(dev)} turns)", flush=True)
        dev_sc = [float(v) for v in engine.score_examples(dev, batch_size=8, progress=lambda d, n: print(
            f"[rag] {name} dev: {d}/{n}", flush=True) if d == n or d % 128 == 0 else None)]

        dev_y, dev_src = [bool(e.needs_clarification) for e in dev], [source_of(e) for e in dev]
        for extra, fdev, ftest in (("geometry", gx_dev, gx), ("retriever_scores", px_dev, px),
                                   ("surface", [surface_features(e) for e in dev], sx)):
            scores[f"{name}+{extra}"] = fit_rows([[logit(p)] + f for p, f in zip(dev_sc, fdev)], dev_y, dev_src,
                                                 [[logit(p)] + f for p, f in zip(scores[name], ftest)], src, a.seed)
            info[f"{name}+{extra}"] = {"stacked_on": "dev split", "dev_model": uri}
        stacked.append(name)
        if a.latency_turns and not timing:
            timing.update(latency(engine, encoder, test, a.latency_turns), model=uri)

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
        for extra in ("geometry", "retriever_scores", "surface"):
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
        "with_passages": with_passages, "geometry_features": list(GEOMETRY), "profile_features": list(PROFILE),
        "geometry_seconds": round(geo_seconds, 1), "geometry_turns": n_feat_turns,
        "encoder": a.encoder or "all-minilm-l6-v2", "rows": rows, "added": added,
        "leave_one_source_out": loo, "latency": timing,
        "scores": {k: [round(float(v), 6) for v in sc] for k, sc in scores.items()},
        "seconds": round(time.time() - t0, 1)}, a.out)
    print(f"[rag] wrote {path}")


if __name__ == "__main__":
    main()

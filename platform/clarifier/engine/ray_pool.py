"""Batched inference through Ray Data: ``ds.map_batches(ScorerActor, compute=ActorPoolStrategy(...))``.

What evaluation (``eval.engine=ray``), the audit and the work after training (the decision head's features, the
threshold's scores) use to run the one inference engine on a cluster's actors instead of in the driver.

Each scorer actor loads the model once (``ClarifierEngine``) and answers whole batches. The results
are the local engine's, example for example: the examples are put in the engine's batching order
(:func:`clarifier.core.prompt.length_order` with the model's prompt options), the dataset is cut into
blocks whose sizes are multiples of ``batch_size`` and every actor call re-groups its rows by
``idx // batch_size``, so each example is scored in exactly the batch (same neighbours, same padding)
it would be scored in by ``ClarifierEngine.predict(examples, batch_size)`` in this process.

With ``gpus_per_actor > 0`` each actor loads its model on its CUDA device (the CPU-equality
guarantee above is for CPU actors; GPU kernels may differ from a CPU run in the last bits). Each
actor computes in the spec's ``precision`` (``model.precision``) and uses exactly the CPUs it
reserved as torch threads.

The actor resolves the model URI itself (``models:/``, ``runs:/``, ``s3://`` download into the
node's cache), so it works on a multi-node cluster. A model folder on the driver's disk (a training run's
output, ``clarifier eval --model ./folder``) travels through Ray's object store instead
(:func:`ship_folder`): each node unpacks it once, so no actor depends on seeing the driver's paths.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import tarfile
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

from clarifier.core.metrics import Prediction
from clarifier.core.prompt import PromptOptions, length_order
from clarifier.core.schema import Example


def engine_from_spec(spec: dict, cpus: float = 1):
    """The ``ClarifierEngine`` a scorer actor holds (see :class:`ScorerActor` for ``spec``), computing
    with exactly ``cpus`` torch threads."""
    from clarifier.core.prompt import PromptOptions
    from clarifier.engine.inference import ClarifierEngine
    from clarifier.engine.precision import set_threads

    set_threads(cpus)  # exactly the CPUs this actor reserved
    device, precision = spec.get("device", "cpu"), spec.get("precision", "auto")
    if spec.get("base_model"):
        return ClarifierEngine.from_base(
            spec["base_model"], cache_dir=spec.get("cache_dir"), threshold=float(spec.get("threshold", 0.5)),
            prompt_opts=PromptOptions(**(spec.get("prompt") or {})),
            max_new_tokens=int(spec.get("max_new_tokens", 48)), precision=precision, device=device,
            decode=spec.get("decode", "auto"))
    from clarifier.engine.loading import load_engine

    shipped = "model_ref" in spec  # a folder of the driver's disk, unpacked on this node; named as the driver knows it
    return load_engine(
        _unpacked(spec) if shipped else spec["model_uri"], version=spec.get("model_from") if shipped else None,
        download_dir=spec.get("download_dir"), tracking_uri=spec.get("tracking_uri"), cache_dir=spec.get("cache_dir"),
        max_new_tokens=int(spec.get("max_new_tokens", 48)), precision=precision, device=device,
        decision_head=bool(spec.get("decision_head", True)), decode=spec.get("decode", "auto"))


SHIPPED_DIR = "clarifier-shipped"  # under the node's temp dir: <digest>/ per model folder shipped
SHIPPED_KEEP_S = 24 * 3600  # unpacked folders unused for longer are removed when another is unpacked


def ship_folder(folder: str | Path) -> dict:
    """Spec fields that hand the model folder on this (the driver's) disk to actors on any node: its files as one
    tar archive in Ray's object store (``model_ref``) and the archive's sha256 (``model_digest``), in place of
    ``model_uri``. Ray must be initialised."""
    import ray

    folder = Path(folder)
    if not (folder / "clarifier.json").is_file():
        raise FileNotFoundError(f"{folder} is not a model folder (no clarifier.json)")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(folder)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""  # the digest is the content's
            with path.open("rb") as f:
                tar.addfile(info, f)
    data = buf.getvalue()
    return {"model_ref": ray.put(data), "model_digest": hashlib.sha256(data).hexdigest(), "model_from": str(folder)}


def model_fields(model_uri: str | Path) -> dict:
    """How actors on any node find ``model_uri``: a folder on this disk travels through the object store
    (:func:`ship_folder`); any other URI (``models:/``, ``runs:/``, ``s3://``, ``builtin:``) they resolve themselves."""
    path = Path(str(model_uri)).expanduser()
    return ship_folder(path) if path.is_dir() else {"model_uri": str(model_uri)}


def _unpacked(spec: dict) -> Path:
    """The shipped folder on this node: unpacked once per digest (atomic rename), then reused."""
    import ray

    out = Path(tempfile.gettempdir()) / SHIPPED_DIR / spec["model_digest"]
    if (out / "clarifier.json").is_file():
        os.utime(out)  # in use: not pruned
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    _prune(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=spec["model_digest"][:12] + ".", dir=out.parent))
    try:
        data = ray.get(spec["model_ref"])
        if hashlib.sha256(data).hexdigest() != spec["model_digest"]:
            raise RuntimeError(f"shipped model {spec.get('model_from')}: its archive does not match its digest")
        with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
            tar.extractall(tmp, filter="data")
        try:
            os.replace(tmp, out)
        except OSError:  # another actor on this node unpacked it first
            if not (out / "clarifier.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _prune(root: Path) -> None:
    """Remove unpacked model folders nobody used for ``SHIPPED_KEEP_S`` (a loaded engine no longer reads its files),
    so a long-lived node's disk does not fill with one copy per training run."""
    import time

    for d in root.iterdir():
        try:
            if d.is_dir() and time.time() - d.stat().st_mtime > SHIPPED_KEEP_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


class ScorerActor:
    """A stateful Ray Data UDF: one ``ClarifierEngine`` per actor, loaded in ``__init__``.

    ``spec`` is either ``{"model_uri", "tracking_uri", "cache_dir", "max_new_tokens"}`` (a trained
    model; ``model_ref``/``model_digest`` from :func:`ship_folder` in place of ``model_uri``) or
    ``{"base_model", "prompt", "threshold", "cache_dir"}`` (the untrained base model with the same prompt).
    ``mode`` is ``"predict"`` (decision, then question and grounding above the threshold), ``"score"``
    (decision only) or ``"features"`` (the decision tokens' P(clarify) and the hidden-state features a
    decision head reads, ``features={"layers": [...], "pooling": [...], "token": bool}``: the engine's
    ``decision_features``).
    """

    def __init__(self, spec: dict, mode: str = "predict", batch_size: int = 8, cpus: float = 1,
                 features: dict | None = None, counter=None):
        if mode not in ("predict", "score", "features"):
            raise ValueError(f"ScorerActor mode must be 'predict', 'score' or 'features', got {mode!r}")
        if (mode == "features") != (features is not None):
            raise ValueError("ScorerActor: features={'layers', 'pooling'} goes with mode 'features', and only with it")
        self.engine = engine_from_spec(spec, cpus)
        self.mode = mode
        self.batch_size = batch_size
        self.features = features
        self.counter = counter  # clarifier.runtime.progress.RowCounter: the driver's progress lines

    def __call__(self, batch: dict) -> dict:
        out = self._call(batch)
        if self.counter is not None:
            self.counter.add.remote(len(out["idx"]))
        return out

    def _call(self, batch: dict) -> dict:
        idx = [int(i) for i in batch["idx"]]
        examples = [Example.model_validate_json(s) for s in batch["example_json"]]
        groups: dict[int, list[int]] = {}
        for pos, i in enumerate(idx):
            groups.setdefault(i // self.batch_size, []).append(pos)
        if self.mode == "features":
            return self._features(idx, examples, groups)
        preds: list[Prediction | None] = [None] * len(idx)
        for _, positions in sorted(groups.items()):
            positions.sort(key=lambda p: idx[p])
            chunk = [examples[p] for p in positions]
            if self.mode == "score":
                out = [Prediction(needs_clarification=s >= self.engine.threshold, confidence=s)
                       for s in self.engine.score(([(e.history, e.query, e.passages) for e in chunk]))]
            else:
                out = self.engine.predict(chunk, batch_size=len(chunk))
            for p, pred in zip(positions, out):
                preds[p] = pred
        return {"idx": idx, "pred_json": [json.dumps(asdict(p)) for p in preds]}

    def _features(self, idx: list[int], examples: list, groups: dict) -> dict:
        token: list[float] = [0.0] * len(idx)
        feats: list[bytes] = [b""] * len(idx)
        for _, positions in sorted(groups.items()):
            positions.sort(key=lambda p: idx[p])
            p, f = self.engine.decision_features([(examples[q].history, examples[q].query, examples[q].passages)
                                                  for q in positions], self.features["layers"], self.features["pooling"],
                                                 token=self.features.get("token", True))
            f = f.float().numpy()
            for row, q in enumerate(positions):
                token[q], feats[q] = float(p[row]), f[row].tobytes()
        return {"idx": idx, "token": token, "features": feats, "precision": [self.engine.precision] * len(idx)}


def _pred_from_json(s: str) -> Prediction:
    d = json.loads(s)
    d["grounding_turns"] = tuple(d.get("grounding_turns") or ())
    d["grounding_passages"] = tuple(d.get("grounding_passages") or ())
    return Prediction(**d)


def _run_pool(examples: Sequence[Example], spec: dict, *, mode: str, batch_size: int, actors: int,
              cpus_per_actor: float, gpus_per_actor: float, features: dict | None = None,
              progress: Callable[[str], None] | None = None, label: str = "[eval]") -> list[dict]:
    """Every example through a pool of ``actors`` ``ScorerActor``s; their output rows in the examples' order.
    With ``progress``: a line every 30 s while they work (:func:`clarifier.runtime.progress.counted`)."""
    import pyarrow as pa
    import ray

    from clarifier.runtime.progress import counted

    if not ray.is_initialized():
        raise RuntimeError("scoring on Ray actors needs a running Ray (clarifier.runtime.cluster.init_ray()); none is "
                           "initialised")
    n = len(examples)
    # Blocks of a multiple of batch_size rows (a few per actor), so Ray's batches line up with the
    # local engine's batches.
    per_block = batch_size * max(1, math.ceil(n / batch_size / (4 * max(actors, 1))))
    tables = []
    for start in range(0, n, per_block):
        chunk = examples[start:start + per_block]
        tables.append(pa.table({"idx": list(range(start, start + len(chunk))),
                                "example_json": [e.model_dump_json() for e in chunk]}))
    ds = ray.data.from_arrow(tables)
    if gpus_per_actor:
        spec = {**spec, "device": "cuda"}
    with counted(ray, label, n, progress) if progress else contextlib.nullcontext() as counter:
        ds = ds.map_batches(
            ScorerActor,
            fn_constructor_kwargs={"spec": spec, "mode": mode, "batch_size": batch_size, "cpus": cpus_per_actor,
                                   "counter": counter, **({"features": features} if features is not None else {})},
            compute=ray.data.ActorPoolStrategy(size=actors),
            batch_size=batch_size,
            num_cpus=cpus_per_actor,
            num_gpus=gpus_per_actor or None,
        )
        rows = ds.take_all()
    if len(rows) != n:
        raise RuntimeError(f"Ray scoring returned {len(rows)} rows for {n} examples")
    rows.sort(key=lambda r: int(r["idx"]))
    return rows


def ray_features(examples: Sequence[Example], spec: dict, layers: list[int], pooling: Sequence[str], *,
                 opts: PromptOptions | None, batch_size: int = 8, actors: int = 1, cpus_per_actor: float = 1,
                 gpus_per_actor: float = 0, progress: Callable[[str], None] | None = None, label: str = "[head]",
                 token: bool = True):
    """``(decision-token P(clarify), [n, features] float32 array, precision)`` of ``examples`` in their order,
    computed by the actors: on CPU actors equal to ``ClarifierEngine.decision_features`` on the batches
    :meth:`ClarifierEngine.batches` makes (``opts``: the model's prompt options, as in :func:`ray_predict`; None:
    ``batch_size`` consecutive examples). ``token=False``: the passes stop after the deepest of ``layers`` (the
    decision tokens' P(clarify) are NaN)."""
    import numpy as np

    if not examples:
        raise ValueError("ray_features: no examples")
    order = _order(examples, opts)
    rows = _run_pool([examples[i] for i in order], spec, mode="features", batch_size=batch_size, actors=actors,
                     cpus_per_actor=cpus_per_actor, gpus_per_actor=gpus_per_actor,
                     features={"layers": list(layers), "pooling": list(pooling), "token": token}, progress=progress,
                     label=label)
    x_sorted = np.stack([np.frombuffer(r["features"], dtype=np.float32) for r in rows])
    probs, x = [0.0] * len(examples), np.empty_like(x_sorted)
    for pos, i in enumerate(order):
        probs[i] = float(rows[pos]["token"])
    x[order] = x_sorted
    return probs, x, str(rows[0]["precision"])


def _order(examples: Sequence[Example], opts: PromptOptions | None) -> list[int]:
    """The order the actors get ``examples`` in: the engine's batching order (by rendered length) or as they come."""
    return length_order(examples, opts) if opts is not None else list(range(len(examples)))


def ray_predict(examples: Sequence[Example], spec: dict, *, opts: PromptOptions | None, mode: str = "predict",
                batch_size: int = 8, actors: int = 1, cpus_per_actor: float = 1, gpus_per_actor: float = 0,
                progress: Callable[[str], None] | None = None) -> list[Prediction]:
    """Predictions for ``examples`` (in their order) from a pool of ``actors`` ``ScorerActor``s.

    ``opts``: the model's prompt options (``read_meta(folder).prompt_options()``): the examples are batched as
    :meth:`ClarifierEngine.batches` batches them (neighbours by rendered length); None: as they come. Ray must
    already be initialised (``clarifier.runtime.cluster.init_ray``); on CPU actors equal to
    ``ClarifierEngine.predict(examples, batch_size)`` (or ``score_examples`` with ``mode="score"``), or with
    ``order="given"`` when ``opts`` is None.
    """
    if mode not in ("predict", "score"):
        raise ValueError(f"ray_predict mode must be 'predict' or 'score', got {mode!r}")
    if not examples:
        return []
    order = _order(examples, opts)
    rows = _run_pool([examples[i] for i in order], spec, mode=mode, batch_size=batch_size, actors=actors,
                     cpus_per_actor=cpus_per_actor, gpus_per_actor=gpus_per_actor, progress=progress)
    if progress:
        progress(f"[eval] ray: {len(examples)} examples scored by {actors} actor(s)")
    preds: list = [None] * len(examples)
    for pos, i in enumerate(order):
        preds[i] = _pred_from_json(rows[pos]["pred_json"])
    return preds

"""``data.sources``: datasets imported into ``data.input`` before the data job reads it.

A recipe names its training data as a list of sources -- public datasets through their importers
(``clarifier.data.importers``) and synthetic conversations -- instead of a folder prepared by hand::

    data:
      input: .clarifier/recipes/joint-public/input      # owned by the sources: rewritten on every run
      sources:
        - {importer: pacific, src: dataset:pacific, max_examples: 600}   # a registered public dataset
        - {importer: clariq, src: /data/clariq}                           # or a folder / s3:// prefix
        - {importer: synthetic, options: {conversations: 200}}
        - {importer: synthetic_rag, options: {conversations: 300, seed: 3}}

The generators (``GENERATORS``: ``synthetic`` -- :mod:`clarifier.data.synthetic`, ambiguity from the
history; ``synthetic_rag`` -- :mod:`clarifier.data.synthetic_rag`, ambiguity in the retrieved passages)
take ``options.conversations`` (default ``data.synthetic_conversations``) and ``options.seed``
(default ``data.seed``) and need no ``src``; ``synthetic_rag`` also ``options.long_history_share`` (the share
of conversations with 8-16 turns before the final query; default 0).

``src: dataset:<name>`` is found in ``data.mirror`` or the download cache (``clarifier data fetch
<name>``; see :mod:`clarifier.data.datasets`), verified against the registered sha256.

Each source becomes ``<data.input>/<name>.jsonl`` (evaluation-set examples, ``meta.source=<name>``;
generators: conversation logs under ``<name>/``), its skipped records ``<name>.skipped.json`` with
reasons, and ``_sources.json`` lists what was written with the counts. ``max_examples`` keeps whole
conversations in a seeded random order; what it drops is counted (``dropped_by_cap``), never silent.
The folder is owned by the sources: a ``data.input`` that holds files they did not write is refused.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import Callable

from clarifier.runtime import storage
from clarifier.core.config import DataConfig, SourceConfig
from clarifier.core.schema import Example

OWNER_FILE = "_sources.json"
SYNTHETIC = "synthetic"
SYNTHETIC_RAG = "synthetic_rag"
# Conversation-log generators usable as a source's importer: name -> module with write_logs(uri, n, seed=).
# Not here: clarifier.data.synthetic_chatlogs (chat transcripts without labels, for `clarifier audit`; the
# data job reads a generator's output as ConversationLogs). `clarifier data synth --generator synthetic_chat`.
GENERATORS = {SYNTHETIC: "clarifier.data.synthetic", SYNTHETIC_RAG: "clarifier.data.synthetic_rag"}
GENERATOR_OPTIONS = ("conversations", "seed")
# Options a generator's write_logs takes besides those two (passed through as keyword arguments).
GENERATOR_EXTRA_OPTIONS = {SYNTHETIC: (), SYNTHETIC_RAG: ("long_history_share",)}


def _order_key(seed: int, conversation_id: str) -> str:
    # Salted: the split hash (data.split) is sha256 of "<seed>:<id>"; ordering by that same value would
    # keep exactly the conversations of the first split.
    return hashlib.sha256(f"max_examples:{seed}:{conversation_id}".encode()).hexdigest()


def cap_by_conversation(examples: list[Example], max_examples: int | None, seed: int) -> tuple[list[Example], list[Example]]:
    """``(kept, dropped)``: whole conversations in a seeded order until ``max_examples`` is reached.

    A conversation that would overshoot the cap is skipped (a smaller later one may still fit), so
    ``len(kept) <= max_examples``; the order of ``kept`` is the input order. Pure.
    """
    if max_examples is None or len(examples) <= max_examples:
        return list(examples), []
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(examples):
        groups.setdefault(e.conversation_id, []).append(i)
    keep: set[int] = set()
    for cid in sorted(groups, key=lambda c: _order_key(seed, c)):
        idx = groups[cid]
        if len(keep) + len(idx) <= max_examples:
            keep.update(idx)
        if len(keep) == max_examples:
            break
    kept = [e for i, e in enumerate(examples) if i in keep]
    dropped = [e for i, e in enumerate(examples) if i not in keep]
    return kept, dropped


def _check_owned(input_uri: str) -> None:
    try:
        files = storage.list_files(input_uri)
    except FileNotFoundError:
        return
    if not files:
        return
    owner = storage.join(input_uri, OWNER_FILE)
    if not storage.exists(owner):
        raise ValueError(
            f"data.sources would rewrite data.input={input_uri!r}, but it holds files that data.sources did not "
            f"write (e.g. {files[0]}); point data.input at an empty or new folder")


def resolve_src(src: SourceConfig, mirror: str | None = None) -> str:
    """Where a source's files are: ``src`` itself, or for ``dataset:<name>`` the verified copy in the
    mirror (``mirror``, i.e. data.mirror, else $CLARIFIER_DATA_MIRROR) or the download cache."""
    if not src.dataset:
        return src.src
    from clarifier.data.datasets import DatasetError, DatasetNotFound, resolve_dataset

    try:
        return resolve_dataset(src.dataset, mirror)
    except (DatasetError, DatasetNotFound) as exc:
        raise type(exc)(f"data.sources[{src.source_name}]: {exc}") from None


def _import_source(src: SourceConfig, mirror: str | None = None) -> tuple[list[Example], list[dict], str]:
    """``(examples, skipped, location read)``."""
    from clarifier.data.importers import get_importer, iter_dataset
    from clarifier.data.importers.base import Skipped

    try:
        get_importer(src.importer)  # names the available importers when it is unknown
    except KeyError as exc:
        raise KeyError(f"data.sources[{src.source_name}]: {exc.args[0]}; generators: {', '.join(GENERATORS)}") from None
    if not src.src:
        raise ValueError(f"data.sources[{src.source_name}]: 'src' (the dataset folder) is empty")
    location = folder = resolve_src(src, mirror)
    tmp = None
    if storage.is_s3(location):  # importers read files: fetch the dataset's prefix first
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="clarifier-source-")
        if not storage.download_prefix(location, tmp.name):
            raise FileNotFoundError(f"data.sources[{src.source_name}]: no files under {location}")
        folder = tmp.name
        if src.dataset:  # the mirror's prefix was only checked for presence: verify what came
            from clarifier.data.datasets import DatasetError, check_folder, get_dataset

            problems = check_folder(get_dataset(src.dataset), folder)
            if problems:
                tmp.cleanup()
                raise DatasetError(f"data.sources[{src.source_name}]: the copy of {src.dataset} in {location} does "
                                   f"not match the registry: {'; '.join(problems)}")
    elif not Path(location).exists():
        raise FileNotFoundError(
            f"data.sources[{src.source_name}]: src {src.src!r} does not exist (relative paths are relative to "
            f"the working directory {Path.cwd()})")
    examples: list[Example] = []
    skipped: list[dict] = []
    try:
        items = list(iter_dataset(src.importer, folder, src.options))
    finally:
        if tmp is not None:
            tmp.cleanup()
    for item in items:
        if isinstance(item, Skipped):
            skipped.append({"reason": item.reason, "where": item.where, "detail": item.detail})
        else:
            item.meta["source"] = src.source_name
            examples.append(item)
    return examples, skipped, location


def generate_source(src: SourceConfig, d: DataConfig) -> dict:
    """Write a generator source's conversation logs under ``<data.input>/<name>/``; its report entry."""
    name = src.source_name
    if src.max_examples is not None:
        raise ValueError(f"data.sources[{name}]: {src.importer} sources take options.conversations, not max_examples")
    known = (*GENERATOR_OPTIONS, *GENERATOR_EXTRA_OPTIONS.get(src.importer, ()))
    unknown = set(src.options) - set(known)
    if unknown:
        raise ValueError(f"data.sources[{name}]: unknown {src.importer} options {sorted(unknown)} "
                         f"(known: {', '.join(known)})")
    n = int(src.options.get("conversations", d.synthetic_conversations))
    seed = int(src.options.get("seed", d.seed))
    extra = {k: src.options[k] for k in GENERATOR_EXTRA_OPTIONS.get(src.importer, ()) if k in src.options}
    write_logs = importlib.import_module(GENERATORS[src.importer]).write_logs
    try:
        files = write_logs(storage.join(d.input, name), n, seed=seed, **extra)
    except ValueError as exc:
        raise ValueError(f"data.sources[{name}]: {exc}") from None
    return {"importer": src.importer, "conversations": n, "seed": seed, **extra, "files": files}


def materialize_sources(d: DataConfig, progress: Callable[[str], None] = print) -> dict:
    """Import every ``d.sources`` entry into ``d.input``; returns the per-source counts (also in ``_sources.json``)."""
    if not d.input:
        raise ValueError("data.sources needs data.input: the folder the sources are imported into")
    _check_owned(d.input)
    storage.delete_dir(d.input)
    report: dict[str, dict] = {}
    for src in d.sources:
        name = src.source_name
        if src.importer in GENERATORS:
            report[name] = generate_source(src, d)
            progress(f"[sources] {name}: {report[name]['conversations']} {src.importer} conversations")
            continue
        examples, skipped, location = _import_source(src, d.mirror)
        kept, dropped = cap_by_conversation(examples, src.max_examples, d.seed)
        uri = storage.join(d.input, f"{name}.jsonl")
        storage.write_text(uri, "".join(e.model_dump_json() + "\n" for e in kept))
        if skipped:
            storage.write_text(storage.join(d.input, f"{name}.skipped.json"), json.dumps(skipped, indent=1) + "\n")
        report[name] = {
            "importer": src.importer, "src": src.src, **({"read_from": location} if location != src.src else {}),
            "options": src.options, "imported": len(examples),
            "imported_clarify": sum(e.needs_clarification for e in examples), "skipped": len(skipped),
            "kept": len(kept), "kept_clarify": sum(e.needs_clarification for e in kept),
            "dropped_by_cap": len(dropped), "max_examples": src.max_examples, "file": uri,
        }
        progress(f"[sources] {name}: imported {len(examples)} ({report[name]['imported_clarify']} clarify), "
                 f"skipped {len(skipped)}, kept {len(kept)} ({report[name]['kept_clarify']} clarify)"
                 + (f", {len(dropped)} over max_examples={src.max_examples}" if dropped else ""))
    storage.write_text(storage.join(d.input, OWNER_FILE), json.dumps(report, indent=1) + "\n")
    return report



"""The importer interface shared by the built-in and third-party dataset importers.

An importer turns a published dataset folder into evaluation-set :class:`~clarifier.core.schema.Example`
records. It is an :class:`Importer`: a name, a pydantic ``options`` model (strict: an unknown or
ill-typed option is an error naming it) and a ``run(src, options)`` generator that yields, in
source order, one :class:`Example` or one :class:`Skipped` per *record* it read (what a record is
depends on the dataset and is said in ``Importer.unit``). Nothing is dropped silently: every
record read is either an example or a skip with a reason, so ``read == examples + skipped``.
"""

from __future__ import annotations

import collections
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from clarifier.core.config import validation_messages
from clarifier.core.schema import Example, describe_validation_error


@dataclass(frozen=True)
class Skipped:
    """A record the importer could not map: ``reason`` is a short code, ``where`` a file:line / id."""

    reason: str
    where: str
    detail: str = ""


@dataclass
class ImportResult:
    """All outcomes of one import (see :func:`clarifier.data.importers.import_dataset`)."""

    dataset: str
    unit: str
    examples: list[Example] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def read(self) -> int:
        return len(self.examples) + len(self.skipped)

    def skipped_by_reason(self) -> dict[str, int]:
        return dict(sorted(collections.Counter(s.reason for s in self.skipped).items()))

    def counts(self) -> dict[str, Any]:
        return summarize(self.dataset, self.unit, [label_key(e) for e in self.examples], self.skipped)


def label_key(e: Example) -> tuple[str, bool]:
    """What the counts need of an example: its source split and its label."""
    return str(e.meta.get("split") or ""), bool(e.needs_clarification)


def summarize(dataset: str, unit: str, labels: Iterable[tuple[str, bool]], skipped: Iterable[Skipped]) -> dict[str, Any]:
    """Counts per label and split (``labels``: ``(split, needs_clarification)`` per example), skips by reason."""
    labels, skipped = list(labels), list(skipped)
    by_split: dict[str, dict[str, int]] = {}
    for split, clar in labels:
        s = by_split.setdefault(split, {"examples": 0, "clarify": 0, "answer": 0})
        s["examples"] += 1
        s["clarify" if clar else "answer"] += 1
    clarify = sum(c for _, c in labels)
    return {
        "dataset": dataset,
        "unit": unit,
        "read": len(labels) + len(skipped),
        "examples": len(labels),
        "clarify": clarify,
        "answer": len(labels) - clarify,
        "by_split": dict(sorted(by_split.items())),
        "skipped": len(skipped),
        "skipped_by_reason": dict(sorted(collections.Counter(s.reason for s in skipped).items())),
    }


class ImporterOptions(BaseModel):
    """Base of every importer's options: strict, and ``a,b`` strings become lists (CLI ``--option``)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _split_commas(cls, v: Any, info) -> Any:
        ann = cls.model_fields[info.field_name].annotation
        if isinstance(v, str) and _accepts_list(ann):
            return [p.strip() for p in v.split(",") if p.strip()]
        return v


def _accepts_list(ann: Any) -> bool:
    if typing.get_origin(ann) is list:
        return True
    return any(_accepts_list(a) for a in typing.get_args(ann)) if typing.get_origin(ann) in (typing.Union, types.UnionType) else False


@dataclass(frozen=True)
class Importer:
    """A dataset importer: ``run(src_folder, options)`` yields ``Example | Skipped`` per record."""

    name: str
    options: type[BaseModel]
    run: Callable[[Path, BaseModel], Iterator[Example | Skipped]]
    unit: str = "record"
    description: str = ""

    def parse_options(self, options: Mapping[str, Any] | BaseModel | None) -> BaseModel:
        if isinstance(options, self.options):
            return options
        try:
            return self.options.model_validate(dict(options or {}))
        except ValidationError as exc:
            known = ", ".join(sorted(self.options.model_fields))
            msgs = validation_messages(exc, unknown="unknown option {loc!r} (known: " + known.replace("{", "{{") + ")",
                                       prefix="option ", empty_loc="options")
            raise ValueError(f"importer {self.name!r}: " + "; ".join(msgs)) from None


# ---- helpers for importers -------------------------------------------------------------------


def make_example(where: str, **fields: Any) -> Example | Skipped:
    """An Example, or a ``Skipped("invalid_example", where, <first validation error>)``."""
    try:
        return Example(**fields)
    except ValueError as exc:
        return Skipped("invalid_example", where, describe_validation_error(exc).replace("Value error, ", ""))


def short_hash(text: str, n: int = 12) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:n]


def require_dir(src: Path, dataset: str) -> Path:
    src = Path(src).expanduser()
    if not src.is_dir():
        raise FileNotFoundError(f"{dataset}: source folder {src} does not exist (or is not a folder)")
    return src


def split_files(src: Path, dataset: str, files: dict[str, str], splits: list[str] | None, hint: str) -> list[tuple[str, Path]]:
    """``(split, path)`` for the requested splits (default: those present), or an error naming what is missing."""
    src = require_dir(src, dataset)
    splits = splits or [s for s, f in files.items() if (src / f).is_file()]
    unknown = [s for s in splits if s not in files]
    if unknown:
        raise ValueError(f"{dataset}: unknown split(s) {unknown}; known: {', '.join(files)}")
    missing = [files[s] for s in splits if not (src / files[s]).is_file()]
    if missing or not splits:
        raise FileNotFoundError(f"{dataset}: no {', '.join(missing) or hint} in {src}")
    return [(s, src / files[s]) for s in splits]


def load_json(path: Path):
    """A whole JSON file, or ValueError naming the file, line and column."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None


def one_line(text: str) -> str:
    return " ".join(str(text).split())

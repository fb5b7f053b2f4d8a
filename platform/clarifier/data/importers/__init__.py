"""Importers for public clarification datasets -> evaluation-set ``Example`` records.

    from clarifier.data.importers import import_dataset, iter_dataset, get_importer, available_importers

    folder = resolve_dataset("pacific")              # clarifier.data.datasets: mirror or cache (data fetch)
    res = import_dataset("pacific", folder, {"passages": False})
    res.examples, res.skipped, res.counts()        # every record read is an example or a skip

    for item in iter_dataset("claqua", folder):     # streaming: Example | Skipped, in source order
        ...

Built-in importers (one module each; the label mapping is documented in each module and in
README "Public datasets"): ``clariq``, ``pacific``, ``abgcoqa``, ``claqua``.

**Third-party importers** are discovered through the entry-point group ``clarifier.importers``:
a package declares, e.g. in its ``pyproject.toml``::

    [project.entry-points."clarifier.importers"]
    mydata = "mypkg.importer:IMPORTER"

where ``IMPORTER`` is a :class:`~clarifier.data.importers.base.Importer` (or a zero-argument
callable returning one). Built-in names take precedence over entry points of the same name.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Iterator, Mapping

from pydantic import BaseModel

from clarifier.core.schema import Example
from clarifier.data.importers import abgcoqa, clariq, claqua, pacific
from clarifier.data.importers.base import Importer, ImporterOptions, ImportResult, Skipped, summarize

ENTRY_POINT_GROUP = "clarifier.importers"

BUILTIN: dict[str, Importer] = {imp.name: imp for imp in (clariq.IMPORTER, pacific.IMPORTER, abgcoqa.IMPORTER, claqua.IMPORTER)}

__all__ = [
    "BUILTIN", "ENTRY_POINT_GROUP", "Importer", "ImporterOptions", "ImportResult", "Skipped",
    "available_importers", "get_importer", "import_dataset", "iter_dataset", "summarize",
]


def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in BUILTIN}


def available_importers() -> list[str]:
    """Names of the built-in importers and of the installed third-party ones (not loaded)."""
    return sorted(set(BUILTIN) | set(_entry_points()))


def _load(ep) -> Importer:
    try:
        obj = ep.load()
    except Exception as exc:
        raise ImportError(f"importer {ep.name!r}: cannot load entry point {ep.value!r} "
                          f"(group {ENTRY_POINT_GROUP}): {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, Importer) and callable(obj):
        obj = obj()
    if not isinstance(obj, Importer):
        raise TypeError(f"importer {ep.name!r}: entry point {ep.value!r} gave {type(obj).__name__}, "
                        "not a clarifier.data.importers.Importer")
    return obj


def get_importer(name: str) -> Importer:
    """The importer registered under ``name`` (built-in first, then entry points)."""
    if name in BUILTIN:
        return BUILTIN[name]
    eps = _entry_points()
    if name in eps:
        return _load(eps[name])
    raise KeyError(f"no importer named {name!r}; available: {', '.join(available_importers())}")


def iter_dataset(name: str, src: str | Path, options: Mapping[str, Any] | BaseModel | None = None
                 ) -> Iterator[Example | Skipped]:
    """Stream the outcomes of importing ``src`` with importer ``name``: ``Example | Skipped`` per record.

    Options are validated before anything is read, so a bad option fails at once.
    """
    imp = get_importer(name)
    opts = imp.parse_options(options)
    return imp.run(Path(src), opts)


def import_dataset(name: str, src: str | Path, options: Mapping[str, Any] | BaseModel | None = None) -> ImportResult:
    """Import a whole dataset into memory: examples and skipped records (with reasons)."""
    imp = get_importer(name)
    res = ImportResult(dataset=imp.name, unit=imp.unit)
    for item in iter_dataset(name, src, options):
        (res.examples if isinstance(item, Example) else res.skipped).append(item)
    return res

"""The registered public datasets: the files each importer reads, where they are published, their
size, sha256 and license; and where a verified copy of one is found or fetched.

    data:
      mirror: /data/public                       # optional; else $CLARIFIER_DATA_MIRROR
      sources:
        - {importer: clariq, src: dataset:clariq}

    clarifier data fetch clariq                  # download into the cache, verified
    clarifier data fetch all --mirror /data/public   # or copy from a local mirror, verified

``src: dataset:<name>`` resolves (:func:`resolve_dataset`) to, in this order:

1. the **mirror** (``data.mirror``, else ``$CLARIFIER_DATA_MIRROR``): a local folder or ``s3://``
   prefix holding ``<name>/...`` in the layout below. A local copy is used in place when every
   file has its registered size and sha256 (about 0.1 s for all four sets); an ``s3://`` copy when
   every file exists (the data job downloads it and verifies the download, :func:`check_folder`);
2. the **download cache**, ``<cache>/<name>`` (``$CLARIFIER_CACHE/datasets``, default
   ``~/.cache/clarifier/datasets``): present when its stamp file -- written by :func:`fetch_dataset`
   after every file was verified -- lists the registered sha256 of every file and each file has its
   registered size (a cheap check: nothing is hashed again);
3. else :class:`DatasetNotFound`, naming both places and ``clarifier data fetch <name>``.

Files come from each dataset's own GitHub repository at a pinned commit (``raw.githubusercontent.com``),
or from ``$CLARIFIER_DATA_BASE_URL/<name>/<path>`` (an HTTP mirror: tests, air-gapped sites). Every
file is written to a temporary name beside its target and renamed only once its size and sha256
match, so nothing half-written or wrong is ever left in the cache. The entries were computed from
the published files; ``tests/unit/test_datasets.py`` checks them against a mirror's copy.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from clarifier.runtime import storage
from clarifier.runtime.retry import RetryPolicy

MIRROR_ENV = "CLARIFIER_DATA_MIRROR"
BASE_URL_ENV = "CLARIFIER_DATA_BASE_URL"
STAMP = ".clarifier-verified.json"  # in <cache>/<name>/, written after every file was verified
FETCH_RETRY = RetryPolicy(attempts=4, min_s=1.0, max_s=10.0)
_RETRIED_HTTP = {408, 425, 429, 500, 502, 503, 504}
_TIMEOUT_S = 60


class DatasetError(ValueError):
    """A registered dataset is unknown, or a copy of one does not match the registry."""


class DatasetNotFound(FileNotFoundError):
    """Neither the mirror nor the download cache holds a verified copy of the dataset."""


@dataclass(frozen=True)
class DataFile:
    path: str    # inside the dataset's folder: the layout the importer reads
    url: str     # where it is published
    size: int    # bytes
    sha256: str


@dataclass(frozen=True)
class Dataset:
    name: str
    title: str
    repository: str  # the dataset's official repository
    commit: str      # the files' URLs are pinned to this commit of it
    license: str
    files: tuple[DataFile, ...] = field(default=())

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def _github(name: str, title: str, repo: str, commit: str, license: str,
            files: list[tuple[str, str, int, str]]) -> Dataset:
    """A dataset whose files are ``(path in the dataset folder, path in the repository, size, sha256)``."""
    return Dataset(name, title, f"https://github.com/{repo}", commit, license, tuple(
        DataFile(path, f"https://raw.githubusercontent.com/{repo}/{commit}/{upstream}", size, sha)
        for path, upstream, size, sha in files))


# Sizes and sha256 of the published files; each file's git blob id was checked against the repository
# at the pinned commit (2026-12-01). Only the splits the importers are tested on are registered; the
# repositories hold more (e.g. train splits), which `clarifier data import --src` reads from a full clone.
REGISTRY: dict[str, Dataset] = {d.name: d for d in (
    _github("clariq", "ClariQ (ConvAI3; Aliannejadi et al., 2020)", "aliannejadi/ClariQ",
            "46885a544581a0af8aff0681d29e4971807e2912",
            "none stated: the repository has no LICENSE file (see its README)", [
                ("train.tsv", "data/train.tsv", 2354040, "65d3da13b2d6ea77e7eaa45290894ffc162a5bd000e7640decd1b0a272a6e9d1"),
                ("dev.tsv", "data/dev.tsv", 585998, "68d2a5f87eab73721979b5f45f64099a9b2f080db1d0ce4b979d9daa4249906e"),
                ("question_bank.tsv", "data/question_bank.tsv", 239064, "266f501bdc31afbc8a763685ea0de82949137a2779241b325f5ee03026f42f1b"),
                ("README.md", "README.md", 33225, "af1a108ec0f1f4070a2540f9f5e4f832aad55933f58df75e034edb62085d0772"),
            ]),
    _github("pacific", "PACIFIC (Deng et al., EMNLP 2022)", "dengyang17/PACIFIC",
            "66a52ad4fd9eb7ad71e82a5c0bfb1de226366827", "MIT", [
                ("validation.json", "data/pacific/validation.json", 2110007, "a5769b1a2d638e4cc1bc83f6d823361bc2fbae2a4438cdb594ff2bf1b5576781"),
                ("LICENSE", "LICENSE", 1067, "e8901791948c10af08861365c4a0b1cb2048eaf84b650215f4c412b011c3edb0"),
                ("README.md", "README.md", 1501, "c81e460b1d94b182a078cf7cbb7e0c0fe618136aa09295ac75f3970ca25c9c32"),
            ]),
    _github("abgcoqa", "Abg-CoQA (Guo et al., AKBC 2021)", "MeiqiGuo/AKBC2021-Abg-CoQA",
            "3fce317899212847c22e8a6d74dcb0f1b3cb4b56", "MIT", [
                ("coqa_abg_val.json", "abg-coqa/coqa_abg_val.json", 2648037, "219f1400873902da47545980869a044507b6875bedfeb5dc42b32dfa67b99c8d"),
                ("LICENSE", "LICENSE", 1066, "0b9ed228aa299328dba5ef0def4133e7db6ef586ba12472149d752de030c8543"),
                ("README.md", "README.md", 664, "0d7626bf3706c2be7be16fe41a321ba51ae1b858a036ef7579b3d2e8c4f1419c"),
            ]),
    _github("claqua", "CLAQUA (Xu et al., EMNLP 2019; repository MSParS_V2.0)", "msra-nlc/MSParS_V2.0",
            "3e215b5f6ef47040275b3612fd2e1d5591909039", "Apache-2.0", [
                (p, p, size, sha) for p, size, sha in (
                    ("data/single-turn/task1/dev_classifier.txt", 983677, "d6e4b4b445e2397212d2405647ce8b0f5ed354a157bb380544986dd46c354b58"),
                    ("data/single-turn/task2/src-train.txt", 3669723, "318c1e3bb0b6507abf37def57d75629fa1bfb0842be37457ab0d7e974bc4c4f3"),
                    ("data/single-turn/task2/tgt-train.txt", 543563, "aea8594b026c6d5501e775c5c2034b4be234b70bb39674bd98bfed406c6ea436"),
                    ("data/single-turn/task2/src-val.txt", 444814, "831f8df9679a23dc63043b88486a4670d2ec428945e1e027fd4b547141186015"),
                    ("data/single-turn/task2/tgt-val.txt", 69472, "3ca278bf75700345172ce74a241d89dea51b4e3f3f5289b0289d8604f263a458"),
                    ("data/multi-turn/task1/dev_classifier.txt", 1527540, "2afd6637f89ece19ff99eb60614b5c9c9294ef206a9c49e9d1f32b2ef4a9b01b"),
                    ("data/multi-turn/task2/tgt-train.txt", 1621349, "b6ccf3b94623a1bcba5e3e7629074e0f013bc03d26a901effc79c07eca3071a1"),
                    ("data/multi-turn/task2/src-val.txt", 663298, "d2f3ffe47116a5a017bdc47903a5fedafb0b0f2a83d29ef418cb33b38ea801c8"),
                    ("data/multi-turn/task2/tgt-val.txt", 46431, "91ff579848c0e55265ecd39700611b7cec374ef241abe23483285b50452e3025"),
                    ("LICENSE", 11357, "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"),
                    ("README.md", 10028, "ff320c5da78b8ea7b7978b7f6dfe07e26063947c6cd635f5f384c4d70278f3a6"),
                )]),
)}


def get_dataset(name: str) -> Dataset:
    try:
        return REGISTRY[name]
    except KeyError:
        raise DatasetError(f"no registered dataset named {name!r} (registered: {', '.join(sorted(REGISTRY))})") from None


def default_cache() -> Path:
    """The download cache: ``$CLARIFIER_CACHE/datasets``, else ``~/.cache/clarifier/datasets``."""
    return storage.cache_root() / "datasets"


def mirror_location(mirror: str | None = None) -> str | None:
    """The mirror in use: ``mirror`` (``data.mirror``), else ``$CLARIFIER_DATA_MIRROR``, else None."""
    return mirror or os.environ.get(MIRROR_ENV) or None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_folder(ds: Dataset, folder: str | Path, hashes: bool = True) -> list[str]:
    """What is wrong with a local copy of ``ds`` in ``folder`` (empty: every file has its registered
    size and, with ``hashes``, sha256). Files the registry does not list are ignored."""
    problems = []
    for f in ds.files:
        p = Path(folder) / f.path
        if not p.is_file():
            problems.append(f"{f.path} missing")
        elif p.stat().st_size != f.size:
            problems.append(f"{f.path} has {p.stat().st_size} bytes, expected {f.size}")
        elif hashes and (got := sha256_of(p)) != f.sha256:
            problems.append(f"{f.path} sha256 {got}, expected {f.sha256}")
    return problems


def _read_stamp(folder: Path) -> dict[str, str]:
    try:
        files = json.loads((folder / STAMP).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return {}
    return files if isinstance(files, dict) else {}


def cache_problems(ds: Dataset, folder: Path) -> list[str]:
    """Why ``folder`` does not count as a verified copy of ``ds`` (empty: it does): its stamp must list
    every registered file with its sha256, and every file must have its registered size."""
    if not folder.is_dir():
        return ["missing"]
    stamp = _read_stamp(folder)
    unverified = [f.path for f in ds.files if stamp.get(f.path) != f.sha256]
    if unverified:
        return [f"not verified by `clarifier data fetch` ({STAMP} lacks {', '.join(unverified[:3])}"
                + (f" and {len(unverified) - 3} more" if len(unverified) > 3 else "") + ")"]
    return check_folder(ds, folder, hashes=False)


def _mirror_problems(ds: Dataset, folder: str) -> list[str]:
    if storage.is_s3(folder):
        return [f"{f.path} missing" for f in ds.files if not storage.exists(storage.join(folder, f.path))]
    return check_folder(ds, folder) if Path(folder).is_dir() else ["missing"]


def _summary(problems: list[str]) -> str:
    return "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")


def resolve_dataset(name: str, mirror: str | None = None, cache: str | Path | None = None) -> str:
    """The folder (or ``s3://`` prefix) of a verified copy of the registered dataset ``name``: the
    mirror's ``<name>/`` (``mirror``, else ``$CLARIFIER_DATA_MIRROR``), else the download cache's
    (``cache``, else :func:`default_cache`); else :class:`DatasetNotFound` naming both places."""
    ds = get_dataset(name)
    looked = []
    root = mirror_location(mirror)
    if root:
        folder = storage.join(root, name)
        problems = _mirror_problems(ds, folder)
        if not problems:
            return folder
        looked.append(f"mirror {folder}: {_summary(problems)}")
    else:
        looked.append(f"mirror: none set (data.mirror or ${MIRROR_ENV})")
    folder = Path(cache) if cache else default_cache()
    problems = cache_problems(ds, folder / name)
    if not problems:
        return str(folder / name)
    looked.append(f"download cache {folder / name}: {_summary(problems)}")
    raise DatasetNotFound(
        f"dataset {name!r} not found -- " + "; ".join(looked) + f". Run `clarifier data fetch {name}` "
        f"(downloads it into the cache; --mirror DIR copies it from a local mirror), or point data.mirror "
        f"/ ${MIRROR_ENV} at a folder holding {name}/")


# ---- fetching ------------------------------------------------------------------------------------


@dataclass
class FetchReport:
    dataset: str
    folder: str
    fetched: list[str] = field(default_factory=list)   # files copied or downloaded now
    present: list[str] = field(default_factory=list)   # files already verified there
    errors: list[str] = field(default_factory=list)    # one message per file that failed

    @property
    def ok(self) -> bool:
        return not self.errors


def _source_of(ds: Dataset, f: DataFile, mirror: str | None, base_url: str | None) -> str:
    if mirror:
        return storage.join(mirror, ds.name, f.path)
    if base_url:
        return f"{base_url.rstrip('/')}/{ds.name}/{f.path}"
    return f.url


def _open(source: str) -> IO[bytes]:
    if source.startswith(("http://", "https://")):
        import clarifier

        req = urllib.request.Request(source, headers={"User-Agent": f"clarifier/{clarifier.__version__}"})
        return urllib.request.urlopen(req, timeout=_TIMEOUT_S)  # noqa: S310 (http(s) only)
    fs, path = storage.filesystem(source)
    return fs.open_input_stream(path)


def _permanent(exc: BaseException) -> bool:
    """An HTTP answer that a retry will not change (404, 403, ...)."""
    return isinstance(exc, urllib.error.HTTPError) and exc.code not in _RETRIED_HTTP


def _copy_verified(source: str, f: DataFile, target: Path, name: str) -> None:
    """One try: ``source`` -> a temporary file beside ``target``, renamed to it only when the size and
    sha256 match; else the temporary file is removed and the mismatch raised."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        h, n = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out, _open(source) as inp:
            while chunk := inp.read(1 << 20):
                out.write(chunk)
                h.update(chunk)
                n += len(chunk)
        if n != f.size or h.hexdigest() != f.sha256:
            raise DatasetError(f"{name}/{f.path} from {source} does not match the registry: expected {f.size} bytes "
                               f"sha256 {f.sha256}, got {n} bytes sha256 {h.hexdigest()}")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared cache from other users
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_stamp(ds: Dataset, folder: Path, verified: dict[str, str]) -> None:
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{STAMP}.", suffix=".part")
    with os.fdopen(fd, "w") as out:
        json.dump({"dataset": ds.name, "files": verified}, out, indent=1, sort_keys=True)
    os.chmod(tmp, 0o644)
    os.replace(tmp, folder / STAMP)


def fetch_dataset(name: str, cache: str | Path | None = None, mirror: str | None = None,
                  retry: RetryPolicy = FETCH_RETRY, progress: Callable[[str], None] = print) -> FetchReport:
    """Bring every file of the registered dataset ``name`` into ``<cache>/<name>`` (``cache``, else
    :func:`default_cache`), verified: from ``mirror`` (a local folder or ``s3://`` prefix holding
    ``<name>/``) when given, else downloaded from ``$CLARIFIER_DATA_BASE_URL/<name>/<path>`` when set,
    else from the file's published URL; network errors are retried by ``retry``. A file already there
    with its registered size and sha256 is kept. One ``progress`` line per file; a file that fails is
    recorded in the report's ``errors`` (the others are still fetched) and never left in the cache.
    The stamp that :func:`resolve_dataset` reads is written once every file is verified."""
    ds = get_dataset(name)
    folder = (Path(cache) if cache else default_cache()) / name
    folder.mkdir(parents=True, exist_ok=True)
    base_url = os.environ.get(BASE_URL_ENV) or None
    report = FetchReport(name, str(folder))
    stamp = _read_stamp(folder)
    verified: dict[str, str] = {}
    for f in ds.files:
        target = folder / f.path
        if target.is_file() and target.stat().st_size == f.size and (
                stamp.get(f.path) == f.sha256 or sha256_of(target) == f.sha256):
            verified[f.path] = f.sha256
            report.present.append(f.path)
            progress(f"{name}/{f.path}: already verified ({_mib(f.size)})")
            continue
        source = _source_of(ds, f, mirror, base_url)
        try:
            retry.call(lambda: _copy_verified(source, f, target, name), unless=_permanent,
                       on=(urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError))
        except (DatasetError, OSError, http.client.HTTPException) as exc:  # URLError is an OSError
            report.errors.append(str(exc) if isinstance(exc, DatasetError) else f"{name}/{f.path} from {source}: {exc}")
            progress(f"{name}/{f.path}: FAILED: {report.errors[-1]}")
            continue
        verified[f.path] = f.sha256
        report.fetched.append(f.path)
        progress(f"{name}/{f.path}: {'copied' if mirror else 'downloaded'} {_mib(f.size)}, sha256 ok ({source})")
    if report.ok:
        _write_stamp(ds, folder, verified)
    progress(f"{name}: {len(ds.files)} files, {_mib(ds.size)} in {folder}: {len(report.fetched)} fetched, "
             f"{len(report.present)} already verified" + (f", {len(report.errors)} FAILED" if report.errors else ""))
    return report


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"

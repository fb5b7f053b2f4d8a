"""The public-dataset registry and `src: dataset:<name>`: the registry against the published files,
resolution order (mirror > cache > error), fetching over loopback HTTP (verified, retried, nothing
half-written left), `clarifier data fetch`, and the recipes' dataset references."""

from __future__ import annotations

import hashlib
import re
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from clarifier.core.config import ConfigError, build_config
from clarifier.data import datasets
from clarifier.data.datasets import (REGISTRY, STAMP, DataFile, Dataset, DatasetError, DatasetNotFound, check_folder,
                                     fetch_dataset, resolve_dataset)
from clarifier.runtime.retry import RetryPolicy
from support.paths import PUBLIC

needs_public = pytest.mark.skipif(not PUBLIC.is_dir(), reason=f"public datasets not found at {PUBLIC} (../shared beside the repository)")
TOY_FILES = {"a.txt": b"alpha\n" * 100, "sub/b.txt": b"beta\n"}
NO_WAIT = RetryPolicy(attempts=3, min_s=1.0, sleep=lambda s: None)


@pytest.fixture(autouse=True)
def _no_mirror_or_base_url(monkeypatch, tmp_path):
    """Each test says which mirror it uses; the default cache is a fresh folder, never ~/.cache."""
    monkeypatch.delenv(datasets.MIRROR_ENV, raising=False)
    monkeypatch.delenv(datasets.BASE_URL_ENV, raising=False)
    monkeypatch.setenv("CLARIFIER_CACHE", str(tmp_path / "clarifier-cache"))


@pytest.fixture
def server(tmp_path):
    """A loopback HTTP server over a temp folder; records each GET, answers ``failures[path]`` once."""
    root = tmp_path / "served"
    root.mkdir()
    requests: list[str] = []
    failures: dict[str, int] = {}

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self):
            requests.append(self.path)
            code = failures.pop(self.path, None)
            if code:
                self.send_error(code)
            else:
                super().do_GET()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield SimpleNamespace(url=f"http://127.0.0.1:{httpd.server_address[1]}", root=root, requests=requests, failures=failures)
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def write_files(folder: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


@pytest.fixture
def toy(monkeypatch, tmp_path):
    """A registered dataset 'toy' of two small files, published at an unreachable URL; a mirror holding it."""
    ds = Dataset("toy", "Toy", "https://example.invalid/toy", "0" * 40, "MIT", tuple(
        DataFile(rel, f"https://example.invalid/toy/{rel}", len(data), hashlib.sha256(data).hexdigest())
        for rel, data in TOY_FILES.items()))
    monkeypatch.setitem(REGISTRY, "toy", ds)
    mirror = tmp_path / "mirror"
    write_files(mirror / "toy", TOY_FILES)
    return SimpleNamespace(ds=ds, mirror=mirror, cache=tmp_path / "cache")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.part"))


# ---- the registry ----------------------------------------------------------------------------------


@needs_public
def test_registry_matches_the_published_files_in_the_mirror():
    """Every registered file is in ../shared/data/public with its size and sha256, and the registry
    lists every file there: fetching gives the importers exactly the data the tests measure."""
    from clarifier.data.importers import available_importers

    assert {"clariq", "pacific", "abgcoqa", "claqua"} <= set(REGISTRY) <= set(available_importers())
    for name, ds in REGISTRY.items():
        assert check_folder(ds, PUBLIC / name) == [], name
        on_disk = {p.relative_to(PUBLIC / name).as_posix() for p in (PUBLIC / name).rglob("*") if p.is_file()}
        assert on_disk == {f.path for f in ds.files}, name
        assert re.fullmatch(r"[0-9a-f]{40}", ds.commit) and ds.license and ds.repository.startswith("https://github.com/")
        repo = ds.repository.removeprefix("https://github.com/")
        for f in ds.files:
            assert f.url.startswith(f"https://raw.githubusercontent.com/{repo}/{ds.commit}/"), f.url
            assert re.fullmatch(r"[0-9a-f]{64}", f.sha256)


def test_unknown_dataset_names_the_registered_ones():
    with pytest.raises(DatasetError, match=r"no registered dataset named 'nope' \(registered: abgcoqa, claqua, clariq, pacific"):
        resolve_dataset("nope")


# ---- resolution order ------------------------------------------------------------------------------


def test_mirror_first_then_cache_then_an_error_naming_both(toy, monkeypatch):
    fetch_dataset("toy", cache=toy.cache, mirror=str(toy.mirror), progress=lambda m: None)
    assert resolve_dataset("toy", str(toy.mirror), toy.cache) == str(toy.mirror / "toy")
    monkeypatch.setenv(datasets.MIRROR_ENV, str(toy.mirror))
    assert resolve_dataset("toy", cache=toy.cache) == str(toy.mirror / "toy")  # the env var when no data.mirror
    assert resolve_dataset("toy", str(toy.mirror / "nowhere"), toy.cache) == str(toy.cache / "toy")  # data.mirror wins
    monkeypatch.delenv(datasets.MIRROR_ENV)

    # a mirror copy that differs (same size, other bytes) is not used: the verified cache is
    (toy.mirror / "toy" / "a.txt").write_bytes(b"ALPHA\n" * 100)
    assert resolve_dataset("toy", str(toy.mirror), toy.cache) == str(toy.cache / "toy")

    (toy.cache / "toy" / STAMP).unlink()  # files there, but never verified: not a copy
    with pytest.raises(DatasetNotFound) as err:
        resolve_dataset("toy", str(toy.mirror), toy.cache)
    msg = str(err.value)
    assert f"mirror {toy.mirror / 'toy'}: a.txt sha256 " in msg and toy.ds.files[0].sha256 in msg
    assert f"download cache {toy.cache / 'toy'}: not verified" in msg
    assert "`clarifier data fetch toy`" in msg and "data.mirror" in msg and "$CLARIFIER_DATA_MIRROR" in msg

    with pytest.raises(DatasetNotFound, match=r"mirror: none set \(data.mirror or \$CLARIFIER_DATA_MIRROR\); "
                                              r"download cache .*/clarifier-cache/datasets/toy: missing"):
        resolve_dataset("toy")  # defaults: no mirror, $CLARIFIER_CACHE/datasets


def test_cache_counts_only_with_its_stamp_and_every_file_at_its_size(toy):
    write_files(toy.cache / "toy", TOY_FILES)  # copied by hand: no stamp
    with pytest.raises(DatasetNotFound, match="not verified by `clarifier data fetch`"):
        resolve_dataset("toy", cache=toy.cache)
    msgs: list[str] = []
    rep = fetch_dataset("toy", cache=toy.cache, progress=msgs.append)  # hashes them, downloads nothing
    assert rep.ok and rep.present == ["a.txt", "sub/b.txt"] and rep.fetched == []
    assert resolve_dataset("toy", cache=toy.cache) == str(toy.cache / "toy")
    (toy.cache / "toy" / "a.txt").write_bytes(b"alpha\n")  # damaged after the stamp
    with pytest.raises(DatasetNotFound, match=r"a.txt has 6 bytes, expected 600"):
        resolve_dataset("toy", cache=toy.cache)


# ---- fetching ---------------------------------------------------------------------------------------


def test_fetch_over_http_verifies_writes_the_stamp_and_skips_verified_files(toy, server, monkeypatch):
    write_files(server.root / "toy", TOY_FILES)
    monkeypatch.setenv(datasets.BASE_URL_ENV, server.url + "/")
    msgs: list[str] = []
    rep = fetch_dataset("toy", cache=toy.cache, progress=msgs.append)
    assert rep.ok and rep.fetched == ["a.txt", "sub/b.txt"]
    assert server.requests == ["/toy/a.txt", "/toy/sub/b.txt"]
    assert all((toy.cache / "toy" / rel).read_bytes() == data for rel, data in TOY_FILES.items())
    assert len(msgs) == 3 and msgs[0].startswith("toy/a.txt: downloaded") and f"({server.url}/toy/a.txt)" in msgs[0]
    assert msgs[-1].startswith("toy: 2 files") and "2 fetched, 0 already verified" in msgs[-1]
    assert resolve_dataset("toy", cache=toy.cache) == str(toy.cache / "toy")

    msgs.clear()
    rep = fetch_dataset("toy", cache=toy.cache, progress=msgs.append)
    assert rep.present == ["a.txt", "sub/b.txt"] and len(server.requests) == 2  # nothing downloaded again
    assert [m.split(":")[1].strip() for m in msgs[:2]] == ["already verified (0.6 KiB)", "already verified (0.0 KiB)"]


def test_fetch_without_base_url_uses_the_published_url(toy, server, monkeypatch):
    write_files(server.root / "published", TOY_FILES)
    files = tuple(DataFile(f.path, f"{server.url}/published/{f.path}", f.size, f.sha256) for f in toy.ds.files)
    monkeypatch.setitem(REGISTRY, "toy", Dataset("toy", "Toy", toy.ds.repository, toy.ds.commit, "MIT", files))
    assert fetch_dataset("toy", cache=toy.cache, progress=lambda m: None).ok
    assert server.requests == ["/published/a.txt", "/published/sub/b.txt"]


def test_checksum_mismatch_names_file_url_expected_and_got_and_leaves_nothing(toy, server, monkeypatch):
    bad = b"alpha\n" * 99 + b"ALPHA\n"  # right size, wrong bytes
    write_files(server.root / "toy", {**TOY_FILES, "a.txt": bad})
    monkeypatch.setenv(datasets.BASE_URL_ENV, server.url)
    msgs: list[str] = []
    rep = fetch_dataset("toy", cache=toy.cache, retry=NO_WAIT, progress=msgs.append)
    assert not rep.ok and rep.fetched == ["sub/b.txt"] and len(rep.errors) == 1
    err = rep.errors[0]
    assert err.startswith(f"toy/a.txt from {server.url}/toy/a.txt does not match the registry")
    assert f"expected 600 bytes sha256 {toy.ds.files[0].sha256}" in err
    assert f"got 600 bytes sha256 {hashlib.sha256(bad).hexdigest()}" in err
    assert server.requests.count("/toy/a.txt") == 1  # a wrong file is not a transient error
    assert not (toy.cache / "toy" / "a.txt").exists() and leftovers(toy.cache) == []
    assert not (toy.cache / "toy" / STAMP).exists() and "1 FAILED" in msgs[-1]
    with pytest.raises(DatasetNotFound):
        resolve_dataset("toy", cache=toy.cache)


def test_transient_http_errors_are_retried_and_a_404_is_not(toy, server, monkeypatch):
    write_files(server.root / "toy", {"a.txt": TOY_FILES["a.txt"]})  # sub/b.txt is not served
    monkeypatch.setenv(datasets.BASE_URL_ENV, server.url)
    server.failures["/toy/a.txt"] = 503
    waits: list[float] = []
    rep = fetch_dataset("toy", cache=toy.cache, retry=RetryPolicy(attempts=3, min_s=1.0, sleep=waits.append),
                        progress=lambda m: None)
    assert rep.fetched == ["a.txt"] and server.requests.count("/toy/a.txt") == 2 and waits == [1.0]
    assert server.requests.count("/toy/sub/b.txt") == 1
    assert len(rep.errors) == 1 and rep.errors[0].startswith(f"toy/sub/b.txt from {server.url}/toy/sub/b.txt: HTTP Error 404")
    assert leftovers(toy.cache) == [] and not (toy.cache / "toy" / "sub" / "b.txt").exists()


def test_fetch_from_a_mirror_copies_and_verifies(toy):
    (toy.mirror / "toy" / "sub" / "b.txt").write_bytes(b"BETA\n")
    rep = fetch_dataset("toy", cache=toy.cache, mirror=str(toy.mirror), progress=lambda m: None)
    assert rep.fetched == ["a.txt"] and "toy/sub/b.txt from " in rep.errors[0] and "does not match" in rep.errors[0]
    shutil.rmtree(toy.mirror / "toy" / "sub")
    rep = fetch_dataset("toy", cache=toy.cache, mirror=str(toy.mirror), progress=lambda m: None)
    assert rep.present == ["a.txt"] and "toy/sub/b.txt from " in rep.errors[0] and leftovers(toy.cache) == []


# ---- the CLI -------------------------------------------------------------------------------------------


@needs_public
def test_cli_fetch_all_from_the_mirror_then_resolution_finds_the_cache(tmp_path):
    from clarifier.cli import app

    r = CliRunner().invoke(app, ["data", "fetch", "all", "--mirror", str(PUBLIC), "--cache", str(tmp_path / "ds")])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    n_files = sum(len(ds.files) for ds in REGISTRY.values())
    assert sum(": copied " in x and "sha256 ok" in x for x in lines) == n_files
    assert lines[-1] == f"{len(REGISTRY)} of {len(REGISTRY)} dataset(s) verified in {tmp_path / 'ds'}"
    for name in REGISTRY:
        assert resolve_dataset(name, cache=tmp_path / "ds") == str(tmp_path / "ds" / name)
    r = CliRunner().invoke(app, ["data", "fetch", "pacific", "--cache", str(tmp_path / "ds")])  # nothing to download
    assert r.exit_code == 0 and r.output.count("already verified") == 3 + 1


def test_cli_fetch_errors(toy, server, monkeypatch, tmp_path):
    from clarifier.cli import app

    r = CliRunner().invoke(app, ["data", "fetch", "nope"])
    assert r.exit_code == 2 and "no registered dataset named 'nope'" in r.output
    write_files(server.root / "toy", {"a.txt": b"x" * 600, "sub/b.txt": TOY_FILES["sub/b.txt"]})
    monkeypatch.setenv(datasets.BASE_URL_ENV, server.url)
    monkeypatch.setattr(datasets, "FETCH_RETRY", NO_WAIT)
    r = CliRunner().invoke(app, ["data", "fetch", "toy", "--cache", str(tmp_path / "ds")])
    assert r.exit_code == 1 and "toy/a.txt: FAILED: toy/a.txt from" in r.output
    assert r.output.splitlines()[-1] == f"0 of 1 dataset(s) verified in {tmp_path / 'ds'}; FAILED: toy"


def test_cli_import_takes_a_dataset_ref(tmp_path, monkeypatch):
    from clarifier.cli import app

    r = CliRunner().invoke(app, ["data", "import", "pacific", "--src", "dataset:pacific", "--out", str(tmp_path / "p.jsonl")])
    assert r.exit_code == 2 and "dataset 'pacific' not found" in r.output and "clarifier data fetch pacific" in r.output
    if not PUBLIC.is_dir():
        pytest.skip(f"public datasets not found at {PUBLIC}")
    monkeypatch.setenv(datasets.MIRROR_ENV, str(PUBLIC))
    r = CliRunner().invoke(app, ["data", "import", "pacific", "--src", "dataset:pacific", "--out", str(tmp_path / "p.jsonl")])
    assert r.exit_code == 0, r.output
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 1982


# ---- recipes and data.sources ------------------------------------------------------------------------


def test_recipes_name_registered_datasets_and_dataset_refs_are_checked():
    from clarifier.data.sources import GENERATORS
    from clarifier.recipes import load_recipe
    from clarifier.runtime.submit import portable_config

    for recipe in ("joint-public", "joint-public-gpu"):
        sources = [s for s in load_recipe(recipe).data.sources if s.importer not in GENERATORS]
        assert [s.src for s in sources] == [f"dataset:{s.importer}" for s in sources]
        assert {s.dataset for s in sources} == {"clariq", "pacific", "abgcoqa", "claqua"} <= set(REGISTRY)
    assert load_recipe("joint-public").data.mirror is None
    assert load_recipe("joint-public-gpu").data.mirror == "s3://clarifier-data/public"
    with pytest.raises(ConfigError, match=r"data.sources.0.src: .*'dataset:' names no dataset"):
        build_config({"data": {"sources": [{"importer": "clariq", "src": "dataset:"}]}})
    # a submitted job gets the reference as it is (no path made of it) and an absolute mirror
    cfg = build_config({"data": {"mirror": "public", "sources": [{"importer": "clariq", "src": "dataset:clariq"},
                                                                 {"importer": "pacific", "src": "pac"}]}})
    job = portable_config(cfg, progress=lambda m: None)
    assert job.data.sources[0].src == "dataset:clariq" and job.data.mirror == str(Path("public").resolve())
    assert job.data.sources[1].src == str(Path("pac").resolve())


def test_materialize_names_the_missing_dataset_and_the_fetch_command(tmp_path):
    from clarifier.data.sources import materialize_sources

    cfg = build_config({"data": {"input": str(tmp_path / "in"), "mirror": str(tmp_path / "empty-mirror"),
                                 "sources": [{"importer": "clariq", "src": "dataset:clariq"}]}})
    with pytest.raises(DatasetNotFound, match=r"data.sources\[clariq\]: dataset 'clariq' not found -- mirror "
                                              r".*empty-mirror/clariq: missing; download cache .*: missing\. "
                                              r"Run `clarifier data fetch clariq`"):
        materialize_sources(cfg.data, lambda m: None)
    bad = build_config({"data": {"input": str(tmp_path / "in2"), "sources": [{"importer": "clariq", "src": "dataset:nope"}]}})
    with pytest.raises(DatasetError, match=r"data.sources\[clariq\]: no registered dataset named 'nope'"):
        materialize_sources(bad.data, lambda m: None)


@needs_public
def test_materialize_reads_a_dataset_ref_from_the_mirror(tmp_path, monkeypatch):
    from clarifier.data.sources import materialize_sources

    cfg = build_config({"data": {"input": str(tmp_path / "in"), "mirror": str(PUBLIC),
                                 "sources": [{"importer": "clariq", "src": "dataset:clariq", "max_examples": 10}]}})
    rep = materialize_sources(cfg.data, lambda m: None)["clariq"]
    assert rep["src"] == "dataset:clariq" and rep["read_from"] == str(PUBLIC / "clariq")
    assert rep["imported"] == 237 and rep["kept"] == 10
    # the same through $CLARIFIER_DATA_MIRROR (what tests/conftest.py sets on this machine)
    monkeypatch.setenv(datasets.MIRROR_ENV, str(PUBLIC))
    cfg = build_config({"data": {"input": str(tmp_path / "in"), "sources": [{"importer": "clariq", "src": "dataset:clariq"}]}})
    assert materialize_sources(cfg.data, lambda m: None)["clariq"]["read_from"] == str(PUBLIC / "clariq")

"""Local folders and ``s3://`` prefixes behind one small API (pyarrow filesystems).

S3 credentials come from the usual AWS environment / profile; an S3-compatible endpoint (MinIO,
s3rver) is set with ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (or the config's
``storage.s3_endpoint_url``, which is exported to those variables).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import pyarrow.fs as pafs


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


def s3_max_attempts() -> int:
    """Attempts per S3 request (``CLARIFIER_S3_MAX_ATTEMPTS``, default 5)."""
    raw = os.environ.get("CLARIFIER_S3_MAX_ATTEMPTS", "5")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"CLARIFIER_S3_MAX_ATTEMPTS must be an integer >= 1 (got {raw!r})") from None
    if n < 1:
        raise ValueError(f"CLARIFIER_S3_MAX_ATTEMPTS must be >= 1 (got {n})")
    return n


def cache_root() -> Path:
    """This machine's cache of the package: ``$CLARIFIER_CACHE``, else ``~/.cache/clarifier``
    (``models/``: resolved base models, ``registry/``: registry downloads, ``datasets/``: public datasets)."""
    return Path(os.environ.get("CLARIFIER_CACHE") or Path.home() / ".cache" / "clarifier")


def set_s3_endpoint(url: str | None) -> None:
    """Export an endpoint override so every library in this process and its Ray workers use it."""
    if url:
        os.environ["AWS_ENDPOINT_URL"] = url
        os.environ["AWS_ENDPOINT_URL_S3"] = url


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """``(filesystem, path)`` for a local path or an ``s3://bucket/key`` URI."""
    if is_s3(uri):
        u = urlparse(uri)
        ep = s3_endpoint()
        kw = {}
        if ep:
            pu = urlparse(ep)
            kw = {"endpoint_override": pu.netloc or ep, "scheme": pu.scheme or "http"}
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        # Transient errors (throttling, a store restarting) are retried with the SDK's exponential
        # backoff; after the last attempt the error surfaces and the calling job fails cleanly.
        retries = pafs.AwsStandardS3RetryStrategy(max_attempts=s3_max_attempts())
        return (pafs.S3FileSystem(region=region, retry_strategy=retries, connect_timeout=5, request_timeout=30, **kw),
                f"{u.netloc}{u.path}".rstrip("/"))
    return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())


def join(base: str, *parts: str) -> str:
    if is_s3(base):
        return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])
    return str(Path(base, *parts))


def write_text(uri: str, text: str) -> None:
    fs, path = filesystem(uri)
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(text.encode())


def read_text(uri: str) -> str:
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def delete_dir(uri: str) -> None:
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)


def delete_file(uri: str) -> None:
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type == pafs.FileType.File:
        fs.delete_file(path)


def sizes(uris: list[str]) -> dict[str, int]:
    """Byte size of each file (one listing call per filesystem)."""
    if not uris:
        return {}
    fs, _ = filesystem(uris[0])
    infos = fs.get_file_info([filesystem(u)[1] for u in uris])
    return {u: int(i.size or 0) for u, i in zip(uris, infos)}


def list_files(uri: str, suffixes: tuple[str, ...] = ()) -> list[str]:
    """Files under a folder/prefix (or the file itself), as URIs of the same scheme, sorted."""
    fs, path = filesystem(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        infos = [info]
    elif info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{uri} does not exist" + missing_bucket(fs, uri))
    else:
        infos = [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True)) if i.type == pafs.FileType.File]
    prefix = "s3://" if is_s3(uri) else ""
    out = [prefix + i.path for i in infos if not suffixes or i.path.endswith(suffixes)]
    return sorted(out)


def missing_bucket(fs, uri: str) -> str:
    """Why an ``s3://`` path is missing, when the reason is its bucket (else "")."""
    if not is_s3(uri):
        return ""
    bucket = urlparse(uri).netloc
    if fs.get_file_info(bucket).type != pafs.FileType.NotFound:
        return ""
    return f": bucket {bucket!r} does not exist at {s3_endpoint() or 'AWS S3'} (create it, or fix the URI / storage.s3_endpoint_url)"


def download_prefix(uri: str, dest: str | Path) -> int:
    """Copy every object under ``uri`` into ``dest`` keeping relative paths; returns the count."""
    fs, path = filesystem(uri)
    dest = Path(dest)
    n = 0
    for info in fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)):
        if info.type != pafs.FileType.File:
            continue
        rel = info.path[len(path):].lstrip("/")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(info.path, compression=None) as src, open(target, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        n += 1
    return n


def upload_dir(src: str | Path, uri: str) -> int:
    """Copy a local folder to a folder or ``s3://`` prefix; returns the number of files."""
    fs, path = filesystem(uri)
    src = Path(src)
    n = 0
    for f in sorted(src.rglob("*")):
        if f.is_file():
            target = f"{path}/{f.relative_to(src).as_posix()}"
            fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            with open(f, "rb") as inp, fs.open_output_stream(target, compression=None) as out:
                while chunk := inp.read(1 << 20):
                    out.write(chunk)
            n += 1
    return n

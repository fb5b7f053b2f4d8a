"""Shared bits of the benchmark scripts: machine description, result files, memory sampling."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine_info() -> dict:
    import psutil

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
    }
    info.update(cpu_info())
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # pragma: no cover - torch is a dependency
        pass
    try:
        import ray

        info["ray"] = ray.__version__
    except Exception:  # pragma: no cover
        pass
    return info


def cpu_info() -> dict:
    """The CPU's identity from /proc/cpuinfo: the same name ("AMD EPYC") covers generations whose bf16
    throughput differs by 2x (family 25 = Zen 3/4, 26 = Zen 5), so family and model are recorded."""
    out: dict = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in out:
                    out[key] = value.strip()
                if key == "flags":
                    out["bf16_isa"] = [x for x in ("avx512_bf16", "amx_bf16") if x in value.split()]
                    break
    except OSError:
        return {}
    return {"cpu_model_name": out.get("model name"), "cpu_family": out.get("cpu family"),
            "cpu_model": out.get("model"), "cpu_bf16_isa": out.get("bf16_isa", [])}


class KeptStates:
    """A model's states of some turns kept in an ``.npz`` -- ``KEY`` and ``KEY_ids``, the turns' ids in row order --
    so that a rerun over the same turns reuses them (``--features`` of the recipe scripts). States kept under a key
    for other turns are refused, naming the file and the key, never silently reused."""

    def __init__(self, path: str | Path | None, option: str = "--features"):
        import numpy as np

        self.path, self.option = (Path(path) if path else None), option
        self.arrays = dict(np.load(self.path)) if self.path and self.path.is_file() else {}
        self.kept = sorted(k for k in self.arrays if not k.endswith("_ids"))  # what an earlier run computed

    def check(self, key: str, rows: list, what: str = "") -> None:
        """Refuse the kept states of ``key`` unless they are of ``rows`` (``what`` names them in the message)."""
        if f"{key}_ids" not in self.arrays:
            why = "have no turn ids (an older version of this script wrote them)"
        elif list(self.arrays[f"{key}_ids"]) != [e.id for e in rows]:
            why = f"are of other turns than {what or 'these'} (another data job?)"
        else:
            return
        raise SystemExit(f"{self.option} {self.path}: its {key} states {why}; delete it or name another file")

    def get(self, key: str, rows: list, compute, what: str = ""):
        """The states of ``rows`` under ``key``: the kept ones, else ``compute(rows)``, then kept (written at once)."""
        import numpy as np

        if key in self.arrays:
            self.check(key, rows, what)
            return self.arrays[key]
        self.arrays[key] = compute(rows)
        self.arrays[f"{key}_ids"] = np.array([e.id for e in rows])
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(self.path, **self.arrays)
        return self.arrays[key]


WRITTEN: set[Path] = set()  # result files this process wrote: a script that saves as it goes may write them again


def result_file(name: str, out: str | Path | None = None, suffix: str = ".json", option: str = "--out") -> Path:
    """Where a result goes (``out``, else ``benchmarks/results/<name><suffix>``), refused at once when a file is
    already there that this process did not write: an earlier run's result is never overwritten. Call it when the
    arguments are parsed, so that a run is refused before it is spent; ``write_result`` checks again."""
    from clarifier.recipes.tables import ResultExists, refuse_existing

    path = Path(out) if out else RESULTS / f"{name}{suffix}"
    try:
        refuse_existing([path], option=option, written=WRITTEN)
    except ResultExists as exc:
        raise SystemExit(f"error: {exc}") from None
    return path


def write_result(name: str, data: dict, out: str | Path | None = None, option: str = "--out") -> Path:
    path = result_file(name, out, option=option)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": name, "machine": machine_info(), "command": " ".join(sys.argv),
                                "code": CODE_AT_START, **data}, indent=2) + "\n")
    WRITTEN.add(path.resolve())
    return path


def recipe_split(data: str | Path, split: str) -> list:
    """The Examples of one split of a data-job output (``--data``), or an exit naming how to make the recipe's."""
    from clarifier.data.outputs import load_split

    if not Path(data).is_dir():
        raise SystemExit(f"--data {data}: no data-job output there; make the recipe's with "
                         "`clarifier data prepare -c platform/clarifier/recipes/configs/joint-public.yaml` or pass another")
    return load_split(str(data), split)


def engine_turn_options(ap, turns: int) -> None:
    """The options of the engine benchmarks that time a model on a seeded sample of a data-job output's turns."""
    root = Path(__file__).resolve().parents[1]
    ap.add_argument("--model", default="builtin:clarifier-smollm2-135m")
    ap.add_argument("--data", default=str(root / ".clarifier" / "recipes" / "joint-public" / "data"),
                    help="a data-job output (the recipe's: clarifier data prepare -c platform/clarifier/recipes/configs/joint-public.yaml)")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--turns", type=int, default=turns)
    ap.add_argument("--batch-size", type=int, default=8, help="eval.batch_size / audit.batch_size (default 8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)


def sampled_turns(args) -> list:
    """``args.turns`` Examples of ``args.split`` of ``args.data``, sampled with ``args.seed`` (:func:`engine_turn_options`)."""
    import random

    pool = recipe_split(args.data, args.split)
    if len(pool) < args.turns:
        raise SystemExit(f"--data {args.data}: {len(pool)} {args.split} turns, fewer than --turns {args.turns}")
    return random.Random(args.seed).sample(pool, args.turns)


def engine_and_turns(args) -> tuple:
    """``(engine of args.model on args.threads torch threads, sampled_turns(args))`` (:func:`engine_turn_options`)."""
    import torch

    from clarifier.engine.loading import load_engine

    examples = sampled_turns(args)
    torch.set_num_threads(args.threads)
    return load_engine(args.model), examples


def timed(fn):
    """``(seconds, fn())``."""
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def code_version() -> str:
    """The commit the benchmark ran (``+changes`` when the work tree differed from it)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+changes" if dirty else "")


class PeakMemory:
    """Samples the RSS of this process and of its descendant Ray worker processes.

    ``driver_peak_mib``: this process. ``workers_peak_mib``: the largest sum over Ray worker
    processes (``ray::`` in their name) seen at one sample; ``worker_max_mib``: the largest single one.
    """

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.driver_peak = self.workers_peak = self.worker_max = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            try:
                self.driver_peak = max(self.driver_peak, me.memory_info().rss)
                total = 0
                for p in me.children(recursive=True):
                    try:
                        if p.name().startswith("ray::") or "ray::" in " ".join(p.cmdline()[:1]):
                            rss = p.memory_info().rss
                            total += rss
                            self.worker_max = max(self.worker_max, rss)
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        continue
                self.workers_peak = max(self.workers_peak, total)
            except Exception:
                pass
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def result(self) -> dict:
        mib = 2**20
        return {"driver_peak_mib": round(self.driver_peak / mib, 1), "workers_peak_mib": round(self.workers_peak / mib, 1),
                "worker_max_mib": round(self.worker_max / mib, 1)}


CODE_AT_START = code_version()  # when the benchmark imported this module, not when it wrote its result

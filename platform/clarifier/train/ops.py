"""DeepSpeed's CPU ops (fused Adam, the shared-memory all-reduce): torch compiles them on first use into
``~/.cache/torch_extensions`` (or ``$TORCH_EXTENSIONS_DIR``), one build folder per op, shared by every process of
the machine. Every build runs the pinned ``ninja`` (the ``ninja`` package of this environment).

Why one ninja: torch runs whichever ``ninja`` comes first on ``PATH``, and ninja 1.13 (the pinned package) and 1.11
(Debian's) hash a build command differently, so each reads the other's ``.ninja_log`` as a changed command and
compiles both ops again (~90 s of two cores each time). Processes started with the environment's ``bin/`` on
``PATH`` (an activated virtualenv, a ``ray start`` node whose jobs run its ``python``) and those started without it
alternated that way: two rebuilds in every test run. Called before DeepSpeed builds anything: by every training
worker (:class:`clarifier.train.loop.WorkerRecipe`) and by ``python -m clarifier.train.ops``, which builds both ops
once (``infra/local/setup.sh``, on idle cores, instead of inside the first training job).
"""

from __future__ import annotations

import os
import time

OPS = ("FusedAdamBuilder", "ShareMemCommBuilder")


def use_pinned_ninja() -> str | None:
    """Put the pinned ninja's folder first on this process's ``PATH`` (and its children's); returns the folder, or
    None when the ``ninja`` package is not installed (then whatever ``ninja`` is on ``PATH`` builds, as before)."""
    try:
        import ninja
    except ImportError:
        return None
    folder = ninja.BIN_DIR
    if not os.path.isfile(os.path.join(folder, "ninja")):
        return None
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != folder]
    os.environ["PATH"] = os.pathsep.join([folder, *rest])
    return folder


def build(names: tuple[str, ...] = OPS) -> float:
    """Build (or load, when built already) DeepSpeed's ops for this machine's accelerator; seconds taken."""
    use_pinned_ninja()
    from deepspeed.accelerator import get_accelerator

    t = time.time()
    for name in names:
        get_accelerator().create_op_builder(name).load(verbose=False)
    return time.time() - t


if __name__ == "__main__":
    print(f"[setup] DeepSpeed CPU ops ready in {build():.0f}s")

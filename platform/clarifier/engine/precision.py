"""Numeric precision: one setting (``auto`` | ``bf16`` | ``fp32``) resolved against the device.

``auto`` is bfloat16 where the device computes it natively -- a CUDA GPU with bf16 support, or a
CPU with a bf16 instruction set (AVX512-BF16 or AMX-BF16, which oneDNN uses for bf16 matmuls) --
and float32 elsewhere. ``bf16`` and ``fp32`` force it. The same resolution is used by training
(``model.precision``: bf16 frozen weights / activations, fp32 trainable weights, optimizer state
and loss), calibration, evaluation, Ray Data scorer actors (``model.precision``) and serving
replicas (``serve.precision``); the resolved value is what is logged and written to
``clarifier.json``.

:func:`place` puts a model on its device (the one place that moves one to CUDA). torch is imported
inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

import functools
from typing import Literal

from clarifier.engine.models import ModelResolutionError

Precision = Literal["auto", "bf16", "fp32"]
PRECISIONS = ("auto", "bf16", "fp32")


@functools.lru_cache(maxsize=1)
def cpu_bf16_isa() -> str | None:
    """The CPU's native bf16 instruction set (``amx_bf16`` / ``avx512_bf16``), or None."""
    import torch

    cpu = getattr(torch, "cpu", None)
    try:
        if cpu is not None and cpu._is_amx_tile_supported():
            return "amx_bf16"
        if cpu is not None and cpu._is_avx512_bf16_supported():
            return "avx512_bf16"
    except AttributeError:  # an older torch without the probes: read the kernel's flags
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return None
    return next((isa for isa in ("amx_bf16", "avx512_bf16") if isa in flags), None)


def bf16_support(device: str = "cpu") -> str | None:
    """Why ``device`` runs bf16 natively (e.g. ``"CPU avx512_bf16"``), or None when it does not."""
    import torch

    if str(device).startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return f"CUDA {torch.cuda.get_device_name(0)}"
        return None
    isa = cpu_bf16_isa()
    return f"CPU {isa}" if isa else None


def resolve_precision(setting: str, device: str = "cpu") -> str:
    """``auto`` / ``bf16`` / ``fp32`` -> ``bf16`` or ``fp32`` for ``device`` (``cpu`` or ``cuda``)."""
    if setting not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (got {setting!r})")
    if setting != "auto":
        return setting
    return "bf16" if bf16_support(device) else "fp32"


def describe(setting: str, device: str = "cpu") -> str:
    """One line for logs: the resolved precision and why (``bf16 (auto: CPU avx512_bf16)``)."""
    resolved = resolve_precision(setting, device)
    if setting != "auto":
        return f"{resolved} (forced)"
    why = bf16_support(device)
    return f"{resolved} (auto: {why})" if why else f"{resolved} (auto: no native bf16 on {device})"


def torch_dtype(precision: str):
    """The torch dtype of a *resolved* precision."""
    import torch

    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp32":
        return torch.float32
    raise ValueError(f"not a resolved precision: {precision!r} (resolve 'auto' first)")


def set_threads(cpus: float) -> int:
    """Make torch use exactly the CPUs this process reserved (at least one); returns the count.

    Ray actors and Train workers each reserve ``num_cpus``; left alone, torch would start a thread
    per core of the node and replicas on one node would oversubscribe it.
    """
    import torch

    n = max(1, int(cpus))
    torch.set_num_threads(n)
    return n


def place(model, device: str = "cpu"):
    """``model`` on ``device`` (``cpu`` or ``cuda``); a clear error when CUDA is asked for and absent."""
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ModelResolutionError(f"device {device!r} asked for, but CUDA is not available in this process")
        return model.to(device)
    return model

"""Fault injection for training tests, through the trainer's worker callbacks (not the product config).

``train(cfg, callbacks=[ExitOnceAt(3)])``: the last rank ``os._exit``s after step 3 (and its
checkpoint), once -- only in an attempt that restored no checkpoint, so the restarted run goes on.
``HoldFrom(step, path)``: every rank waits after that step until the file ``path`` exists (the test
creates it when its fault is over), so that a fast run cannot finish before the fault has been undone.
The module is pickled by value: Ray workers need not be able to import ``tests/``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(frozen=True)
class ExitOnceAt:
    step: int

    def on_step_end(self, recipe, step: int) -> None:
        if step == self.step and not recipe.resumed and recipe.rank == recipe.world - 1:
            print(f"[train] fault injection: worker {recipe.rank} exits at step {step}", file=sys.__stdout__, flush=True)
            os._exit(1)


@dataclass(frozen=True)
class HoldFrom:
    step: int
    path: str
    timeout_s: float = 600.0

    def on_step_end(self, recipe, step: int) -> None:
        if step < self.step or os.path.exists(self.path):
            return
        print(f"[train] fault injection: worker {recipe.rank} holds at step {step} until {self.path} exists",
              file=sys.__stdout__, flush=True)
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} did not appear within {self.timeout_s:.0f}s")
            time.sleep(0.2)

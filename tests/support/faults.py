"""Fault injection for training tests, through the trainer's worker callbacks (not the product config).

``train(cfg, callbacks=[ExitOnceAt(3)])``: the last rank ``os._exit``s after step 3 (and its
checkpoint), once -- only in an attempt that restored no checkpoint, so the restarted run goes on.
The module is pickled by value: Ray workers need not be able to import ``tests/``.
"""

from __future__ import annotations

import os
import sys
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

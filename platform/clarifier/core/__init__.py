"""Layer 1, the pure core: schema, joint target, prompt, typed config, objective, metrics.

No Ray, MLflow or DeepSpeed, and no torch at import time (``tests/unit/test_layers.py``), so it is
tested in milliseconds and imported by every other layer.
"""

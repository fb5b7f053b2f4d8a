"""Layer 3, models and inference: base-model resolver, the one inference engine (and the pipeline
variant), the target's decoding constraint, sentence encoder, precision and device placement, and
``loading.load_engine(uri)`` -- used alike by training (calibration), evaluation and serving."""

"""Ray Train job: LoRA fine-tuning on the joint objective (DeepSpeed), tracked in MLflow.

Ray job entrypoint, e.g.:
    ray job submit --working-dir . -- python jobs/train.py --help
Arguments are those of `clarifier train`.
"""

import sys

from clarifier.cli import app

if __name__ == "__main__":
    app([*"train".split(), *sys.argv[1:]], prog_name="jobs/train.py")

"""Evaluation job: a model and baselines on a held-out split or an evaluation-set JSONL.

Ray job entrypoint, e.g.:
    ray job submit --working-dir . -- python jobs/evaluate.py --help
Arguments are those of `clarifier eval`.
"""

import sys

from clarifier.cli import app

if __name__ == "__main__":
    app([*"eval".split(), *sys.argv[1:]], prog_name="jobs/evaluate.py")

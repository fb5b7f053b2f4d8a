"""Adapt job: fit a model's decision head to a team's own labelled turns (``clarifier adapt``).

Ray job entrypoint, e.g.:
    ray job submit --working-dir . -- python jobs/adapt.py --model models:/clarifier@champion \
        --data s3://bucket/labels/2026-12.jsonl --out /shared/adapted --experiment adapt eval.engine=ray
Arguments are those of `clarifier adapt`; `clarifier adapt --submit http://<head>:8265 ...` submits it for you.
"""

import sys

from clarifier.cli import app

if __name__ == "__main__":
    app(["adapt", *sys.argv[1:]], prog_name="jobs/adapt.py")

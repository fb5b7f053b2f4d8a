"""Audit job: is a clarifier worth it for these RAG logs? (the share of failed turns that needed
clarification, corrected for the model's error rates, with a verdict).

Ray job entrypoint, e.g.:
    ray job submit --working-dir . -- python jobs/audit.py --logs s3://bucket/rag-logs/ --out s3://bucket/audit/2026-12
Arguments are those of `clarifier audit`.
"""

import sys

from clarifier.cli import app

if __name__ == "__main__":
    app(["audit", *sys.argv[1:]], prog_name="jobs/audit.py")

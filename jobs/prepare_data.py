"""Ray Data job: conversation logs -> validated, split, tokenised Parquet + quarantine + manifest.

Ray job entrypoint, e.g.:
    ray job submit --working-dir . -- python jobs/prepare_data.py -c platform/clarifier/quickstart.yaml data.input=s3://bucket/logs
Arguments are those of `clarifier data prepare` (``--synthetic`` first writes synthetic logs to data.input).
"""

import sys

from clarifier.cli import app

if __name__ == "__main__":
    app([*"data prepare".split(), *sys.argv[1:]], prog_name="jobs/prepare_data.py")

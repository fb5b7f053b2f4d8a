"""The whole pipeline on the embedded default.

Ray job entrypoint, e.g.:
    ray job submit --working-dir . -- python jobs/quickstart.py --help
Arguments are those of `clarifier quickstart`.
"""

import sys

from clarifier.cli import app

if __name__ == "__main__":
    app([*"quickstart".split(), *sys.argv[1:]], prog_name="jobs/quickstart.py")

"""Registry job: register a training run's adapter as a model version.

Ray job entrypoint, e.g.:
    ray job submit --working-dir . -- python jobs/register.py --help
Arguments are those of `clarifier models register`.
"""

import sys

from clarifier.cli import app

if __name__ == "__main__":
    app([*"models register".split(), *sys.argv[1:]], prog_name="jobs/register.py")

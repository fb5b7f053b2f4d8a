"""Ray Data job: conversation logs -> validated, split, tokenised Parquet + quarantine + manifest.

Ray job entrypoint, e.g.:
    ray job submit --working-dir . -- python jobs/prepare_data.py --config jobs/configs/quickstart.yaml
    python jobs/prepare_data.py --config jobs/configs/quickstart.yaml data.input=s3://bucket/logs data.seed=1

Joins the cluster in ``RAY_ADDRESS`` when set (as inside ``ray job submit``), else starts a local
Ray. ``--synthetic`` first writes ``data.synthetic_conversations`` synthetic logs to ``data.input``.
Prints progress, then the manifest's counts as JSON; exits 2 on a configuration error.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jobs/prepare_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="YAML config file (defaults when omitted).")
    parser.add_argument("--synthetic", action="store_true",
                        help="Write data.synthetic_conversations synthetic logs to data.input first.")
    parser.add_argument("overrides", nargs="*", help="Dotted overrides, e.g. data.seed=1 data.max_length=384.")
    args = parser.parse_args(argv)

    from clarifier.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from clarifier import storage
    from clarifier.data.pipeline import prepare
    from clarifier.runtime import init_ray

    storage.set_s3_endpoint(cfg.storage.s3_endpoint_url)
    if args.synthetic:
        from clarifier.data.synthetic import write_logs

        if not cfg.data.input:
            print("error: --synthetic needs data.input (where to write the logs)", file=sys.stderr)
            return 2
        files = write_logs(cfg.data.input, cfg.data.synthetic_conversations, seed=cfg.data.seed)
        print(f"[data] wrote {cfg.data.synthetic_conversations} synthetic conversations to {len(files)} files")

    init_ray()
    manifest = prepare(cfg, progress=lambda m: print(m, flush=True))
    print(json.dumps(manifest["counts"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

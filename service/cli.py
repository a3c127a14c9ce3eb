"""The `obliviate` command line."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from jobs import cli as jobs_cli
from jobs.consistency import registry_check
from ledger import cli as ledger_cli

SERVICE = "service.service:Obliviate"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="obliviate", description="A model-serving sidecar that forgets on request.")
    ledger_cli.add_connection_options(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    ledger_cli.add_commands(sub, verify_checks=[registry_check])  # + the model registry
    jobs_cli.add_commands(sub)
    p = sub.add_parser("serve", help="run the BentoML service (guarded predictions, audit)")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, default=None,
                   help="serving processes (env OBLIVIATE_SERVICE_WORKERS, default 1)")
    p.set_defaults(func=_serve)
    p = sub.add_parser("demo", help="run the whole flow on embedded defaults")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--dataset", default="breast_cancer")
    p.add_argument("--workdir", default="demo-output")
    p.add_argument("--learner", choices=["dare", "sisa"], default="dare")
    p.add_argument("--rate", type=float, default=50.0, help="requests per second")
    p.set_defaults(func=_demo)
    return parser


def _serve(args: argparse.Namespace) -> int:
    """Hand over to `bentoml serve` (same process), with the CLI's connection options."""
    env = {"OBLIVIATE_DATABASE_URL": args.db, "OBLIVIATE_KAFKA_BOOTSTRAP": args.bootstrap,
           "OBLIVIATE_SERVICE_WORKERS": None if args.workers is None else str(args.workers)}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    os.environ.setdefault("BENTOML_DO_NOT_TRACK", "true")
    bentoml = shutil.which("bentoml", path=str(Path(sys.executable).parent)) or "bentoml"
    os.execv(bentoml, [bentoml, "serve", SERVICE, "--host", args.host, "--port", str(args.port)])


def _demo(args: argparse.Namespace) -> int:
    from service.demo import run_demo

    return run_demo(args.workdir, args.dataset, args.requests, args.learner, args.rate)


def main(argv: list[str] | None = None) -> int:
    # every file the sidecar creates (ledger, keys, model store, logs) is its user's alone
    os.umask(0o077)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as exc:
        print(f"obliviate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

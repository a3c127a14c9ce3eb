"""The `obliviate` command line."""

from __future__ import annotations

import argparse
import sys

from ledger import cli as ledger_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="obliviate", description="A model-serving sidecar that forgets on request.")
    ledger_cli.add_connection_options(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    ledger_cli.add_commands(sub)
    p = sub.add_parser("demo", help="run the whole flow on embedded defaults")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--dataset", default="breast_cancer")
    p.add_argument("--workdir", default="demo-output")
    p.set_defaults(func=_demo)
    return parser


def _demo(args: argparse.Namespace) -> int:
    from service.demo import run_demo

    return run_demo(args.workdir, args.dataset, args.requests)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as exc:
        print(f"obliviate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

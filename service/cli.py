"""The `obliviate` command line: the parser, and the commands of the service layer.

The parser imports only the standard library and the ledger's light modules (each
command imports what it needs when it runs), so `--help`, the `ledger` commands,
`submit` and `produce` start without torch or numba (`tests/test_cli_errors.py`). Exit
codes: 0 done, 1 the answer is no, 2 a usage error with one line saying what to do.
See docs/operations.md (The command line)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from jobs.orchestration import model_commands as jobs_cli
from ledger import commands as ledger_cli

SERVICE = "service.service:Obliviate"


def _registry_check(ledger):  # noqa: ANN001, ANN202 - see ledger.commands.VerifyCheck
    """`ledger verify`'s check of the model registry (imported when verify runs)."""
    from jobs.orchestration.consistency import registry_check

    return registry_check(ledger)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="obliviate", description="A model-serving sidecar that forgets on request.")
    ledger_cli.add_connection_options(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    ledger_cli.add_commands(sub, verify_checks=[_registry_check])  # + the model registry
    jobs_cli.add_commands(sub)
    p = sub.add_parser("serve", help="run the BentoML service (guarded predictions, audit)")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, default=None,
                   help="serving processes (env OBLIVIATE_SERVICE_WORKERS, default 1)")
    p.set_defaults(func=_serve)
    p = sub.add_parser("build", help="build the Bento (bentofile.yaml) holding the current "
                       "model version of this ledger")
    p.add_argument("--bentofile", default="bentofile.yaml", metavar="FILE")
    p.set_defaults(func=_build)
    p = sub.add_parser("demo", help="run the whole flow on embedded defaults (its own "
                       "ledger and broker in --workdir)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--dataset", default="breast_cancer")
    p.add_argument("--workdir", default="demo-output",
                   help="where the demo keeps its state; emptied first if a previous "
                        "demo's, refused if anything else is in it (default demo-output)")
    p.add_argument("--learner", choices=["dare", "mlp", "sisa"], default="dare")
    p.add_argument("--rate", type=float, default=50.0, help="requests per second")
    p.add_argument("--params", default="{}",
                   help='the learner\'s hyperparameters as a JSON object (e.g. sliced SISA '
                        'shards: \'{"n_slices": 3}\')')
    p.add_argument("--network", default=None, metavar="MODULE:FUNCTION",
                   help="sisa: a network of your own, e.g. the shipped "
                        "jobs.learners.networks.examples.digits:build (with --dataset digits)")
    p.set_defaults(func=_demo, own_connections=True)
    _connection_options_everywhere(parser)
    return parser


def _connection_options_everywhere(parser: argparse.ArgumentParser) -> None:
    """`--db`, `--bootstrap` and `--topic` after the subcommand too (`obliviate ledger
    verify --db URL`): each command parser gets them with no default of its own, so a
    value given before the subcommand stands unless the command repeats it. A command
    that makes its own (`demo`, `own_connections`) is not offered them."""
    for action in parser._actions:  # noqa: SLF001 - argparse keeps subparsers only here
        if not isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            continue
        for sub in dict.fromkeys(action.choices.values()):
            if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):  # noqa: SLF001
                _connection_options_everywhere(sub)
            elif not sub.get_default("own_connections"):
                ledger_cli.add_connection_options(sub, default=argparse.SUPPRESS)


def _serve(args: argparse.Namespace) -> int:
    """Hand over to `bentoml serve` (same process), with the CLI's connection options.

    The ledger is opened first: the database migrations run here, and an unreachable
    database is one line of error rather than a serving process's traceback.
    """
    from jobs.orchestration.job_settings import JobSettings
    from jobs.orchestration.registry import Registry

    model_name = JobSettings.from_env().model_name
    ledger = ledger_cli.open_ledger(args)
    if Registry(ledger.engine, model_name, ledger.keys).current() is None:
        print("obliviate: warning: no model version is published yet: /v1/predict answers "
              "503 until one is (`obliviate model train`, or `obliviate worker --train`)",
              file=sys.stderr)
    ledger.close()
    env = {"OBLIVIATE_DATABASE_URL": args.db, "OBLIVIATE_KAFKA_BOOTSTRAP": args.bootstrap,
           "OBLIVIATE_SERVICE_WORKERS": None if args.workers is None else str(args.workers)}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    os.environ.setdefault("BENTOML_DO_NOT_TRACK", "true")
    bentoml = shutil.which("bentoml", path=str(Path(sys.executable).parent)) or "bentoml"
    os.execv(bentoml, [bentoml, "serve", SERVICE, "--host", args.host, "--port", str(args.port)])


def _build(args: argparse.Namespace) -> int:
    from jobs.orchestration.job_settings import JobSettings
    from service.bento_build import build_bento

    ledger = ledger_cli.open_ledger(args, sign=False)
    tag, model = build_bento(ledger, JobSettings.from_env().model_name,
                             Path(args.bentofile))
    held = (f"holding model version {model}" if model else "with no model version (none "
            "is published yet: the service loads versions from OBLIVIATE_MODEL_STORE)")
    print(f"built Bento {tag} {held}; then `bentoml containerize {tag}`")
    return 0


def _demo(args: argparse.Namespace) -> int:
    given = [f"--{k}" for k in ("db", "bootstrap", "topic") if getattr(args, k, None)]
    if given:
        raise ValueError(f"the demo runs its own ledger and broker in --workdir: "
                         f"{', '.join(given)} is not used; leave it out")
    from jobs.orchestration.job_settings import JobSettings
    from service.demo.walkthrough import run_demo

    params = jobs_cli.training_params(args.learner, jobs_cli.parse_params(args.params),
                                      args.network, JobSettings.from_env())
    return run_demo(args.workdir, args.dataset, args.requests, args.learner, args.rate, params)


def database_error(exc: BaseException, url: str | None) -> str | None:
    """One line for a database that cannot be reached or used; None for other errors."""
    sa_exc = sys.modules.get("sqlalchemy.exc")
    if sa_exc is None or not isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        return None
    inner = getattr(exc, "orig", None) or exc
    reason = next((line.strip() for line in str(inner).splitlines() if line.strip()),
                  type(inner).__name__)
    where = _safe_url(url) if url else "the ledger database"
    if "does not exist" in reason and url:
        reason = reason.split("FATAL:")[-1].strip()
        return (f"cannot use {where}: {reason[:300]}; create it ({_createdb(url)}) or fix "
                "the name in --db or OBLIVIATE_DATABASE_URL")
    return (f"cannot use {where}: {reason[:300]}; check --db or OBLIVIATE_DATABASE_URL and "
            "that the database server is running")


def _createdb(url: str) -> str:
    """The command that creates the database `url` names, on its server."""
    from sqlalchemy import make_url

    u = make_url(url)
    opts = [f"-h {u.host}" if u.host else "", f"-p {u.port}" if u.port else "",
            f"-U {u.username}" if u.username else ""]
    return f"`createdb {' '.join(o for o in [*opts, u.database or ''] if o)}`"


def _safe_url(url: str) -> str:
    try:
        from sqlalchemy import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a malformed URL is shown as given, password-less
        return url.split("@")[-1]


def main(argv: list[str] | None = None) -> int:
    # every file the sidecar creates (ledger, keys, model store, logs) is its user's alone
    os.umask(0o077)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `obliviate ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:  # noqa: BLE001 - each kind gets its one line below
        url = getattr(args, "db", None) or os.environ.get("OBLIVIATE_DATABASE_URL")
        message = database_error(exc, url or _default_url())
        if message is not None:
            print(f"obliviate: error: {message}", file=sys.stderr)
            return 1
        if isinstance(exc, ConnectionError):  # a broker (or other server) that is not there
            print(f"obliviate: error: {_first_line(exc)}", file=sys.stderr)
            return 1
        if isinstance(exc, ValueError | RuntimeError):
            print(f"obliviate: error: {_first_line(exc)}", file=sys.stderr)
            return 2
        raise


def _default_url() -> str:
    from ledger.config import LedgerSettings

    return LedgerSettings.database_url


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())

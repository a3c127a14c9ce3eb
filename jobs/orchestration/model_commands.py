"""The jobs' commands: `obliviate worker` and `obliviate model ...`.
See docs/operations.md (The command line)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from jobs.orchestration.job_settings import JobSettings
from ledger.commands import open_ledger, start_long_running

if TYPE_CHECKING:  # the learners (torch, numba, scipy) load only in the commands
    from jobs.orchestration.worker import Worker

# jobs.orchestration.served_model.KINDS, without importing the learners to build the parser
LEARNERS = ("dare", "game", "mlp", "sisa")
# the learners whose shard training, retrains and LOO sets run where OBLIVIATE_DEVICE says
DEVICE_LEARNERS = ("game", "mlp", "sisa")
NETWORK_LEARNERS = ("game", "sisa")  # the learners that train a network of the user's
log = logging.getLogger("obliviate")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="apply pending requests and publish model versions")
    p.add_argument("--name", default=None, help="worker name (env OBLIVIATE_WORKER_NAME); "
                   "a restarted worker takes back its own claims")
    p.add_argument("--batch-window", type=float, default=0.1,
                   help="after claiming a lone request, wait this long for more")
    p.add_argument("--max-batch", type=int, default=10_000)
    p.add_argument("--guard-max-wait", type=float, default=60.0, metavar="SECONDS",
                   help="once the current version has waited this long for its guard, "
                        "requests wait for the refit (default 60; inf: never)")
    p.add_argument("--guard-grow", type=float, default=0.25, metavar="SECONDS",
                   help="an update grows the forest guard's new subtrees for at most this "
                        "long before the version is published (sound, fewer answers certain "
                        "until the background refit; default 0.25; inf: grow them all)")
    p.add_argument("--shard-bound", type=float, default=20.0, metavar="SECONDS",
                   help="the guard job computes the LUCID bound of each SISA shard, or of "
                        "the mlp learner's network, for at most this long (anytime: sound "
                        "whenever it stops); until then, and after an update retrains it, "
                        "a shard counts as fragile and the mlp answers in noise-all mode "
                        "(default 20; 0: no bounds)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the exactness check (retrain from scratch, compare hashes)")
    p.add_argument("--evaluate", action="store_true", default=None,
                   help="measure each deletion's privacy into its `applied` event (accuracy, "
                        "attack advantages, membership inference; env OBLIVIATE_EVALUATE=on)")
    p.add_argument("--train", action="store_true",
                   help="train and publish a first version if none exists")
    p.add_argument("--learner", choices=LEARNERS, default=None,
                   help="learner for --train (env OBLIVIATE_LEARNER)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus port (env OBLIVIATE_WORKER_METRICS_PORT; 0 turns it off)")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this long")
    p.set_defaults(func=cmd_worker)

    model = sub.add_parser("model", help="train, inspect and trace model versions")
    msub = model.add_subparsers(dest="model_command", required=True)
    p = msub.add_parser("train", help="train on the ledger's live records, publish v1")
    p.add_argument("--learner", choices=LEARNERS, default=None)
    p.add_argument("--params", default="{}", help="hyperparameters as a JSON object")
    p.add_argument("--network", default=None, metavar="MODULE:FUNCTION",
                   help="sisa, game: a network of your own, build(n_features, n_classes, **params) "
                        "returning a torch.nn.Module, imported from the current directory or "
                        "PYTHONPATH (env OBLIVIATE_NETWORK; its params: --params "
                        "'{\"network_params\": {...}}')")
    p.set_defaults(func=cmd_train)
    p = msub.add_parser("show", help="the current version and its manifest")
    p.set_defaults(func=cmd_show)
    p = msub.add_parser("rollback", help="publish an earlier version again (refused for "
                        "one that holds deleted records or another training set)")
    p.add_argument("version", help="e.g. v000007")
    p.set_defaults(func=cmd_rollback)
    p = msub.add_parser("lineage", help="published versions, newest first")
    p.add_argument("--limit", type=int, default=20)
    p.set_defaults(func=cmd_lineage)


def _worker(args: argparse.Namespace, **config: Any) -> Worker:
    from jobs.orchestration.registry import Registry
    from jobs.orchestration.worker import Worker, WorkerConfig

    s = JobSettings.from_env()
    s.training_device()  # checked, and the CUDA memory cap set, before any training
    # opening the ledger applies the database migrations (ledger.migrations) before the
    # worker touches a table; said on stderr when they changed something
    ledger = open_ledger(args)
    config["budget"] = s.budget_policy()  # private mode: every version gets a seed lineage
    registry = Registry(ledger.engine, s.model_name, ledger.keys)
    return Worker(ledger, registry, WorkerConfig(**config))


def parse_params(text: str) -> dict[str, Any]:
    """`--params`: the learner's hyperparameters as a JSON object."""
    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--params is not JSON: {exc}") from None
    if not isinstance(params, dict):
        raise ValueError("--params must be a JSON object")
    return params


def with_network(learner: str, params: dict[str, Any], network: str | None) -> dict[str, Any]:
    """`params` with the user's network (`--network` or OBLIVIATE_NETWORK), which is
    imported as from the current directory, like `python -m`."""
    if not network:
        return params
    if learner not in NETWORK_LEARNERS:
        raise ValueError(f"--network (OBLIVIATE_NETWORK) needs --learner sisa or game, not "
                         f"{learner!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return {**params, "network": network}


def training_params(learner: str, params: dict[str, Any], network: str | None,
                    settings: JobSettings) -> dict[str, Any]:
    """`params` with the user's network (:func:`with_network`) and, for the learners that
    train torch networks and unless `params` names one, OBLIVIATE_DEVICE's device."""
    params = with_network(learner, params, network)
    if learner in DEVICE_LEARNERS and "device" not in params:
        params = {**params, "device": settings.training_device()}
    return params


def cmd_train(args: argparse.Namespace) -> int:
    s = JobSettings.from_env()
    learner = args.learner or s.learner
    params = training_params(learner, parse_params(args.params), args.network or s.network, s)
    version = _worker(args).bootstrap(learner, params)
    print(f"current version: {version}")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from jobs.orchestration.worker import worker_name

    s = JobSettings.from_env()
    start_long_running(args, s.worker_metrics_port, "OBLIVIATE_WORKER_METRICS_PORT")
    worker = _worker(args, name=args.name or worker_name(), batch_window_s=args.batch_window,
                     max_batch=args.max_batch, verify_exactness=not args.no_verify,
                     guard_max_wait_s=args.guard_max_wait, guard_grow_s=args.guard_grow,
                     shard_bound_s=args.shard_bound, destroy_grace_s=s.destroy_grace_s,
                     evaluate=args.evaluate or s.choice("evaluate", ("off", "on")) == "on")
    log.info("%s", worker.ledger.schema_upgrade.describe())
    if args.train:
        learner = args.learner or s.learner
        worker.bootstrap(learner, training_params(learner, {}, s.network, s))
    worker.run(max_seconds=args.max_seconds)
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from jobs.orchestration.worker import RollbackRefused

    try:
        version = _worker(args).rollback(args.version)
    except RollbackRefused as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{args.version} is served again as {version}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from jobs.orchestration.registry import Registry

    model_name = JobSettings.from_env().model_name
    cur = Registry(open_ledger(args).engine, model_name).current()
    if cur is None:
        print("no version is published yet: run `obliviate model train`")
        return 1
    print(json.dumps({"version": cur.version, "manifest": cur.manifest}, indent=2))
    return 0


def cmd_lineage(args: argparse.Namespace) -> int:
    from jobs.orchestration.registry import Registry
    from jobs.orchestration.served_model import UNGUARDED
    from ledger.chain import iso

    model_name = JobSettings.from_env().model_name
    for v in Registry(open_ledger(args).engine, model_name).lineage(args.limit):
        m = v.manifest
        state = ("destroyed" if v.destroyed_at else
                 "to destroy" if v.superseded_by_deletion else "kept")
        guard = ("ready" if m["guard"]["ready"] else
                 "none" if m["guard"]["rule"] == UNGUARDED else "noise-all")
        print(f"{v.version}  {iso(v.created_at)}  parent={v.parent or '-':8}  "
              f"{m['change']['op']:8}  guard={guard}  {m.get('forgetting', '-')}  "
              f"records={m['training_set']['count']}  hash={m['content_hash'][:12]}  {state}")
    return 0

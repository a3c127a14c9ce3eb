"""The ledger's commands: `obliviate ledger ...`, `submit`, `produce`, `consume`.

Each command is a function of parsed arguments returning an exit code, so the
`obliviate` entry point (in `service.cli`) only has to assemble them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server

from ledger import audit, datasets
from ledger.config import Settings
from ledger.consumer import RequestConsumer, ensure_topics
from ledger.forgotten import forgotten, render
from ledger.heads import HeadSigner, public_key_pem
from ledger.producer import produce, request_stream
from ledger.store import Ledger, Problem

# a check of tables other packages own (the model registry's: jobs.consistency), which
# the assembled command line (service.cli) hands to `ledger verify`
VerifyCheck = Callable[[Ledger, Settings], list[Problem]]


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings.from_env(database_url=getattr(args, "db", None),
                             kafka_bootstrap=getattr(args, "bootstrap", None),
                             requests_topic=getattr(args, "topic", None))


def add_commands(sub: argparse._SubParsersAction, verify_checks: Sequence[VerifyCheck] = ()
                 ) -> None:
    led = sub.add_parser("ledger", help="inspect and prove the ledger")
    lsub = led.add_subparsers(dest="ledger_command", required=True)

    p = lsub.add_parser("init", help="seed the record store with a training table")
    p.add_argument("--dataset", default="breast_cancer",
                   help=f"one of {', '.join([*datasets.BUNDLED, 'synthetic'])}")
    p.add_argument("--csv", help="load this CSV file instead of a bundled data set")
    p.add_argument("--label-column", default="label")
    p.add_argument("--subject-column")
    p.add_argument("--id-column")
    p.add_argument("--records-per-subject", type=int, default=3)
    p.set_defaults(func=cmd_init)

    p = lsub.add_parser("verify", help="recompute the hash chain, checkpoints, signed heads "
                        "and fingerprints, and hold the tables to what the events say")
    p.set_defaults(func=cmd_verify, verify_checks=tuple(verify_checks))

    p = lsub.add_parser("show", help="a request's history with inclusion proofs")
    p.add_argument("request_id")
    p.set_defaults(func=cmd_show)

    p = lsub.add_parser("forgotten", help="what a deletion removed, when, and from which "
                        "versions (with the proof of exactness)")
    p.add_argument("request_id")
    p.add_argument("--json", action="store_true", help="the full report, events and "
                   "inclusion proofs included")
    p.set_defaults(func=cmd_forgotten)

    p = lsub.add_parser("export", help="events as JSON lines for auditors")
    p.add_argument("--since", help="a sequence number or an ISO 8601 time")
    p.set_defaults(func=cmd_export)

    p = lsub.add_parser("checkpoint", help="publish a Merkle tree head over all events")
    p.set_defaults(func=cmd_checkpoint)

    p = lsub.add_parser("key", help="the public key that checks the signed heads (for "
                        "auditors; the signing key stays where it is)")
    p.add_argument("--pem", action="store_true", help="PEM instead of hex")
    p.set_defaults(func=cmd_key)

    p = lsub.add_parser("heads", help="the signed tree heads, as JSON (save them to audit "
                        "the log later)")
    p.add_argument("--since", type=int, default=0, help="heads over more than this many events")
    p.add_argument("--limit", type=int, default=None, help="only the newest N heads")
    p.set_defaults(func=cmd_heads)

    p = lsub.add_parser("consistency", help="RFC 6962 consistency proof between two tree sizes")
    p.add_argument("old_size", type=int)
    p.add_argument("new_size", type=int)
    p.set_defaults(func=cmd_consistency)

    aud = sub.add_parser("audit", help="check the ledger as an auditor would")
    asub = aud.add_subparsers(dest="audit_command", required=True)
    p = asub.add_parser("check", help="hold the log to signed heads saved earlier: "
                        "signatures, consistency proofs, the events' roots (exit 1 naming "
                        "the first problem)")
    audit.add_arguments(p)
    p.set_defaults(func=cmd_audit_check)

    p = sub.add_parser("submit", help="record one request (JSON argument, file or '-')")
    p.add_argument("request", help="a JSON object, a path to one, or - for standard input")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("produce", help="send demo or test requests to the requests topic")
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--invalid-fraction", type=float, default=0.03)
    p.add_argument("--file", help="send the JSON lines of this file instead")
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("consume", help="run the Kafka consumer that fills the ledger")
    p.add_argument("--group", default=None)
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--idle-timeout", type=float, default=None,
                   help="exit after this many seconds without messages")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics here (env OBLIVIATE_CONSUMER_METRICS_PORT; "
                        "0 turns it off)")
    p.set_defaults(func=cmd_consume)


def add_connection_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", help="ledger database URL (env OBLIVIATE_DATABASE_URL)")
    p.add_argument("--bootstrap", help="Kafka bootstrap address (env OBLIVIATE_KAFKA_BOOTSTRAP)")
    p.add_argument("--topic", help="requests topic (env OBLIVIATE_REQUESTS_TOPIC)")


def cmd_init(args: argparse.Namespace) -> int:
    if args.csv:
        ds = datasets.load_csv(args.csv, args.label_column, args.subject_column, args.id_column)
    else:
        ds = datasets.load(args.dataset, records_per_subject=args.records_per_subject)
    ledger = settings_from(args).open_ledger()
    seq = ledger.load_records(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name)
    print(f"loaded {len(ds.record_ids)} records of {ds.name!r} "
          f"({ds.X.shape[1]} features, {len(set(ds.y.tolist()))} classes) as event {seq}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    ledger = settings.open_ledger()
    result = ledger.verify()
    for check in getattr(args, "verify_checks", ()):
        result.problems.extend(check(ledger, settings))
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if not result.problems:
        print(f"ledger OK: {result.events} events, {result.checkpoints} checkpoints, "
              f"{result.heads} signed heads, {result.records} records verified")
        return 0
    first = result.problems[0]
    print(f"ledger FAILED verification: {len(result.problems)} problem(s); first: {first}",
          file=sys.stderr)
    for p in result.problems[1:20]:
        print(f"  {p}", file=sys.stderr)
    return 1


def cmd_show(args: argparse.Namespace) -> int:
    try:
        history = settings_from(args).open_ledger().history(args.request_id)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 1
    print(json.dumps(history, indent=2, default=str))
    return 0


def cmd_forgotten(args: argparse.Namespace) -> int:
    try:
        report = forgotten(settings_from(args).open_ledger(), args.request_id)
    except (KeyError, ValueError) as exc:
        print(exc.args[0], file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print("\n".join(render(report)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    since: str | int | None = args.since
    if since is not None and since.isdigit():
        since = int(since)
    for event in settings_from(args).open_ledger().export(since):
        sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    ledger = settings_from(args).open_ledger()
    cp = ledger.checkpoint()
    if cp is None:
        print("the ledger has no events yet")
        return 0
    head = ledger.published_heads(since=cp.tree_size - 1, limit=1)["heads"]
    signed = (f" signed={head[0]['signature'][:16]}... log_id={head[0]['log_id']}"
              if head and head[0]["tree_size"] == cp.tree_size else " (not signed)")
    print(f"tree_size={cp.tree_size} root={cp.root_hash} created_at={cp.created_at}{signed}")
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    public = HeadSigner(settings_from(args).ledger_signing_key()).public_key
    print(public_key_pem(public).rstrip() if args.pem else public.hex())
    return 0


def cmd_heads(args: argparse.Namespace) -> int:
    doc = settings_from(args).open_ledger().published_heads(args.since, args.limit)
    print(json.dumps(doc, indent=1))
    return 0


def cmd_consistency(args: argparse.Namespace) -> int:
    try:
        proof = settings_from(args).open_ledger().consistency(args.old_size, args.new_size)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps(proof, indent=1))
    return 0


def cmd_audit_check(args: argparse.Namespace) -> int:
    """`audit check`: current heads from --current, --url or the database; events from
    --events, else the database (not with --url: then only the proofs are checked)."""
    ledger = None
    if args.current:
        current = audit.read_json(args.current)
    elif args.url:
        current = audit.fetch_json(args.url, "/v1/ledger/heads")
    else:
        ledger = settings_from(args).open_ledger()
        current = ledger.published_heads()
    events = None
    if args.events:
        events = audit.read_events(args.events)
    elif not args.url:
        events = (ledger or settings_from(args).open_ledger()).export()
    result = audit.audit(audit.read_json(args.heads), current,
                         public_key=audit.key_argument(args.public_key), events=events,
                         consistency=audit.http_consistency(args.url) if args.url else None)
    return audit.report(result)


def cmd_submit(args: argparse.Namespace) -> int:
    text = _read_arg(args.request)
    result = settings_from(args).open_ledger().receive(text.encode(), source="cli")
    print(json.dumps(result.as_dict()))
    return 0 if result.status in ("accepted", "duplicate") else 2


def cmd_produce(args: argparse.Namespace) -> int:
    s = settings_from(args)
    ensure_topics(s.kafka_bootstrap, list(s.topic_configs()), configs=s.topic_configs())
    if args.file:
        messages: Any = (line.encode() for line in Path(args.file).read_text().splitlines()
                         if line.strip())
    else:
        ledger = s.open_ledger()
        schema = ledger.schema()
        if schema is None:
            print("the ledger holds no records: run `obliviate ledger init` first",
                  file=sys.stderr)
            return 1
        live = ledger.live_records()
        messages = request_stream(list(live.record_ids), list(live.subject_ids),
                                  schema.n_features, schema.classes, args.count,
                                  random_state=args.seed, invalid_fraction=args.invalid_fraction)
    n = produce(s.kafka_bootstrap, s.requests_topic, messages)
    print(f"sent {n} messages to {s.requests_topic} at {s.kafka_bootstrap}")
    return 0


def start_long_running(args: argparse.Namespace, default_metrics_port: int) -> None:
    """Logging, and the Prometheus endpoint (`--metrics-port`, 0 for none), of a daemon."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    port = default_metrics_port if args.metrics_port is None else args.metrics_port
    if port:
        start_http_server(port)


def cmd_consume(args: argparse.Namespace) -> int:
    s = settings_from(args)
    start_long_running(args, s.consumer_metrics_port)
    ensure_topics(s.kafka_bootstrap, list(s.topic_configs()), configs=s.topic_configs())
    consumer = RequestConsumer(s.open_ledger(), s.kafka_bootstrap, s.requests_topic,
                               s.dead_letter_topic, group_id=args.group or s.consumer_group,
                               batch_size=args.batch_size)
    consumer.install_signal_handlers()
    stats = consumer.run(idle_timeout_s=args.idle_timeout,
                         on_batch=lambda r: logging.info("batch of %d recorded", len(r)))
    print(json.dumps({"batches": stats.batches, **stats.counts}))
    return 0


def _read_arg(value: str) -> str:
    if value == "-":
        return sys.stdin.read()
    if not value.lstrip().startswith("{") and Path(value).is_file():
        return Path(value).read_text()
    return value

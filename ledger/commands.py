"""The ledger's commands: `obliviate ledger ...`, `submit`, `produce`, `consume`.

Each command is a function of parsed arguments returning an exit code, so the
`obliviate` entry point (in `service.cli`) only has to assemble them.
See docs/operations.md (The command line)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only what building the parser needs is imported here: each command imports what it
# uses, so `obliviate --help` and the ledger's commands start without the learners.
from ledger import audit

if TYPE_CHECKING:
    from ledger.config import LedgerSettings
    from ledger.log_check import Problem
    from ledger.store import Ledger

# a check of tables other packages own (the model registry's: jobs.orchestration.consistency), which
# the assembled command line (service.cli) hands to `ledger verify`
VerifyCheck = Callable[["Ledger"], "list[Problem]"]
# = ledger.datasets.NAMES (not imported: a CSV load needs no scikit-learn)
DATASETS = ("breast_cancer", "digits", "wine", "iris", "synthetic", "census")
log = logging.getLogger("obliviate")


def settings_from(args: argparse.Namespace) -> LedgerSettings:
    from ledger.config import LedgerSettings

    return LedgerSettings.from_env(database_url=getattr(args, "db", None),
                                   kafka_bootstrap=getattr(args, "bootstrap", None),
                                   requests_topic=getattr(args, "topic", None))


def open_ledger(args: argparse.Namespace, settings: LedgerSettings | None = None,
                sign: bool = True) -> Ledger:
    """The ledger, its schema brought to the newest migration; says so when it moved.
    `sign`: with the deployment's signing key (else its public half only)."""
    ledger = (settings or settings_from(args)).open_ledger(sign)
    if ledger.schema_upgrade.upgraded:
        print(f"obliviate: {ledger.schema_upgrade.describe()}", file=sys.stderr)
    return ledger


def add_commands(sub: argparse._SubParsersAction, verify_checks: Sequence[VerifyCheck] = ()
                 ) -> None:
    led = sub.add_parser("ledger", help="inspect and prove the ledger")
    lsub = led.add_subparsers(dest="ledger_command", required=True)

    _add_init_command(lsub)

    p = lsub.add_parser("schema", help="features (names, ranges, scaling) and classes")
    p.add_argument("--json", action="store_true", help="as GET /v1/schema answers it")
    p.set_defaults(func=cmd_schema)

    p = lsub.add_parser("migrate", help="bring the database schema to the newest migration "
                        "(init, serve, consume and worker do it when they start)")
    p.set_defaults(func=cmd_migrate)

    p = lsub.add_parser("verify", help="recompute the hash chain, checkpoints, signed heads "
                        "and fingerprints, and hold the tables to what the events say")
    p.add_argument("--since-verified", action="store_true",
                   help="check only the log after the signed head the last verify passed on "
                   "(a consistency proof from it, the events after it); not the tables")
    p.add_argument("--verified-head", metavar="FILE", help="where that head is kept "
                   "(default: OBLIVIATE_VERIFIED_HEAD_FILE, .obliviate/verified-head.json)")
    p.set_defaults(func=cmd_verify, verify_checks=tuple(verify_checks))

    p = lsub.add_parser("show", help="a request's history: its events, each with an "
                        "inclusion proof")
    p.add_argument("request_id")
    p.add_argument("--json", action="store_true", help="the full document: payloads, "
                   "inclusion proofs, the signed tree head")
    p.set_defaults(func=cmd_show)

    p = lsub.add_parser("forgotten", help="what a deletion removed, when, and from which "
                        "versions (with the proof of exactness)")
    p.add_argument("request_id")
    p.add_argument("--json", action="store_true", help="the full report, events and "
                   "inclusion proofs included")
    p.set_defaults(func=cmd_forgotten)

    _add_proof_commands(lsub)

    p = lsub.add_parser("export", help="events as JSON lines for auditors")
    p.add_argument("--since", help="a sequence number or an ISO 8601 time")
    p.set_defaults(func=cmd_export)

    p = lsub.add_parser("checkpoint", help="publish a Merkle tree head over all events")
    p.set_defaults(func=cmd_checkpoint)

    aud = sub.add_parser("audit", help="check the ledger as an auditor would")
    asub = aud.add_subparsers(dest="audit_command", required=True)
    p = asub.add_parser("check", help="hold the log to signed heads saved earlier: "
                        "signatures, consistency proofs, the events' roots (exit 1 naming "
                        "the first problem)")
    audit.add_arguments(p)
    p.set_defaults(func=cmd_audit_check)

    _add_intake_commands(sub)


def _add_init_command(lsub: argparse._SubParsersAction) -> None:
    """`ledger init`: the training table, bundled or a CSV file."""
    p = lsub.add_parser("init", help="seed the record store with a training table",
                        description="Load the initial training table. Features are kept in "
                        "the model's input space, [0, 1]: categories one-hot encoded, each "
                        "feature min-max scaled with its range in this table (widened to "
                        "round numbers), and that encoding is stored in the ledger, so "
                        "queries and additions send raw values (`obliviate ledger schema` "
                        "shows it; docs/tables.md explains it).")
    p.add_argument("--dataset", default="breast_cancer",
                   help=f"a bundled table: one of {', '.join(DATASETS)} (default "
                        "breast_cancer)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--csv", metavar="FILE", help="load this CSV file instead: a header "
                     "line, feature columns (numbers, text categories, true/false), a label "
                     "column (integers or text)")
    src.add_argument("--parquet", metavar="FILE", help="load this Parquet file instead (the "
                     "columns as for --csv; needs the `parquet` extra)")
    p.add_argument("--label-column", default="label", metavar="NAME",
                   help="the table's column holding the class label (default: label)")
    p.add_argument("--subject-column", metavar="NAME",
                   help="the CSV column naming the person (subject) each row belongs to; "
                        "`delete` by subject_id removes all their rows. Without it each "
                        "row is its own subject (s0000, s0001, ...)")
    p.add_argument("--id-column", metavar="NAME",
                   help="the CSV column holding each row's record id (unique); default "
                        "r0000, r0001, ... by row")
    p.add_argument("--categorical", metavar="COL,...", type=_names, default=(),
                   help="columns to encode as categories even when they hold numbers "
                        "(kinds are inferred otherwise)")
    p.add_argument("--numeric", metavar="COL,...", type=_names, default=(),
                   help="columns that must be numbers (a text cell is refused)")
    p.add_argument("--na", metavar="MARKER", help="the text that marks a missing value "
                   "(e.g. '?'; empty cells are missing too): a category of its own in a "
                   "categorical column; in a numeric one refused, or see --impute")
    p.add_argument("--impute", choices=("median", "mean"), help="fill missing numbers with "
                   "the column's median or mean at init (rounded; stored in the schema)")
    p.add_argument("--min-frequency", type=int, default=5, metavar="N",
                   help="a category seen in fewer rows is coded 'other' and never stored "
                        "by name (default 5)")
    p.add_argument("--records-per-subject", type=int, default=3,
                   help="bundled tables: rows per made-up subject (default 3)")
    p.set_defaults(func=cmd_init)


def _names(text: str) -> tuple[str, ...]:
    """`a,b,c` -> ('a', 'b', 'c')."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _add_intake_commands(sub: argparse._SubParsersAction) -> None:
    """The ways requests come in: `submit` one, `produce` to Kafka, `consume` from it."""
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


def _add_proof_commands(lsub: argparse._SubParsersAction) -> None:
    """What the ledger publishes for auditors and subjects, and its signing key's
    rotation: `ledger receipt`, `key`, `heads`, `consistency`, `rotate-key`."""
    p = lsub.add_parser("receipt", help="a deletion receipt its subject can check alone "
                        "(`python -m ledger.receipt FILE --key PUBKEY`)")
    p.add_argument("request_id")
    p.add_argument("-o", "--out", help="the file to write (default receipt-REQUEST_ID.json; "
                   "- for standard output)")
    p.set_defaults(func=cmd_receipt)

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

    p = lsub.add_parser("rotate-key", help="hand the log over to a new signing key (an "
                        "event signed by the current key, which signs its last head over it)")
    p.add_argument("--new-key-file", required=True, metavar="FILE",
                   help="the new key (64 hex digits); created (0600) when it does not exist")
    p.set_defaults(func=cmd_rotate_key)


def add_connection_options(p: argparse.ArgumentParser, default: Any = None) -> None:
    """`--db`, `--bootstrap`, `--topic`; a command's own copy takes argparse.SUPPRESS as
    `default`, so it overrides the value given before the command only when given."""
    p.add_argument("--db", metavar="URL", default=default,
                   help="ledger database URL (env OBLIVIATE_DATABASE_URL; default "
                        "sqlite:///.obliviate/ledger.db)")
    p.add_argument("--bootstrap", metavar="HOST:PORT", default=default,
                   help="Kafka bootstrap address (env OBLIVIATE_KAFKA_BOOTSTRAP)")
    p.add_argument("--topic", default=default,
                   help="requests topic (env OBLIVIATE_REQUESTS_TOPIC)")


def cmd_init(args: argparse.Namespace) -> int:
    from ledger import datasets

    ledger = open_ledger(args)
    existing = ledger.records.input_transform()
    stored = existing if existing is not None and existing.fitted else None
    if args.csv or args.parquet:
        if args.min_frequency < 1:
            raise ValueError(f"--min-frequency must be at least 1, got {args.min_frequency}")
        options = datasets.TableOptions(args.categorical, args.numeric, args.na, args.impute,
                                        args.min_frequency)
        load = datasets.load_csv if args.csv else datasets.load_parquet
        ds = load(args.csv or args.parquet, args.label_column, args.subject_column,
                  args.id_column, transform=stored, options=options)
    else:
        if args.subject_column or args.id_column:
            raise ValueError("--subject-column and --id-column name columns of --csv FILE")
        ds = datasets.load(args.dataset, records_per_subject=args.records_per_subject)
        if stored is not None:
            ds = datasets.from_raw(ds.name, ds.raw, ds.y, ds.record_ids, ds.subject_ids,
                                   transform=stored)
    # a ledger from before stored transforms keeps its identity transform
    transform = None if existing is not None and stored is None else ds.transform
    seq = ledger.records.load(ds.record_ids, ds.subject_ids, ds.X, ds.y, name=ds.name,
                              transform=transform)
    print(f"loaded {len(ds.record_ids)} records of {ds.name!r} "
          f"({ds.X.shape[1]} features, {len(set(ds.y.tolist()))} classes) as event {seq}")
    if transform is not None:
        how = "stored" if existing else "fitted and stored"
        print(f"features min-max scaled to [0, 1] by the ranges {how} in the ledger "
              "(`obliviate ledger schema`); /v1/predict and additions take raw values")
        if transform.columns:
            print(_encoding_summary(transform))
    if (args.csv or args.parquet) and not args.subject_column:
        print("no --subject-column: each row is its own subject (s0000, s0001, ...)")
    return 0


def _encoding_summary(transform: Any) -> str:
    """One line: the columns by kind, and the label names."""
    kinds: dict[str, list[str]] = {}
    for c in transform.columns:
        kinds.setdefault(c.kind, []).append(
            f"{c.name} ({len(c.categories)} + other)" if c.kind == "categorical" else
            f"{c.name} (missing -> {c.impute:g})" if c.impute is not None else c.name)
    text = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in kinds.items())
    labels = f"; labels {', '.join(transform.labels)}" if transform.labels else ""
    return f"columns {text}{labels}"


def cmd_schema(args: argparse.Namespace) -> int:
    schema = open_ledger(args).records.schema()
    if schema is None:
        print("the ledger holds no records yet: run `obliviate ledger init`", file=sys.stderr)
        return 1
    from ledger.transform import schema_document

    doc = schema_document(schema)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"schema {doc['name']!r}: {doc['n_features']} features, classes {doc['classes']}"
          f" ({', '.join(doc['label_names'])}), transform {doc['transform']}")
    for c in doc["columns"]:
        if c["kind"] != "numeric" or "impute" in c:
            what = (f"categories {', '.join(map(repr, c['categories']))} + other"
                    if c["kind"] == "categorical" else
                    f"missing -> {c['impute']:g}" if "impute" in c else "0/1")
            print(f"  column {c['name']} ({c['kind']}): {what}")
    width = max(len(f["name"]) for f in doc["features"])
    print(f"  {'feature':<{width}}  {'min':>12}  {'max':>12}")
    for f in doc["features"]:
        print(f"  {f['name']:<{width}}  {f['min']:>12g}  {f['max']:>12g}")
    print(f"input: {doc['input']}")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from ledger import migrations

    ledger = settings_from(args).open_ledger()
    print(ledger.schema_upgrade.describe())
    heads = migrations.script_heads()
    if heads != [migrations.HEAD]:
        print(f"obliviate: error: the migrations' head is {heads}, the code expects "
              f"{migrations.HEAD}", file=sys.stderr)
        return 1
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """`ledger verify`: everything, or (`--since-verified`) the log after the head the last
    verify passed on; a verify that passes keeps its newest signed head for the next."""
    from ledger import verified_head

    settings = settings_from(args)
    ledger = open_ledger(args, settings, sign=False)
    path = Path(getattr(args, "verified_head", None) or settings.verified_head_file)
    since = None
    if getattr(args, "since_verified", False):
        try:
            since = verified_head.load(path)
        except ValueError as exc:
            print(f"obliviate: error: {exc}", file=sys.stderr)
            return 1
        if since is None:
            print(f"note: no verified head in {path} yet: verifying everything",
                  file=sys.stderr)
    result = ledger.verify() if since is None else ledger.verifier.verify_since(since)
    if since is None:
        for check in getattr(args, "verify_checks", ()):
            result.problems.extend(check(ledger))
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if not result.problems:
        if result.verified_head is not None:
            try:
                verified_head.save(path, result.verified_head)
            except OSError as exc:
                print(f"note: the verified head could not be kept at {path} ({exc.strerror}): "
                      "the next --since-verified starts from an older one", file=sys.stderr)
        if since is not None:
            print(f"ledger OK: events {result.since + 1}..{result.events} and "
                  f"{result.heads} signed heads verified since the head over {result.since}")
        else:
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
        history = open_ledger(args).history(args.request_id)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(history, indent=2, default=str))
        return 0
    from ledger.history_text import render_history

    print("\n".join(render_history(history)))
    return 0


def cmd_forgotten(args: argparse.Namespace) -> int:
    from ledger.forgotten import forgotten, render

    try:
        report = forgotten(open_ledger(args), args.request_id)
    except (KeyError, ValueError) as exc:
        print(exc.args[0], file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print("\n".join(render(report)))
    return 0


def cmd_receipt(args: argparse.Namespace) -> int:
    from ledger.forgotten import receipt

    try:
        ledger = open_ledger(args)
        doc = receipt(ledger, args.request_id)
    except (KeyError, ValueError) as exc:
        print(exc.args[0], file=sys.stderr)
        return 1
    text = json.dumps(doc, indent=1) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.out or "receipt-" + "".join(c if c.isalnum() or c in "._-" else "_"
                                                for c in args.request_id) + ".json")
    out.write_text(text)
    print(f"wrote {out}: check it with `python -m ledger.receipt {out} --key "
          f"{ledger.heads.public_key.hex()}`")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    since: str | int | None = args.since
    if since is not None and since.isdigit():
        since = int(since)
    for event in open_ledger(args).events.export(since):
        sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    ledger = open_ledger(args)
    cp = ledger.heads.checkpoint()
    if cp is None:
        print("the ledger has no events yet")
        return 0
    head = ledger.heads.published(since=cp.tree_size - 1, limit=1)["heads"]
    signed = (f" signed={head[0]['signature'][:16]}... log_id={head[0]['log_id']}"
              if head and head[0]["tree_size"] == cp.tree_size else " (not signed)")
    print(f"tree_size={cp.tree_size} root={cp.root_hash} created_at={cp.created_at}{signed}")
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    from ledger.heads import public_key_pem

    public = open_ledger(args).heads.public_key
    print(public_key_pem(public).rstrip() if args.pem else public.hex())
    return 0


def cmd_rotate_key(args: argparse.Namespace) -> int:
    from ledger.config import key_file_seed

    ledger = open_ledger(args)
    old = ledger.heads.public_key.hex()
    done = ledger.heads.rotate_key(key_file_seed(args.new_key_file))
    print(f"event {done['seq']} hands the log over from key {old} to key "
          f"{done['public_key']} (log {done['log_id']}), signed by the old key, whose last "
          f"head covers it. Give every process the new key (OBLIVIATE_LEDGER_SIGNING_KEY_FILE="
          f"{args.new_key_file}) and restart them: those holding the old key stop signing.")
    return 0


def cmd_heads(args: argparse.Namespace) -> int:
    doc = open_ledger(args).heads.published(args.since, args.limit)
    print(json.dumps(doc, indent=1))
    return 0


def cmd_consistency(args: argparse.Namespace) -> int:
    try:
        proof = open_ledger(args).events.consistency(args.old_size, args.new_size)
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
        ledger = open_ledger(args, sign=False)
        current = ledger.heads.published()
    events = None
    if args.events:
        events = audit.read_events(args.events)
    elif not args.url:
        events = (ledger or open_ledger(args, sign=False)).events.export()
    result = audit.audit(audit.read_json(args.heads), current,
                         public_key=audit.key_argument(args.public_key), events=events,
                         consistency=audit.http_consistency(args.url) if args.url else None)
    return audit.report(result)


def cmd_submit(args: argparse.Namespace) -> int:
    text = _read_arg(args.request)
    ledger = open_ledger(args)
    result = ledger.receive(text.encode(), source="cli")
    answer = result.as_dict()
    if result.status == "accepted":  # the subject's key to GET /v1/requests/{id}/receipt
        answer["receipt_token"] = ledger.events.receipt_token(result.request_id)
    print(json.dumps(answer))
    return 0 if result.status in ("accepted", "duplicate") else 2


def cmd_produce(args: argparse.Namespace) -> int:
    from ledger.consumer import ensure_topics
    from ledger.producer import produce, request_stream

    s = settings_from(args)
    ensure_topics(s.kafka_bootstrap, list(s.topic_configs()), configs=s.topic_configs())
    if args.file:
        messages: Any = (line.encode() for line in Path(args.file).read_text().splitlines()
                         if line.strip())
    else:
        ledger = open_ledger(args, s)
        schema = ledger.records.schema()
        if schema is None:
            print("the ledger holds no records: run `obliviate ledger init` first",
                  file=sys.stderr)
            return 1
        live = ledger.records.live()
        messages = request_stream(list(live.record_ids), list(live.subject_ids),
                                  schema.n_features, schema.classes, args.count,
                                  random_state=args.seed, invalid_fraction=args.invalid_fraction,
                                  feature_ranges=None if schema.input_transform.columns
                                  else list(zip(schema.input_transform.mins,
                                                schema.input_transform.maxs, strict=True)))
    n = produce(s.kafka_bootstrap, s.requests_topic, messages)
    print(f"sent {n} messages to {s.requests_topic} at {s.kafka_bootstrap}")
    return 0


def start_long_running(args: argparse.Namespace, default_metrics_port: int,
                       port_setting: str) -> None:
    """Logging, and the Prometheus endpoint (`--metrics-port`, else the setting
    `port_setting`; 0 for none) of a daemon, on OBLIVIATE_METRICS_HOST; ValueError naming
    the port and the setting when it cannot listen there."""
    from prometheus_client import start_http_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    port = default_metrics_port if args.metrics_port is None else args.metrics_port
    host = settings_from(args).metrics_host
    if port:
        try:
            start_http_server(port, addr=host)
        except OSError as exc:
            raise ValueError(f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}): "
                             f"pick another --metrics-port or {port_setting} (0 turns them "
                             "off)") from None


def cmd_consume(args: argparse.Namespace) -> int:
    from ledger.consumer import RequestConsumer, ensure_topics

    s = settings_from(args)
    start_long_running(args, s.consumer_metrics_port, "OBLIVIATE_CONSUMER_METRICS_PORT")
    ensure_topics(s.kafka_bootstrap, list(s.topic_configs()), configs=s.topic_configs())
    ledger = s.open_ledger()
    log.info("%s", ledger.schema_upgrade.describe())  # the migrations ran as it opened
    consumer = RequestConsumer(ledger, s.kafka_bootstrap, s.requests_topic,
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

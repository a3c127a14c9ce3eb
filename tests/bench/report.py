"""Rewrite one benchmark's table in docs/benchmarks.md from the RESULT lines it printed.

    python tests/bench/bench_x.py --quick | python tests/bench/report.py --bench bench_x \\
        --machine "2-core machine" [--command "bench_x.py --quick"] [--date 2026-11-27] \\
        [--doc docs/benchmarks.md] [--replace] [LOG ...]

Every benchmark ends with ``RESULT key=value ...`` lines (read from the LOG files, or from
standard input). Each becomes a row of the table between ``<!-- bench_x:begin -->`` and
``<!-- bench_x:end -->``: the date, the machine, the command, one column per key (a word
without ``=`` goes to ``kind``) and a ``note``. The new rows go on top; the rows already
there stay below them, since the table is the benchmark's history, except those of the
same date, machine and command, which the new run replaces (``--replace``: keep none).
A row whose ``stage`` has a table of its own (markers ``bench_x.STAGE``) goes to that one,
so that a benchmark of several stages keeps one readable table per stage.
Standard library only, so it runs wherever a benchmark does.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

FIRST = ("date", "machine", "command")
LAST = "note"
_CELL = re.compile(r"(?<!\\)\|")


def parse_results(lines: list[str]) -> list[dict[str, str]]:
    """The RESULT lines' fields, in order; a bare word is the row's ``kind``."""
    rows = []
    for line in lines:
        words = line.split()
        if not words or words[0] != "RESULT":
            continue
        row: dict[str, str] = {}
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if sep:
                row[key] = value
            else:
                row["kind"] = f"{row['kind']} {word}" if "kind" in row else word
        rows.append(row)
    return rows


def read_table(text: str) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of a Markdown table (no table: no header, no rows; ValueError for a
    row of another width)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if not lines:
        return [], []
    cells = [[c.strip() for c in _CELL.split(ln.strip("|"))] for ln in lines]
    header = cells[0]
    for line, row in zip(lines[2:], cells[2:], strict=True):
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} columns: {line}")
    return header, [dict(zip(header, row, strict=True)) for row in cells[2:]]


def render_table(header: list[str], rows: list[dict[str, str]]) -> str:
    """A Markdown table; a missing cell is empty."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row.get(col, "") for col in header) + " |" for row in rows]
    return "\n".join(out)


def merge(old_header: list[str], old_rows: list[dict[str, str]], new_rows: list[dict[str, str]],
          replace: bool) -> tuple[list[str], list[dict[str, str]]]:
    """New rows on top of the old ones that stay; the columns of both, in order."""
    keys = [k for row in [dict.fromkeys(old_header), *new_rows] for k in row
            if k not in FIRST and k != LAST]
    header = [*FIRST, *dict.fromkeys(keys), LAST]
    runs = {tuple(row[c] for c in FIRST) for row in new_rows}
    kept = [] if replace else [r for r in old_rows if tuple(r.get(c, "") for c in FIRST)
                                not in runs]
    return header, new_rows + kept


def rewrite(doc: str, bench: str, new_rows: list[dict[str, str]], replace: bool) -> str:
    """The document with `bench`'s table rewritten (ValueError without its markers)."""
    begin, end = f"<!-- {bench}:begin -->", f"<!-- {bench}:end -->"
    start, stop = doc.find(begin), doc.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no {begin} ... {end} markers")
    header, rows = merge(*read_table(doc[start + len(begin):stop]), new_rows, replace)
    return f"{doc[:start + len(begin)]}\n{render_table(header, rows)}\n{doc[stop:]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="*", type=Path, help="benchmark output (default: stdin)")
    ap.add_argument("--bench", required=True, help="the benchmark, e.g. bench_e2e")
    ap.add_argument("--machine", required=True, help='where it ran, e.g. "2-core machine"')
    ap.add_argument("--command", help="what ran (default: BENCH.py)")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    ap.add_argument("--replace", action="store_true", help="drop the rows already there")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9_]+", args.bench):
        ap.error(f"--bench {args.bench!r}: a benchmark's name, such as bench_e2e")
    lines = [ln for log in args.logs for ln in log.read_text().splitlines()] if args.logs \
        else sys.stdin.read().splitlines()
    results = parse_results(lines)
    if not results:
        print("report.py: no RESULT line in the input: nothing to write", file=sys.stderr)
        return 1
    run = {"date": args.date, "machine": args.machine,
           "command": args.command or f"{args.bench}.py"}
    try:
        text = args.doc.read_text()
        for table, rows in by_table(text, args.bench, results).items():
            text = rewrite(text, table, [run | r for r in rows], args.replace)
            print(f"{args.doc}: {table}: {len(rows)} row(s) written", file=sys.stderr)
    except (OSError, ValueError) as exc:
        ap.error(f"{args.doc}: {exc}")
    args.doc.write_text(text)
    return 0


def by_table(doc: str, bench: str, rows: list[dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    """The rows grouped by the table they go to: ``bench.STAGE`` where the document has
    that table, else ``bench``."""
    out: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        own = f"{bench}.{row.get('stage')}"
        out.setdefault(own if f"<!-- {own}:begin -->" in doc else bench, []).append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())

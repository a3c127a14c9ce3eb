"""tests/bench/report.py: RESULT lines in, a benchmark's table in docs/benchmarks.md out."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "tests" / "bench" / "report.py"
sys.path.insert(0, str(REPORT.parent))
from report import main, read_table  # noqa: E402

DOC = """# Benchmarks

## bench_x

<!-- bench_x:begin -->
| date | machine | command | learner | p50_s | note |
|---|---|---|---|---|---|
| 2026-11-26 | 2-core machine | bench_x.py | dare | 3.9 | baseline |
| 2026-11-27 | H200 | bench_x.py --quick | dare | 9.9 | replaced by the same run |
<!-- bench_x:end -->

text after
"""

STREAM = """== starting
[dare] 1000 latencies measured
RESULT learner=dare records=16000 p50_s=3.1 lost=0
RESULT learner=sisa records=16000 p50_s=0.7 lost=0 shard_retrain_s=0.05
TARGET p50 <= 2 s: missed
"""


def report(doc: Path, *args: str, stdin: str = STREAM) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPORT), "--doc", str(doc), *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


@pytest.mark.processes
def test_result_lines_become_rows_on_top_of_the_tables_history(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    run = report(doc, "--bench", "bench_x", "--machine", "H200", "--command",
                 "bench_x.py --quick", "--date", "2026-11-27")
    assert run.returncode == 0, run.stderr
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\n## bench_x\n\n<!-- bench_x:begin -->\n")
    assert text.endswith("<!-- bench_x:end -->\n\ntext after\n")
    table = text[text.index("| date"):text.index("<!-- bench_x:end")]
    assert table.splitlines() == [
        "| date | machine | command | learner | p50_s | records | lost | shard_retrain_s "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|",
        "| 2026-11-27 | H200 | bench_x.py --quick | dare | 3.1 | 16000 | 0 |  |  |",
        "| 2026-11-27 | H200 | bench_x.py --quick | sisa | 0.7 | 16000 | 0 | 0.05 |  |",
        "| 2026-11-26 | 2-core machine | bench_x.py | dare | 3.9 |  |  |  | baseline |",
    ]


@pytest.mark.processes
def test_replace_keeps_no_earlier_row_and_logs_are_read_like_stdin(tmp_path: Path) -> None:
    doc, log = tmp_path / "benchmarks.md", tmp_path / "run.log"
    doc.write_text(DOC)
    log.write_text("RESULT loo n=200 networks=201 exact=true\n")
    run = report(doc, str(log), "--bench", "bench_x", "--machine", "m", "--replace",
                 stdin="")
    assert run.returncode == 0, run.stderr
    header, rows = read_table(doc.read_text())
    assert header[:3] == ["date", "machine", "command"] and header[-1] == "note"
    assert [(r["command"], r["kind"], r["n"]) for r in rows] == [("bench_x.py", "loo", "200")]


@pytest.mark.processes
def test_no_markers_or_no_results_change_nothing_and_say_why_in_one_line(
        tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOC)
    missing = report(doc, "--bench", "bench_y", "--machine", "m")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        f"report.py: error: {doc}: no <!-- bench_y:begin --> ... <!-- bench_y:end --> "
        "markers")
    empty = report(doc, "--bench", "bench_x", "--machine", "m", stdin="no results\n")
    assert empty.returncode == 1
    assert empty.stderr.strip() == "report.py: no RESULT line in the input: nothing to write"
    assert "Traceback" not in missing.stderr + empty.stderr
    assert doc.read_text() == DOC


def test_a_stage_with_a_table_of_its_own_gets_its_rows_there(tmp_path: Path) -> None:
    doc, log = tmp_path / "benchmarks.md", tmp_path / "run.log"
    doc.write_text(DOC.replace("text after", "<!-- bench_x.e2e:begin -->\n"
                               "<!-- bench_x.e2e:end -->\n\ntext after"))
    log.write_text("RESULT stage=e2e n=10 p50_s=1.5\nRESULT stage=dare n=10 fit_s=2\n")
    assert main([str(log), "--doc", str(doc), "--bench", "bench_x", "--machine", "m"]) == 0
    text = doc.read_text()
    first = text[:text.index("<!-- bench_x:end")]
    e2e = text[text.index("<!-- bench_x.e2e:begin"):]
    assert [r.get("stage") for r in read_table(first)[1]] == ["dare", "", ""]
    header, rows = read_table(e2e)
    assert [r["p50_s"] for r in rows] == ["1.5"] and "fit_s" not in header


def test_every_benchmark_has_a_table_the_script_can_rewrite() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    for bench in sorted(p.stem for p in (ROOT / "tests" / "bench").glob("bench_*.py")):
        begin, end = f"<!-- {bench}:begin -->", f"<!-- {bench}:end -->"
        assert begin in text and end in text, f"docs/benchmarks.md: no table for {bench}"
        region = text[text.index(begin) + len(begin):text.index(end)]
        lines = [ln for ln in region.splitlines() if ln.strip()]
        header, rows = read_table(region)
        if not lines:
            continue
        assert header[:3] == ["date", "machine", "command"] and header[-1] == "note", bench
        widths = {ln.count("|") for ln in lines}
        assert widths == {len(header) + 1}, f"{bench}: rows of another width than the header"
        assert all(r["date"] and r["machine"] and r["command"] for r in rows), bench


def test_every_table_of_every_stage_can_be_rewritten() -> None:
    """A stage's table (``bench_x.stage``) too: one row of another width and the script
    refuses to write any row of that benchmark."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    names = re.findall(r"<!-- (bench_[\w.]+):begin -->", text)
    assert any("." in name for name in names)
    for name in names:
        region = text[text.index(f"<!-- {name}:begin -->"):text.index(f"<!-- {name}:end -->")]
        header, rows = read_table(region.split("\n", 1)[1])  # raises on a row too wide
        assert not header or (header[-1] == "note" and all(r["date"] for r in rows)), name

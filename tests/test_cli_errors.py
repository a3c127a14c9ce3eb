"""The command line as a new user meets it: fast to start, one clear line per error.

- `import service.cli` and building the parser import none of torch, numba, SciPy
  or the solvers, and neither do the `ledger` commands, `submit` and `produce`
  (each checked in a fresh interpreter).
- Errors are one line on stderr that says what is wrong and what to do: CSV files
  name the file, line and column; a database that cannot be reached is named
  (password hidden) with exit 1, not a traceback; usage errors exit 2.
- `--db` works after the subcommand as well as before it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import main

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "numba", "scipy", "highspy", "gurobipy")


@pytest.fixture
def env(tmp_path, monkeypatch) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("OBLIVIATE_DATABASE_URL", url)
    monkeypatch.setenv("OBLIVIATE_HMAC_KEY_FILE", str(tmp_path / "hmac.key"))
    monkeypatch.setenv("OBLIVIATE_LEDGER_SIGNING_KEY_FILE", str(tmp_path / "signing.key"))
    return url


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _modules_after(script: str, env: dict[str, str] | None = None) -> list[str]:
    """The heavy packages a fresh interpreter holds after running `script`."""
    probe = (f"{script}\nimport sys, json\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & "
             f"set({list(HEAVY)!r}))))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.processes
def test_building_the_parser_imports_no_learner_or_solver() -> None:
    assert _modules_after("import service.cli\nservice.cli.build_parser()") == []


@pytest.mark.processes
def test_ledger_submit_and_produce_commands_import_no_learner_or_solver(
        tmp_path: Path, broker) -> None:  # noqa: ANN001 - the session's tansu broker
    import os

    csv = tmp_path / "people.csv"
    csv.write_text("person,age,income,label\np1,30,1000,0\np2,40,2000,1\np3,50,1500,1\n")
    env = {**os.environ, "OBLIVIATE_DATABASE_URL": f"sqlite:///{tmp_path / 'l.db'}",
           "OBLIVIATE_HMAC_KEY_FILE": str(tmp_path / "hmac.key"),
           "OBLIVIATE_LEDGER_SIGNING_KEY_FILE": str(tmp_path / "signing.key"),
           "OBLIVIATE_KAFKA_BOOTSTRAP": broker.bootstrap,
           "OBLIVIATE_REQUESTS_TOPIC": f"cli-{tmp_path.name[-6:]}"}
    commands = [
        ["ledger", "init", "--csv", str(csv), "--subject-column", "person"],
        ["submit", '{"request_id": "q1", "op": "delete", "subject_id": "p1"}'],
        ["ledger", "verify"], ["ledger", "show", "q1"], ["ledger", "schema"],
        ["ledger", "export"], ["ledger", "checkpoint"], ["ledger", "heads"],
        ["ledger", "forgotten", "q1"], ["ledger", "receipt", "q1", "-o", "-"],
        ["ledger", "key"], ["ledger", "migrate"],
        ["produce", "--count", "5"],
    ]
    script = ("from service.cli import main\n"
              + "".join(f"assert main({c!r}) in (0, 1), {c!r}\n" for c in commands))
    assert _modules_after(script, env) == []


def test_csv_errors_name_the_file_line_and_column(env: str, tmp_path: Path, capsys) -> None:
    def init(text: str, *extra: str) -> str:
        path = tmp_path / "people.csv"
        path.write_text(text)
        code, out, err = run(capsys, "ledger", "init", "--csv", str(path), *extra)
        assert code == 2, (out, err)
        assert len(err.strip().splitlines()) == 1, err
        assert str(path) in err
        return err

    err = init("age,income,label\n30,1000,0\n40,,1\n")
    assert "line 3, column 'income': empty" in err
    err = init("age,income,label\n30,nan,0\n")
    assert "line 2, column 'income': 'nan' is not a finite number" in err
    # issue 28: a text column is a category now, but one of ids is refused with the fix
    err = init("customer,age,label\ncust0000,30,0\ncust0001,40,1\n")
    assert "line 2, column 'customer': 'cust0000' looks like an id, not a feature" in err
    assert "--subject-column customer" in err
    err = init("id,person,age,label\na,p,30,0\nb,p,40,1\n", "--subject-column", "person")
    assert "column 'id': 'a' looks like an id" in err and "pass --id-column id" in err
    err = init("age,label\n30,yes\n", "--numeric", "age,sex")
    assert "no column 'sex'" in err and "--numeric" in err
    err = init("age,label\n30,0\nforty,1\n", "--numeric", "age")
    assert "line 3, column 'age': 'forty' is not a number" in err
    err = init("age,label\n30,yes\n40,\n")  # a text label works; a missing one does not
    assert "line 3, column 'label': missing; every row needs a class label" in err
    err = init("age,y\n30,1\n")
    assert "no column 'label' (columns: age, y)" in err and "--label-column" in err
    err = init("age,label\n30,1\n", "--subject-column", "person")
    assert "no column 'person'" in err
    err = init("id,age,label\na,30,1\na,31,0\n", "--id-column", "id")
    assert "line 3, column 'id': record id 'a' is on line 2 too" in err
    code, _, err = run(capsys, "ledger", "init", "--csv", str(tmp_path / "missing.csv"))
    assert code == 2 and "missing.csv: no such file" in err


def test_an_unreachable_database_is_one_line_and_exit_1(tmp_path: Path, capsys,
                                                        monkeypatch) -> None:
    monkeypatch.setenv("OBLIVIATE_HMAC_KEY_FILE", str(tmp_path / "hmac.key"))
    url = "postgresql://someone:s3cret-pw@127.0.0.1:1/nothing"
    code, out, err = run(capsys, "ledger", "verify", "--db", url)
    assert code == 1 and not out
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("obliviate: error: cannot use postgresql://someone:***@127.0.0.1:1")
    assert "s3cret-pw" not in err and "OBLIVIATE_DATABASE_URL" in err


@pytest.mark.processes
def test_the_subprocess_shows_no_traceback_for_an_unreachable_database(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "service.cli", "--db",
                          "postgresql://u@127.0.0.1:1/x", "ledger", "verify"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin",
                              "OBLIVIATE_HMAC_KEY_FILE": str(tmp_path / "k"),
                              "OBLIVIATE_KEY_STORE_DIR": str(tmp_path / "keys")})
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_db_is_taken_after_the_subcommand_too(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("OBLIVIATE_HMAC_KEY_FILE", str(tmp_path / "hmac.key"))
    monkeypatch.setenv("OBLIVIATE_LEDGER_SIGNING_KEY_FILE", str(tmp_path / "signing.key"))
    monkeypatch.delenv("OBLIVIATE_DATABASE_URL", raising=False)
    monkeypatch.chdir(tmp_path)  # the default ledger would be .obliviate/ledger.db here
    a, b = (f"sqlite:///{tmp_path / n}" for n in ("a.db", "b.db"))
    assert run(capsys, "ledger", "init", "--dataset", "iris", "--db", a)[0] == 0
    code, out, _ = run(capsys, "ledger", "verify", "--db", a)
    assert code == 0 and "150 records verified" in out
    code, out, _ = run(capsys, "--db", b, "ledger", "verify")  # before it, as before
    assert code == 0 and "0 records verified" in out
    code, out, _ = run(capsys, "--db", b, "ledger", "verify", "--db", a)  # the later wins
    assert code == 0 and "150 records verified" in out
    assert not (tmp_path / ".obliviate" / "ledger.db").exists()


def test_usage_errors_exit_2_with_one_line(env: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["ledger", "init", "--nope"])
    assert exc.value.code == 2
    code, _, err = run(capsys, "ledger", "init", "--dataset", "nope")
    assert code == 2 and "unknown data set 'nope'" in err and "--csv" in err
    code, _, err = run(capsys, "model", "train", "--params", "[1]")
    assert code == 2 and err.count("\n") == 1


def test_init_help_explains_the_csv_columns_and_the_scaling(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["ledger", "init", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--subject-column NAME the CSV column naming the person" in out
    assert "--id-column NAME the CSV column holding each row's record id" in out
    assert "min-max scaled" in out


def test_the_learner_choices_are_the_served_kinds() -> None:
    from jobs.orchestration.model_commands import LEARNERS
    from jobs.orchestration.served_model import KINDS
    from ledger.commands import DATASETS
    from ledger.datasets import NAMES

    assert set(LEARNERS) == set(KINDS) and tuple(DATASETS) == tuple(NAMES)

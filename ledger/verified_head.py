"""The signed head the last `ledger verify` passed on, kept in a file outside the database.

`ledger verify --since-verified` starts from it and reads only the log after it. It is
a file of the verifying machine (OBLIVIATE_VERIFIED_HEAD_FILE), not a row, because
whoever can write the database could swap a row for a head the ledger's own signer
took over a rewritten log; a file they cannot write pins the history the way an
auditor's saved heads do. See docs/ledger.md#incremental-verify.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ledger.heads import HEAD_FIELDS

FORMAT = "obliviate-verified-head/v1"


def load(path: Path) -> dict[str, Any] | None:
    """The head kept at `path`; None when there is no file, ValueError (one line, naming
    the file) when it is not one this module wrote."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a verified head ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    head = doc.get("head") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
    if not (isinstance(head, dict) and set(HEAD_FIELDS) <= head.keys()
            and type(head["tree_size"]) is int and head["tree_size"] > 0
            and all(isinstance(head[k], str) for k in HEAD_FIELDS if k != "tree_size")):
        raise ValueError(f"{path}: not a verified head (format {FORMAT} with a signed head "
                         "over at least one event expected)")
    return {k: head[k] for k in HEAD_FIELDS}


def save(path: Path, head: dict[str, Any]) -> None:
    """Keep `head` at `path` (0600), replacing the file whole so a crash leaves the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"format": FORMAT, "head": {k: head[k] for k in HEAD_FIELDS}}, fh,
                      indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

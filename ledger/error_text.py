"""One line of an error for a message a person reads: the class and the first line, never
the DETAIL or CONTEXT a database driver adds (they quote values). Standard library only,
so the learners can use it without importing the ledger's database layer.
See docs/ledger.md (Limits and rejections)."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The class and first line of an error: no DETAIL or CONTEXT, which quote values."""
    inner = getattr(exc, "orig", None) or exc
    text = (str(inner).strip().splitlines() or [""])[0][:200]
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__

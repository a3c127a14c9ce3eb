"""The iDP guard: label-only answers, each eps-iDP with respect to the current training set.

LUCID's bound for one network (:mod:`jobs.guard.lucid`), the forest guard for DaRE
(:mod:`jobs.guard.forest`), and the certainty rules, noise and memo that turn either into
answers (:mod:`jobs.guard.label_guard`).
See docs/guard.md (LUCID for one network)."""

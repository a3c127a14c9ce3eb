"""Adaptive deletion sequences (Gupta et al.): answers private in the shard seeds.

:mod:`~jobs.adaptive.composition` accounts the privacy loss of many answers,
:mod:`~jobs.adaptive.private_vote` answers with a noisy vote, and
:mod:`~jobs.adaptive.attack` is the Sec. 6 attack that shows why plain SISA needs them.
See docs/guard.md (Private prediction mode)."""

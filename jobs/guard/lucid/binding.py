"""A bound tied to the exact networks it was verified for.

:class:`BoundBinding` carries the content hashes of the network N and its LOO set beside
the per-class betas; whoever serves with it uses it only while both hashes are those of
what it serves (anything else answers in noise-all mode). The betas are authenticated by
the version's sealed files (:mod:`jobs.sealing`).
See docs/guard.md (One network)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jobs.guard.lucid.branch_and_bound import BoundReport
from jobs.learners.networks.loo_training import LOOSet


@dataclass(frozen=True)
class BoundBinding:
    """Per-class serving bounds tied to the exact network they were verified for.

    ``beta[c]`` is ``BoundReport.serving_beta()[c]`` (``max(beta_c, 0)``;
    ``+inf`` when the search proved nothing, which makes class c always noised).
    """

    network_hash: str  # MLPParams.content_hash() of the LOO set's full network N
    loo_hash: str  # LOOSet.content_hash() the bound was computed on
    beta: tuple[float, ...]
    manifest: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def from_report(cls, report: BoundReport, loo_set: LOOSet) -> BoundBinding:
        """Bind ``report`` to ``loo_set``; ValueError if it was computed on another set."""
        digest = loo_set.content_hash()
        if report.loo_hash != digest:
            raise ValueError(f"the bound was computed on LOO set {report.loo_hash[:12]}..., "
                             f"not on {digest[:12]}...")
        sb = report.serving_beta()
        C = loo_set.n_classes
        if set(sb) != set(range(C)):
            raise ValueError(f"the bound covers classes {sorted(sb)}, the network has {C}")
        beta = tuple(float(sb[c]) for c in range(C))
        if any(np.isnan(b) for b in beta):
            raise ValueError("a bound is NaN")
        return cls(loo_set.full().content_hash(), digest, beta, report.manifest())

    def matches(self, network_hash: str, loo_hash: str | None) -> bool:
        return self.network_hash == network_hash and self.loo_hash == loo_hash


__all__ = ["BoundBinding"]

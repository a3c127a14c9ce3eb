"""The iDP guard (LUCID, docs/PAPERS.md §1, and what goes beyond it).

* (:mod:`jobs.learners.networks.loo_training`, a learner's training and so in ``learners``: the full
  network N and all leave-one-out networks N_{-x}, trained together with one masked,
  keyed schedule, bit-identical to single runs);
* :mod:`jobs.guard.lucid.interval_bounds` -- interval bound propagation for a network and for a
  hyper-network, and the difference intervals of matching neurons;
* :mod:`jobs.guard.lucid.milp` -- the MILP of LUCID's Eq. 3 (network + hyper-network);
* :mod:`jobs.guard.lucid.solvers` -- HiGHS / Gurobi behind one interface (dual bounds);
* :mod:`jobs.guard.lucid.branch_and_bound` -- branch and bound over sets of LOO networks and
  :func:`~jobs.guard.lucid.branch_and_bound.compute_bounds`, the per-class bounds with a manifest;
* :mod:`jobs.guard.lucid.falsifier` -- a falsifier: sampling and gradient search for
  leaking inputs (lower bounds on the true bound; used by tests and benchmarks);
* :mod:`jobs.guard.label_guard` -- guarded label-only answers: the certainty rules
  (one network; SISA's vote rule), the exponential mechanism, the memo;
* :mod:`jobs.guard.lucid.binding` -- a bound tied to the content hashes of the network and LOO
  set it covers (the sidecar's ``mlp`` learner serves with it; the stand-alone guarded
  network that the benchmarks use lives in ``tests/bench/guarded_network.py``);
* :mod:`jobs.guard.lucid.shard_bounds` -- per-shard LOO sets and bounds for an ensemble;
* :mod:`jobs.guard.forest.forest_guard` -- the same guard for DaRE forests, from exact
  leave-one-out forests.
"""

"""Networks of a user's own, shipped as examples (installed with the package): pass
``--network jobs.learners.networks.examples.digits:build`` (a CNN for 8x8 digits) or
``...examples.tables:build`` (an MLP with embeddings for a table's categorical columns) to
``obliviate model train`` or ``obliviate demo``, or copy one to start your own.
See docs/learners.md (Your own network)."""

"""Tooling to run the whole sidecar on one machine (`make demo`, tests, benchmarks): not
part of the Bento (bentofile.yaml excludes it). See docs/development.md."""

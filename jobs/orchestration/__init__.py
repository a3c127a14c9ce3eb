"""The sidecar's moving parts: the worker loop, the model registry and its store, the
guarded model a version serves, the guard job, retention, and the registry's checks.
See docs/sidecar.md (Worker)."""

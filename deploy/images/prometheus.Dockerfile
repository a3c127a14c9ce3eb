# Prometheus from Debian's package; its configuration and rules are mounted from
# deploy/prometheus/. See docs/operations.md (Images).
FROM obliviate-base:bookworm
RUN apt-get update && apt-get install -y prometheus && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["/usr/bin/prometheus"]

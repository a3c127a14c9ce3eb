#!/bin/sh
# `dockerd.sh start|stop`: a Docker daemon for `make images` / `make test-deploy` where
# none answers. What works in this sandbox: overlay2 storage, cgroupfs, no iptables and
# no default bridge (every container of the deployment uses the host's network).
# See docs/operations.md (Images).
set -eu
STATE=${DEPLOY_BUILD:-build/deploy}
mkdir -p "$STATE"
case "${1:-start}" in
start)
    command -v dockerd >/dev/null && command -v debootstrap >/dev/null \
        && command -v docker-compose >/dev/null || {
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            docker.io docker-compose debootstrap; }
    docker info >/dev/null 2>&1 && exit 0
    nohup dockerd --iptables=false --ip6tables=false --bridge=none \
        >"$STATE/dockerd.log" 2>&1 &
    echo $! >"$STATE/dockerd.pid"
    i=0
    until docker info >/dev/null 2>&1; do
        i=$((i + 1)); [ $i -lt 60 ] || { tail -20 "$STATE/dockerd.log" >&2; exit 1; }
        sleep 0.5
    done ;;
stop)
    [ -s "$STATE/dockerd.pid" ] || exit 0
    kill "$(cat "$STATE/dockerd.pid")" 2>/dev/null || true
    while kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null; do sleep 0.5; done
    rm -f "$STATE/dockerd.pid" ;;
esac

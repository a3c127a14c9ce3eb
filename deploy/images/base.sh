#!/bin/sh
# The base image every other image starts from: Debian bookworm (minbase) made by
# debootstrap from the Debian mirror apt is configured with here; no image registry.
# The root file system is cached as build/deploy/base.tar, so a re-run only imports it.
# See docs/operations.md (Images).
set -eu
NAME=${BASE_IMAGE:-obliviate-base:bookworm}
CACHE=${DEPLOY_BUILD:-build/deploy}
docker image inspect "$NAME" >/dev/null 2>&1 && exit 0
mkdir -p "$CACHE"
if [ ! -s "$CACHE/base.tar" ]; then
    # the first URIs:/deb line of apt's own sources names the mirror
    MIRROR=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p; s/^deb \(\[[^]]*\] \)\{0,1\}\([^ ]*\) .*/\2/p' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -v security | head -n1)
    ROOT="$CACHE/rootfs"
    rm -rf "$ROOT"
    debootstrap --variant=minbase bookworm "$ROOT" "$MIRROR"
    # no init system in a container: packages must not try to start their services
    printf '#!/bin/sh\nexit 101\n' > "$ROOT/usr/sbin/policy-rc.d"
    chmod +x "$ROOT/usr/sbin/policy-rc.d"
    printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
        > "$ROOT/etc/apt/apt.conf.d/90obliviate"
    chroot "$ROOT" apt-get clean
    rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin
    tar -C "$ROOT" -cf "$CACHE/base.tar.part" .
    mv "$CACHE/base.tar.part" "$CACHE/base.tar"
    rm -rf "$ROOT"
fi
docker import -c 'ENV LANG=C.UTF-8' "$CACHE/base.tar" "$NAME"

#!/usr/bin/env bash
# A Debian bookworm base image made from Debian's own packages (debootstrap), for machines that reach the Debian
# mirror but no image registry. Imports it into podman as localhost/edgeinfer-base:bookworm.
#   ops/container/make_base.sh [MIRROR]        (needs root, debootstrap, podman)
set -euo pipefail
MIRROR="${1:-http://deb.debian.org/debian}"
TAG="${BASE_TAG:-localhost/edgeinfer-base:bookworm}"
ROOT="$(mktemp -d /tmp/edgeinfer-rootfs.XXXXXX)"
trap 'rm -rf "$ROOT"' EXIT
debootstrap --variant=minbase --include=ca-certificates bookworm "$ROOT" "$MIRROR"
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/archives/*.deb
printf 'Types: deb\nURIs: %s\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
  "$MIRROR" > "$ROOT/etc/apt/sources.list.d/debian.sources"
tar -C "$ROOT" -c . | podman import --change 'CMD ["/bin/bash"]' - "$TAG"
echo "made $TAG"

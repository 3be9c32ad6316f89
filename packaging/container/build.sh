#!/usr/bin/env bash
# Build trioshed's image from the Containerfile at the repository's root (what `make image` runs).
#   packaging/container/build.sh          build $IMAGE
#   packaging/container/build.sh base     only make sure the base image is there
#   packaging/container/build.sh flags    print the flags this machine's engine needs to run a
#                                         container: its global flags, then each container's
# Environment:
#   ENGINE     podman (the default where installed) or docker
#   IMAGE      the tag to build (trioshed:latest)
#   BASE       the base image. Default: Debian's debian:bookworm-slim where a registry answers;
#              else localhost/trioshed-base:bookworm, made here once from Debian's packages with
#              mmdebstrap (Debian 12 minbase, the same packages as debian:bookworm-slim; ~40 s)
#   EXTRA_PACKAGES  Debian packages the image adds (mesa-vulkan-drivers: AMD and Intel GPUs)
#   CA_BUNDLE  a CA bundle the build's downloads must trust (a TLS-inspecting proxy), passed as a
#              build secret, never stored in a layer. Default: $SSL_CERT_FILE, else the system's.
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:-build}
ENGINE=${ENGINE:-$(command -v podman >/dev/null && echo podman || echo docker)}
IMAGE=${IMAGE:-trioshed:latest}
LOCAL_BASE=localhost/trioshed-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
say() { echo "[image] $*" >&2; }
command -v "$ENGINE" >/dev/null || { echo "no container engine: install podman (apt-get install podman buildah) or docker" >&2; exit 1; }

have_image() { "$ENGINE" image exists "$1" 2>/dev/null || "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

make_local_base() {
  # Debian 12 from Debian's own packages: minbase (essential + apt), no documentation or locales,
  # the security and updates suites configured, apt's lists left out (the Containerfile updates).
  command -v mmdebstrap >/dev/null || { echo "no registry answers and mmdebstrap is missing: apt-get install mmdebstrap, or set BASE" >&2; exit 1; }
  say "making $LOCAL_BASE from Debian's packages ($MIRROR, bookworm minbase)"
  local tar; tar=$(mktemp --suffix=.tar)
  mmdebstrap --quiet --variant=minbase --format=tar \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin "$1"/var/log/*' \
    bookworm "$tar" \
    "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
    "deb ${MIRROR%/debian}/debian-security bookworm-security main"
  "$ENGINE" import --quiet --change 'CMD ["/bin/bash"]' "$tar" "$LOCAL_BASE" >/dev/null
  rm -f "$tar"
}

choose_base() {
  if [ -n "${BASE:-}" ]; then echo "$BASE"; return; fi
  if have_image docker.io/library/debian:bookworm-slim; then echo docker.io/library/debian:bookworm-slim; return; fi
  if have_image "$LOCAL_BASE"; then echo "$LOCAL_BASE"; return; fi
  if timeout 60 "$ENGINE" pull -q docker.io/library/debian:bookworm-slim >/dev/null 2>&1; then
    echo docker.io/library/debian:bookworm-slim; return
  fi
  say "no registry answers: the base is made from Debian's packages instead"
  make_local_base
  echo "$LOCAL_BASE"
}

engine_flags() {
  # What a container needs to start on this machine, as two lines: the engine's global flags and
  # each container's (run and build). None where the engine's defaults work; on a host whose hard
  # limits are below what the engine asks for (podman: 1048576 open files) the host's own limits;
  # where crun cannot use the cgroups (v1 with a v2 hierarchy beside it) podman's runc. Tried in
  # that order with the base image, which is local by then.
  local base=$1 nofile nproc runtime limits
  nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
  [ "$nofile" = unlimited ] && nofile=1048576
  # a container needs few processes; asking for the host's hard limit can still be refused
  { [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
  for runtime in "" "--runtime runc"; do
    for limits in "" "--ulimit nofile=$nofile:$nofile --ulimit nproc=$nproc:$nproc"; do
      # shellcheck disable=SC2086
      if "$ENGINE" $runtime run --rm $limits "$base" true >/dev/null 2>&1; then
        printf '%s\n%s\n' "$runtime" "$limits"; return
      fi
    done
  done
  "$ENGINE" run --rm "$base" true || true
  echo "$ENGINE cannot start a container here (above: its error)" >&2
  exit 1
}

base=$(choose_base)
case $what in
  base) echo "$base"; exit 0 ;;
  flags) engine_flags "$base"; exit 0 ;;
  build) ;;
  *) echo "usage: packaging/container/build.sh [build|base|flags]" >&2; exit 2 ;;
esac

{ read -r runtime; read -r limits; } < <(engine_flags "$base")
secret=()
ca=${CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
[ -s "$ca" ] && secret=(--secret "id=ca,src=$ca")
say "building $IMAGE on $base with $ENGINE $runtime $limits"
# shellcheck disable=SC2086
"$ENGINE" build $runtime $limits "${secret[@]}" --build-arg "BASE=$base" --build-arg "EXTRA_PACKAGES=${EXTRA_PACKAGES:-}" -t "$IMAGE" -f Containerfile .
say "built $IMAGE: $("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"

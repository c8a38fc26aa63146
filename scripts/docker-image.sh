#!/usr/bin/env bash
# Build the container image leasecore:latest without pulling any base image.
#   scripts/docker-image.sh            build the release binary, then the image
#   IMAGE=leasecore:dev scripts/docker-image.sh   another tag
#
# The image is FROM scratch: the release binary, the shared libraries ldd says it links, the
# dynamic loader, and a minimal /etc (nsswitch.conf, passwd, group). No shell, no package manager;
# the healthcheck in docker-compose.yml uses the binary itself (`leasecore cluster status --ready`).
#
# Name resolution: peers are reached as http://nodeN:7001 through reqwest, which resolves names
# with glibc's getaddrinfo. getaddrinfo reads /etc/nsswitch.conf and loads the libnss_* modules
# it names. glibc >= 2.34 has the "files" and "dns" modules built into libc.so.6; older glibc
# dlopen()s libnss_files.so.2 / libnss_dns.so.2 (which ldd does not list). So we copy those two
# libraries (and whatever they link) when the host has them, and write "hosts: files dns" so that
# /etc/hosts and Docker's embedded DNS (/etc/resolv.conf -> 127.0.0.11; both files are mounted
# into every container by Docker) are consulted, in that order.
#
# Re-running is safe: the build context is a fresh temporary directory, removed on exit, and the
# tag is moved to the new image (the previous one is removed if nothing uses it).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-leasecore:latest}
say() { echo "==> $*"; }
die() { echo "error: $*" >&2; exit 1; }

# --- preconditions ---------------------------------------------------------------------------
command -v docker >/dev/null 2>&1 \
  || die "docker is not installed (https://docs.docker.com/engine/install/)"
if ! docker info >/dev/null 2>&1; then
  die "the Docker engine is not reachable: is the daemon running (systemctl start docker), and may this user use it (docker group)? 'docker info' says: $(docker info 2>&1 | tail -n 1)"
fi
command -v cargo >/dev/null 2>&1 || die "cargo is not installed: see https://rustup.rs"
command -v ldd >/dev/null 2>&1 || die "ldd is not installed (package libc-bin)"

# --- binary ----------------------------------------------------------------------------------
say "cargo build --release${CARGO_TARGET_DIR:+ (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)}"
cargo build --release --bin leasecore
# Ask cargo where the target directory is: honours CARGO_TARGET_DIR and .cargo/config alike.
target_dir=$(cargo metadata --format-version 1 --no-deps \
  | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[ -n "$target_dir" ] || die "could not find cargo's target directory"
bin="$target_dir/release/leasecore"
[ -x "$bin" ] || die "$bin was not built"
say "binary: $bin"

# --- root file system ------------------------------------------------------------------------
ctx=$(mktemp -d "${TMPDIR:-/tmp}/leasecore-image.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
root="$ctx/rootfs"
mkdir -p "$root/usr/local/bin" "$root/etc" "$root/data" "$root/tmp"
chmod 1777 "$root/tmp"
cp "$bin" "$root/usr/local/bin/leasecore"
strip "$root/usr/local/bin/leasecore" 2>/dev/null || true

# Copy a file to the same absolute path inside the image, following symlinks.
copy_in() {
  mkdir -p "$root$(dirname "$1")"
  cp -L "$1" "$root$1"
}
# Copy the libraries (and the loader) that ELF file $1 needs, as ldd lists them.
copy_deps() {
  local line path
  while IFS= read -r line; do
    case "$line" in
      *"=> not found"*) die "ldd $1: $line" ;;
      *"=> /"*) path=${line#*=> }; path=${path%% (*} ;;   # libc.so.6 => /lib/.../libc.so.6 (0x..)
      *" => "*) continue ;;                               # linux-vdso.so.1 => (0x..): in kernel
      *) path=$(echo "$line" | awk '{print $1}') ;;       # /lib64/ld-linux-x86-64.so.2 (0x..)
    esac
    case "$path" in /*) ;; *) continue ;; esac
    if [ ! -e "$root$path" ]; then
      echo "    $path"
      copy_in "$path"
    fi
  done < <(ldd "$1" 2>/dev/null || true)
}
if ! ldd "$bin" >/dev/null 2>&1; then
  say "the binary is statically linked: no libraries to copy"
else
  say "shared libraries (ldd $bin):"
  copy_deps "$bin"
  # NSS modules for getaddrinfo (see the top of this file): next to libc, when they exist.
  libc=$(ldd "$bin" | awk '$1 ~ /^libc\.so/ {print $3}')
  for mod in libnss_files.so.2 libnss_dns.so.2; do
    [ -n "$libc" ] && [ -e "$(dirname "$libc")/$mod" ] || continue
    echo "    $(dirname "$libc")/$mod (NSS module, loaded at run time)"
    copy_in "$(dirname "$libc")/$mod"
    copy_deps "$(dirname "$libc")/$mod"
  done
fi

cat >"$root/etc/nsswitch.conf" <<'EOF'
# Written by scripts/docker-image.sh: names come from /etc/hosts, then DNS (Docker's resolver).
hosts: files dns
EOF
echo "root:x:0:0:root:/:/usr/local/bin/leasecore" >"$root/etc/passwd"
echo "root:x:0:" >"$root/etc/group"

# NO_COLOR=1: plain log lines in `docker logs` (tracing-subscriber honours it).
cat >"$ctx/Dockerfile" <<'EOF'
FROM scratch
COPY rootfs/ /
ENV PATH=/usr/local/bin \
    NO_COLOR=1 \
    LEASECORE_LISTEN=0.0.0.0:7001 \
    LEASECORE_DATA=/data
VOLUME /data
EXPOSE 7001
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=5 \
  CMD ["/usr/local/bin/leasecore", "cluster", "status", "--ready", "--endpoints", "http://127.0.0.1:7001"]
ENTRYPOINT ["/usr/local/bin/leasecore"]
CMD ["serve"]
EOF

# --- image -----------------------------------------------------------------------------------
# Without the buildx plugin, recent docker CLIs still build with the classic builder if asked
# to (it prints a deprecation notice); that builder handles FROM scratch fine.
if ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
old=$(docker image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
say "docker build -t $IMAGE (context $ctx)"
docker build --quiet -t "$IMAGE" "$ctx" >/dev/null
new=$(docker image inspect --format '{{.Id}}' "$IMAGE")
if [ -n "$old" ] && [ "$old" != "$new" ]; then
  docker image rm "$old" >/dev/null 2>&1 && say "removed the previous image ${old#sha256:}" || true
fi

say "smoke test: docker run --rm $IMAGE --version"
docker run --rm --network none "$IMAGE" --version
size=$(docker image inspect --format '{{.Size}}' "$IMAGE")
say "built $IMAGE (${new#sha256:}), $((size / 1024 / 1024)) MiB"
say "start a 3-node cluster: docker compose up -d   (or: docker-compose up -d)"

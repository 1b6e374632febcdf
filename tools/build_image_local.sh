#!/usr/bin/env bash
# Build docker/Dockerfile without a Docker daemon and without Docker Hub: buildah (chroot
# isolation) on a base made here, then run three checks in the image. Run as root from anywhere;
# needs Debian's buildah, podman (for `podman import`) and debootstrap
# (apt-get install -y buildah podman debootstrap), network to a Debian mirror and PyPI, and about 40 GB of disk (overlay storage; more with vfs).
#
#   1. debootstrap a Debian bookworm minbase rootfs (python3 3.11, pip, g++, curl) and import it
#      as localhost/debian-bookworm-minbase
#   2. docker/base.Dockerfile on it -> localhost/sglang-local:v0.5.17-cu130, the stand-in for
#      lmsysorg/sglang:v0.5.17-cu130 (SGLang 0.5.17 and its pins from PyPI, CUDA 13.0 toolkit wheels)
#   3. docker/Dockerfile, unchanged, with --build-arg SGLANG_IMAGE=<that base> -> localhost/sparse-sglang:local
#   4. checks, in a buildah working container of the image (its user, env and ENTRYPOINT): the
#      entry point's --help (SGLang's and the --sparse-* flags, exit 0); on a GPU-less machine the
#      entry point with no arguments (one line naming --device, exit 2); test/test_config.py under
#      pytest (installed in the container) with the tree's tests mounted read-only
#
# Environment: STORAGE_DRIVER (overlay; vfs where overlay mounts are refused), WORK (scratch folder,
# /var/tmp/sparse-image), MIRROR, SKIP_BASE=1 to reuse existing base images.
# Where the host reaches PyPI through a TLS-intercepting proxy, its CA bundle is bind-mounted into
# the build's RUN steps (not copied into the image).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
D=${STORAGE_DRIVER:-overlay}
WORK=${WORK:-/var/tmp/sparse-image}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
DEBIAN_IMAGE=localhost/debian-bookworm-minbase
BASE_IMAGE=localhost/sglang-local:v0.5.17-cu130
IMAGE=localhost/sparse-sglang:local
BUILDAH=(buildah --storage-driver "$D")
PODMAN=(podman --storage-driver "$D")
CA=()
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && CA=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
mkdir -p "$WORK"
stamp() { date -u +%H:%M:%S; }

if [[ "${SKIP_BASE:-0}" != 1 ]]; then
    echo "[$(stamp)] 1. debootstrap bookworm minbase"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase \
        --include=python3,python3-pip,python3-venv,python3-dev,curl,ca-certificates,g++,git \
        bookworm "$WORK/rootfs" "$MIRROR" > "$WORK/debootstrap.log"
    rm -rf "$WORK"/rootfs/var/lib/apt/lists/* "$WORK"/rootfs/var/cache/apt/archives/*.deb
    tar -C "$WORK/rootfs" -c . | "${PODMAN[@]}" import \
        --change 'CMD ["/bin/bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$DEBIAN_IMAGE"

    echo "[$(stamp)] 2. base image (SGLang 0.5.17 from PyPI)"
    "${BUILDAH[@]}" bud --isolation chroot --layers=false --format docker "${CA[@]}" \
        -f docker/base.Dockerfile --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -t "$BASE_IMAGE" docker/
fi

echo "[$(stamp)] 3. docker/Dockerfile on $BASE_IMAGE"
"${BUILDAH[@]}" bud --isolation chroot --layers=false --format docker "${CA[@]}" \
    -f docker/Dockerfile --build-arg SGLANG_IMAGE="$BASE_IMAGE" -t "$IMAGE" .
"${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE" | tee "$WORK/image_bytes"
"${PODMAN[@]}" image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE"

# The checks run in a working container of the image under buildah's chroot isolation, with the
# image's own user, environment and ENTRYPOINT (podman run needs to set rlimits, which a host
# without CAP_SYS_RESOURCE refuses: "crun: setrlimit `RLIMIT_NPROC`: Operation not permitted").
CTR=$("${BUILDAH[@]}" from "$IMAGE")
trap '"${BUILDAH[@]}" rm "$CTR" > /dev/null' EXIT
mapfile -t ENTRY < <("${BUILDAH[@]}" inspect --type image "$IMAGE" \
    | python3 -c 'import json, sys; print(*json.load(sys.stdin)["OCIv1"]["config"]["Entrypoint"], sep="\n")')
(( ${#ENTRY[@]} )) || { echo "no ENTRYPOINT in $IMAGE" >&2; exit 1; }
fail() { echo "FAILED: $*" >&2; exit 1; }
RUN=("${BUILDAH[@]}" run --isolation chroot "${CA[@]}")

echo "[$(stamp)] 4a. entry point --help: ${ENTRY[*]} --help"
set +e
"${RUN[@]}" "$CTR" -- "${ENTRY[@]}" --help > "$WORK/help.txt" 2>&1
help_rc=$?
set -e
head -20 "$WORK/help.txt"
echo "help: exit $help_rc, $(grep -c -- '--sparse-' "$WORK/help.txt") lines naming --sparse-*"
[[ $help_rc == 0 ]] && grep -q -- '--model-path' "$WORK/help.txt" && grep -q -- '--sparse-token-budget' "$WORK/help.txt" \
    || fail "--help"

echo "[$(stamp)] 4b. entry point without a GPU"
set +e
"${RUN[@]}" "$CTR" -- "${ENTRY[@]}" > "$WORK/nogpu-raw.txt" 2>&1
nogpu_rc=$?
# buildah adds "subprocess exited with status 2" and "Error: exit status 2" of its own
grep -v -e '^subprocess exited with status' -e '^Error: exit status' "$WORK/nogpu-raw.txt" > "$WORK/nogpu.txt"
set -e
cat "$WORK/nogpu.txt"
echo "no GPU: exit $nogpu_rc"
[[ $nogpu_rc == 2 && $(wc -l < "$WORK/nogpu.txt") == 1 ]] && grep -q -- '--device' "$WORK/nogpu.txt" || fail "no-GPU error"

echo "[$(stamp)] 4c. test/test_config.py inside the image"
"${RUN[@]}" -v "$ROOT/test:/opt/sparse-sglang/test:ro" "$CTR" -- sh -c \
    'python3 -m pip install --user --no-cache-dir -q pytest && cd /opt/sparse-sglang && python3 -m pytest -q -p no:cacheprovider test/test_config.py' \
    2>&1 | tee "$WORK/cpu_test.txt"
[[ ${PIPESTATUS[0]} == 0 ]] || fail "test_config.py"
echo "[$(stamp)] done"

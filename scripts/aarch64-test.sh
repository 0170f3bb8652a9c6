#!/usr/bin/env bash
# Cross-compiles the encore-ops library tests for aarch64 and runs them under
# qemu twice: on a CPU with the dot-product extension (the tests then compare
# the scalar, NEON and NEON + SDOT kernels) and on a Cortex-A53, which lacks
# it (scalar and NEON). Also lints the crate for aarch64, where the NEON code
# is compiled. Installs qemu and the cross toolchain with apt-get when run as
# root and they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu

echo "== aarch64: toolchain"
if ! command -v qemu-aarch64-static >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null \
    || [ ! -d "$sysroot/lib" ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        apt-get install -y -qq qemu-user-static gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null
    else
        echo "needs qemu-user-static, gcc-aarch64-linux-gnu and libc6-dev-arm64-cross" \
            "(apt-get install as root)" >&2
        exit 1
    fi
fi
if ! rustup target list --installed | grep -qx "$target"; then
    rustup target add "$target"
fi
qemu-aarch64-static --version | head -1
aarch64-linux-gnu-gcc --version | head -1

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -L $sysroot"

echo "== aarch64: lint"
cargo clippy -p encore-ops --all-targets --target "$target" -- -D warnings

echo "== aarch64: build tests"
cargo test -p encore-ops --release --target "$target" --lib --no-run

summary=()
status=0
for cpu in max cortex-a53; do
    case $cpu in
        max) what="NEON with SDOT" ;;
        *) what="NEON without SDOT" ;;
    esac
    echo "== aarch64: tests on qemu -cpu $cpu ($what)"
    log=$(mktemp)
    if QEMU_CPU=$cpu cargo test -p encore-ops --release --target "$target" --lib 2>&1 | tee "$log"; then
        result=ok
    else
        result=FAILED
        status=1
    fi
    counts=$(grep -E '^test result:' "$log" | tail -1 | sed -E 's/^test result: [A-Za-z]+\. //; s/; finished.*//')
    summary+=("qemu -cpu $cpu ($what): $result, ${counts:-no test result}")
    rm -f "$log"
done

echo "== aarch64: summary"
printf '  %s\n' "${summary[@]}"
exit $status

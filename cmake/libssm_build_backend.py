"""PEP 517 build backend for libssm: scikit-build-core, plus the CUDA 13 compiler wheels as build
requirements when this machine has no CUDA compiler of its own.

scikit-build-core cannot make a build requirement depend on whether a program is installed, so this
wrapper adds nvidia-cuda-nvcc (with the CUDA runtime and CCCL/CUB it needs) only when neither $CUDACXX
nor an nvcc on PATH exists, nor a CMAKE_CUDA_COMPILER is passed, and CUDA is not switched off.
cmake/SsmCudaCompiler.cmake makes the same decision and then finds the wheel's nvcc.
"""

from __future__ import annotations

import os
import re
import shutil

import scikit_build_core.build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (re-exported PEP 517 hooks)
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
)

# nvcc 13.0 and 13.1 wheels point the linker at a lib64/ that the runtime wheel does not have; the
# runtime wheel holds libcudart_static.a, the CCCL wheel holds CUB. The <14 bounds keep all three on
# one CUDA major, which the library's kernels are written for.
CUDA_COMPILER_WHEELS = [
    "nvidia-cuda-nvcc>=13.2,<14",
    "nvidia-cuda-runtime>=13.2,<14",
    "nvidia-cuda-cccl>=13.0,<14",
]

_OFF = {"0", "off", "false", "no", "n", "f"}


def _setting_texts(config_settings, key):
    value = (config_settings or {}).get(key, [])
    return [value] if isinstance(value, str) else list(value)


def _cmake_define(config_settings, name):
    """The value given to a CMake variable through -C/--config-settings or SKBUILD_* variables."""
    for value in _setting_texts(config_settings, f"cmake.define.{name}"):
        return value
    defines = os.environ.get("SKBUILD_CMAKE_DEFINE", "")
    args = " ".join(_setting_texts(config_settings, "cmake.args") + [os.environ.get("SKBUILD_CMAKE_ARGS", "")])
    for text, pattern in ((defines, rf"(?:^|;)\s*{name}(?::\w+)?=([^;]*)"),
                          (args, rf"-D\s*{name}(?::\w+)?=(\S*)")):
        match = re.search(pattern, text)
        if match:
            return match.group(1)
    return None


def needs_cuda_compiler_wheels(config_settings=None) -> bool:
    enable = _cmake_define(config_settings, "SSM_ENABLE_CUDA")
    if enable is not None and enable.strip().lower() in _OFF:
        return False
    if _cmake_define(config_settings, "CMAKE_CUDA_COMPILER"):
        return False
    return not (os.environ.get("CUDACXX") or shutil.which("nvcc"))


def _with_compiler_wheels(requires, config_settings):
    if needs_cuda_compiler_wheels(config_settings):
        return [*requires, *CUDA_COMPILER_WHEELS]
    return list(requires)


def get_requires_for_build_wheel(config_settings=None):
    return _with_compiler_wheels(_skbuild.get_requires_for_build_wheel(config_settings), config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _with_compiler_wheels(_skbuild.get_requires_for_build_editable(config_settings), config_settings)


# scikit-build-core offers these only when the metadata can be known without running CMake.
for _hook in ("prepare_metadata_for_build_wheel", "prepare_metadata_for_build_editable"):
    if hasattr(_skbuild, _hook):
        globals()[_hook] = getattr(_skbuild, _hook)

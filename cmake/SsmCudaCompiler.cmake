# Chooses the nvcc that enable_language(CUDA) uses, before project() runs.
# Order: -DCMAKE_CUDA_COMPILER, then $CUDACXX, then an nvcc on PATH (all left to CMake itself), then the
# nvcc of the CUDA compiler wheels (nvidia-cuda-nvcc, installed into the build environment by
# build_backend.py when the first three are absent). The wheels need no find_package(CUDAToolkit), which
# fails on their layout: nvcc's own profile points the link at the wheel's lib/ with libcudart_static.a.

function(ssm_find_cuda_compiler)
  if(DEFINED CMAKE_CUDA_COMPILER OR DEFINED ENV{CUDACXX})
    return()
  endif()
  find_program(_ssm_path_nvcc nvcc NO_CACHE NO_CMAKE_PATH NO_CMAKE_ENVIRONMENT_PATH NO_CMAKE_SYSTEM_PATH
               NO_PACKAGE_ROOT_PATH)
  if(_ssm_path_nvcc)
    return()
  endif()

  # scikit-build-core passes the build environment's interpreter; a plain CMake run uses python3 on PATH.
  set(_python "${Python_EXECUTABLE}")
  if(NOT _python)
    set(_python "${Python3_EXECUTABLE}")
  endif()
  if(NOT _python)
    find_program(_python NAMES python3 python NO_CACHE)
  endif()
  set(_wheel_nvcc "")
  if(_python)
    # `nvidia` is a namespace package: every directory on its __path__ may hold a cuXX/bin/nvcc.
    execute_process(
      COMMAND "${_python}" -c
              "import glob, os, nvidia; print(';'.join(sorted((p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, 'cu*', 'bin', 'nvcc'))), reverse=True)))"
      OUTPUT_VARIABLE _candidates OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0 AND _candidates)
      list(GET _candidates 0 _wheel_nvcc)
    endif()
  endif()
  if(NOT _wheel_nvcc)
    message(FATAL_ERROR
      "libssm: no CUDA compiler found (no -DCMAKE_CUDA_COMPILER, no $CUDACXX, no nvcc on PATH, no "
      "nvidia-cuda-nvcc wheel importable by '${_python}'). Install a CUDA 13 toolkit, or "
      "`pip install \"nvidia-cuda-nvcc>=13.2\" nvidia-cuda-cccl`, or configure with -DSSM_ENABLE_CUDA=OFF "
      "for a CPU-only library.")
  endif()
  message(STATUS "libssm: using the CUDA compiler wheel's nvcc ${_wheel_nvcc}")
  set(CMAKE_CUDA_COMPILER "${_wheel_nvcc}" CACHE FILEPATH "CUDA compiler" FORCE)
endfunction()

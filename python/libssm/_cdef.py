"""Builds libssm's cffi declarations from the public C headers, so they are never a second copy
kept by hand. Pointer parameters of functions become uintptr_t: calls then take plain Python
ints (addresses), which costs ~0.8 us per call where casting each pointer would cost ~2.3 us."""

import os
import re

_REGION = re.compile(r"/\*\s*@cdef-begin\s*\*/(.*?)/\*\s*@cdef-end\s*\*/", re.S)
_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_FUNCTION = re.compile(r"SSM_API\s+([^;(]+?)\s*\b(\w+)\s*\(([^;]*?)\)\s*;", re.S)
_INCLUDE = re.compile(r'#include\s+"libssm/(\w+\.h)"')
_ABI_DEFINE = re.compile(r"#define\s+SSM_ABI_VERSION\s+(\d+)")

UMBRELLA = "ssm.h"


def header_dirs(package_paths, library_path=None):
    """Where the public headers may be, most trusted first: beside the library (an install
    prefix), inside the package (a wheel), then the source tree this package sits in."""
    dirs = []
    if library_path:
        dirs.append(os.path.join(os.path.dirname(os.path.abspath(library_path)), os.pardir,
                                 "include", "libssm"))
    for entry in package_paths:
        dirs.append(os.path.join(entry, "include", "libssm"))
        dirs.append(os.path.join(entry, os.pardir, os.pardir, "src_cuda", "include", "libssm"))
    return [os.path.normpath(d) for d in dirs]


def find_header_dir(package_paths, library_path=None):
    searched = header_dirs(package_paths, library_path)
    for d in searched:
        if os.path.isfile(os.path.join(d, UMBRELLA)):
            return d
    raise ImportError("libssm: cannot find the public headers (libssm/%s); searched: %s"
                      % (UMBRELLA, ", ".join(searched)))


def _pointer_params_to_uintptr(match):
    ret, name, params = match.group(1), match.group(2), match.group(3)
    out = []
    for param in params.split(","):
        param = " ".join(param.split())
        if "*" in param:
            pname = re.search(r"(\w+)\s*$", param).group(1)
            param = "uintptr_t " + pname
        out.append(param)
    return "%s %s(%s);" % (" ".join(ret.split()), name, ", ".join(out))


def cdef_from_text(text):
    """The cffi declarations held by one header's marked regions."""
    parts = []
    for region in _REGION.findall(text):
        region = _COMMENT.sub("", region)
        region = _FUNCTION.sub(_pointer_params_to_uintptr, region)
        parts.append(region.replace("SSM_API", ""))
    return "\n".join(parts)


def header_files(header_dir):
    """The headers the umbrella header includes, in its order."""
    with open(os.path.join(header_dir, UMBRELLA)) as f:
        names = _INCLUDE.findall(f.read())
    return [os.path.join(header_dir, n) for n in names]


def build_cdef(header_dir):
    """(cdef text, SSM_ABI_VERSION of the headers)."""
    texts, abi = [], None
    for path in header_files(header_dir):
        with open(path) as f:
            text = f.read()
        m = _ABI_DEFINE.search(text)
        if m:
            abi = int(m.group(1))
        texts.append(cdef_from_text(text))
    return "\n".join(texts), abi

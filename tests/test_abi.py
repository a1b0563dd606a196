"""The shared object's ABI: SONAME, exported symbols, symbol versions, NEEDED libraries and versions.

The library checked is the one `import libssm` loads. Exported symbols must equal the committed list
tests/abi/exported_symbols.txt exactly, so any change to the ABI is a deliberate edit of that file.
The ELF file is read by a small parser here, so the checks need no binutils; nm, when present (under
CI it must be), is used to cross-check the parser.
"""

import ctypes
import os
import re
import struct
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SYMBOL_LIST = os.path.join(HERE, "abi", "exported_symbols.txt")
VERSION_NODE = "LIBSSM_0"

# What the library may link dynamically: the C/C++ runtime and the OpenMP runtime of the CPU path
# (auditwheel grafts a copy into the wheel as libgomp-<hash>.so.1.0.0). The CUDA runtime is linked
# statically and the driver is opened at run time, so neither may appear.
ALLOWED_NEEDED = re.compile(
    r"^(libstdc\+\+\.so\.6|libgcc_s\.so\.1|libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|"
    r"librt\.so\.1|ld-linux-x86-64\.so\.2|ld-linux-aarch64\.so\.1|"
    r"libgomp(-[0-9a-f]+)?\.so\.1(\.[0-9]+)*)$")


def library_path():
    import libssm

    return libssm.library_path()


def dev_build():
    """True when LIBSSM_LIBRARY points at a library outside an installed package (a developer's
    own build), whose packaging facts (version node, relocated files) this suite cannot assume."""
    return bool(os.environ.get("LIBSSM_LIBRARY"))


class Elf:
    """The parts of an ELF64 little-endian shared object that make up its ABI."""

    SHT_DYNAMIC, SHT_DYNSYM, SHT_VERDEF, SHT_VERSYM = 6, 11, 0x6FFFFFFD, 0x6FFFFFFF
    DT_NEEDED, DT_SONAME, DT_RPATH, DT_RUNPATH = 1, 14, 15, 29
    SHN_UNDEF, SHN_ABS = 0, 0xFFF1

    def __init__(self, path):
        with open(path, "rb") as f:
            self.data = f.read()
        if self.data[:4] != b"\x7fELF" or self.data[4] != 2 or self.data[5] != 1:
            raise ValueError("%s: not a little-endian ELF64 file" % path)
        shoff, = struct.unpack_from("<Q", self.data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", self.data, 0x3A)
        self.sections = [struct.unpack_from("<IIQQQQIIQQ", self.data, shoff + i * shentsize)
                         for i in range(shnum)]

    def _of_type(self, sh_type):
        return [s for s in self.sections if s[1] == sh_type]

    def _string(self, strtab_index, offset):
        base = self.sections[strtab_index][4]
        end = self.data.index(b"\0", base + offset)
        return self.data[base + offset:end].decode()

    def dynamic(self):
        """[(tag, value)] of .dynamic, string values resolved."""
        sec, = self._of_type(self.SHT_DYNAMIC)
        out = []
        for off in range(sec[4], sec[4] + sec[5], 16):
            tag, val = struct.unpack_from("<qQ", self.data, off)
            if tag == 0:
                break
            if tag in (self.DT_NEEDED, self.DT_SONAME, self.DT_RPATH, self.DT_RUNPATH):
                val = self._string(sec[6], val)
            out.append((tag, val))
        return out

    def soname(self):
        names = [v for t, v in self.dynamic() if t == self.DT_SONAME]
        return names[0] if names else None

    def needed(self):
        return [v for t, v in self.dynamic() if t == self.DT_NEEDED]

    def runpaths(self):
        return [v for t, v in self.dynamic() if t in (self.DT_RPATH, self.DT_RUNPATH)]

    def version_definitions(self):
        """{index: name} of the versions this object defines (its version nodes and its own name)."""
        out = {}
        for sec in self._of_type(self.SHT_VERDEF):
            off = sec[4]
            for _ in range(sec[7]):  # sh_info: number of entries
                _, _, ndx, cnt, _, aux, nxt = struct.unpack_from("<HHHHIII", self.data, off)
                if cnt:
                    name_off, = struct.unpack_from("<I", self.data, off + aux)
                    out[ndx] = self._string(sec[6], name_off)
                off += nxt
        return out

    def exported_symbols(self):
        """{name: version or None} of the defined global/weak default-visibility dynamic symbols,
        leaving out the absolute symbols the linker makes for version nodes."""
        dynsym, = self._of_type(self.SHT_DYNSYM)
        versym = self._of_type(self.SHT_VERSYM)
        versions = self.version_definitions()
        count = dynsym[5] // 24
        out = {}
        for i in range(count):
            name_off, info, other, shndx, _, _ = struct.unpack_from("<IBBHQQ", self.data,
                                                                    dynsym[4] + 24 * i)
            bind, visibility = info >> 4, other & 3
            if shndx == self.SHN_UNDEF or bind not in (1, 2) or visibility not in (0, 3):
                continue
            name = self._string(dynsym[6], name_off)
            if shndx == self.SHN_ABS and name in versions.values():
                continue
            version = None
            if versym:
                ndx, = struct.unpack_from("<H", self.data, versym[0][4] + 2 * i)
                version = versions.get(ndx & 0x7FFF)
            out[name] = version
        return out


@pytest.fixture(scope="module")
def elf():
    return Elf(library_path())


@pytest.fixture(scope="module")
def clib():
    lib = ctypes.CDLL(library_path())
    lib.ssm_version.restype = ctypes.c_char_p
    lib.ssm_abi_version.restype = ctypes.c_int
    return lib


def committed_symbols():
    with open(SYMBOL_LIST) as f:
        return sorted(line.strip() for line in f if line.strip() and not line.startswith("#"))


def header_functions():
    """Every function the public headers declare with SSM_API (the shipped copies when installed)."""
    include = os.path.join(os.path.dirname(os.path.dirname(library_path())), "include", "libssm")
    if not os.path.isdir(include):
        include = os.path.join(REPO, "src_cuda", "include", "libssm")
    names = set()
    for header in sorted(os.listdir(include)):
        if header.endswith(".h"):
            with open(os.path.join(include, header)) as f:
                names.update(re.findall(r"\bSSM_API\b[^;(]*?\b(ssm_\w+)\s*\(", f.read()))
    return sorted(names)


def package_version():
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        return re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)


def test_soname_is_libssm_so_abi(elf, clib):
    assert elf.soname() == "libssm.so.%d" % clib.ssm_abi_version()
    assert elf.soname() == "libssm.so.0"
    assert os.path.basename(library_path()) == elf.soname()


def test_exported_symbols_equal_committed_list(elf):
    exported = sorted(elf.exported_symbols())
    if not elf.version_definitions() and dev_build():
        # Without the version script, libstdc++'s template instantiations leak out as weak symbols
        # (namespace std has default visibility); only the CMake build's exact list is the ABI.
        exported = [name for name in exported if name.startswith("ssm_")]
    assert exported == committed_symbols()


def test_committed_list_equals_header_declarations():
    assert committed_symbols() == header_functions()


def test_every_export_carries_the_version_node(elf):
    versions = set(elf.exported_symbols().values())
    if versions == {None} and dev_build():
        pytest.skip("LIBSSM_LIBRARY is a build without the linker version script")
    assert versions == {VERSION_NODE}
    assert VERSION_NODE in elf.version_definitions().values()


def test_needed_libraries_are_only_system_runtimes(elf):
    unexpected = [n for n in elf.needed() if not ALLOWED_NEEDED.match(n)]
    assert unexpected == [], "NEEDED entries beyond the C/C++ runtime: %s" % unexpected
    assert not any("cudart" in n or n.startswith("libcuda.") for n in elf.needed())


def test_no_rpath_outside_the_package(elf):
    for path in elf.runpaths():
        assert all(p.startswith("$ORIGIN") for p in path.split(":")), path


def test_parser_agrees_with_nm(elf, require_tools):
    require_tools("nm")
    out = subprocess.run(["nm", "-D", "--defined-only", library_path()], check=True,
                         capture_output=True, text=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] != "A" and parts[1].isupper():
            names.add(parts[2].split("@")[0])
    assert names == set(elf.exported_symbols())


def test_abi_version_is_zero_and_matches_soname(elf, clib):
    import libssm

    assert clib.ssm_abi_version() == 0
    assert libssm.abi_version() == clib.ssm_abi_version()
    assert elf.soname().rsplit(".", 1)[1] == str(clib.ssm_abi_version())


def test_version_string_matches_package(clib):
    import libssm

    version = clib.ssm_version().decode()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert version == libssm.__version__ == libssm.version()
    assert version == package_version()

"""Command line: `python -m libssm check` checks the installed library on every device."""

import sys

USAGE = """usage: python -m libssm check

  check   print the library's path, version, ABI version and CUDA devices, then check every
          op on every device against its reference; exits nonzero on any failure"""


def main(argv):
    if argv == ["check"]:
        from . import _check
        return _check.main()
    print(USAGE, file=sys.stderr if argv not in (["-h"], ["--help"]) else sys.stdout)
    return 0 if argv in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

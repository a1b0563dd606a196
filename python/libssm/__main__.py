"""Command line: `python -m libssm check` checks the installed library on every device;
`python -m libssm demo` trains a small Mamba LM with libssm's kernels and generates with it."""

import os
import sys

USAGE = """usage: python -m libssm check
       python -m libssm demo [options]   (python -m libssm demo --help lists them)

  check   print the library's path, version, ABI version and CUDA devices, then check every
          op on every device against its reference; exits nonzero on any failure
  demo    train a small Mamba language model on selective copying (on the GPU if there is
          one), generate through the decode path, and report accuracy, step times and
          tokens/s against a pure-PyTorch reference of the same model"""


def main(argv):
    if argv == ["check"]:
        from . import _check
        return _check.main()
    if argv[:1] == ["demo"]:
        # OpenMP threads that spin while waiting starve each other when the cores are shared:
        # on the 2-core development machine with other work running, alternating runs of the
        # CPU demo took 670-715 ms a training step with OpenMP's default wait policy and
        # 100-120 ms with passive waiting. It must be set before torch loads OpenMP; a value
        # already in the environment wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        from . import _demo
        return _demo.main(argv[1:])
    print(USAGE, file=sys.stderr if argv not in (["-h"], ["--help"]) else sys.stdout)
    return 0 if argv in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

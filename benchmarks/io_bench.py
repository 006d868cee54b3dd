"""The I/O benchmark as a script: same as `offload bench io` (see --help)."""

import sys

from offload.cli.bench_io import main, run_io_bench  # noqa: F401  (importable API)

if __name__ == "__main__":
    sys.exit(main())

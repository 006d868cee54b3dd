"""The store benchmark as a script: same as `offload bench store` (see --help)."""

import sys

from offload.cli.bench_store import main, run_store_bench  # noqa: F401  (importable API)

if __name__ == "__main__":
    sys.exit(main())

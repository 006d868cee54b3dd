"""The training-step benchmark as a script: same as `offload bench step` (see --help)."""

import sys

from offload.cli.bench_step import main, run_step_bench  # noqa: F401  (importable API)

if __name__ == "__main__":
    sys.exit(main())

"""The CPU Adam benchmark as a script: same as `offload bench adam` (see --help)."""

import sys

from offload.cli.bench_adam import main, run_adam_bench  # noqa: F401  (importable API)

if __name__ == "__main__":
    sys.exit(main())

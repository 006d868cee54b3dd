"""The oversized-model benchmark as a script: same as `offload bench oversized` (see --help).

The full run (about 3B parameters on a 24 GiB machine, ~55 GB of swap) takes a
while; check it works first with a small model:

    python benchmarks/oversized.py --params 200M
"""

import sys

from offload.cli.bench_oversized import main, run_oversized  # noqa: F401  (importable API)

if __name__ == "__main__":
    sys.exit(main())

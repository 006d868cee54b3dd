#!/usr/bin/env bash
# GPU checks, for a machine with a CUDA device and the project's dependencies in
# its Python: the `gpu` tests (the engine and the store computing on the GPU), the
# demo on the GPU, a short `offload bench step` on cuda, then the I/O and store
# suites with CUDA visible (the I/O suite's buffer pools pinned; the store suite
# fixes store.device = "cpu", whose pools are not pinned, apart from its gpu
# tests; the rest of the default suite fixes store.device = "cpu" and runs as on
# a machine without a GPU, in
# about 9 minutes, more than one check's time). Logs and the benchmark's JSON go
# to directory $1.
#
#   scripts/gpu-check.sh gpu-check-out
set -uo pipefail
out=${1:-gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
rc=0
step() {  # step NAME SECONDS CMD...: runs CMD under a time limit, logs to $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local r=$?
    tail -n 25 "$out/$name.txt"
    echo "== $name: exit $r"
    [ $r -eq 0 ] || rc=1
}
step env 60 "$py" -c "import torch, offload.io as io; print('torch', torch.__version__, \
'cuda', torch.cuda.is_available() and torch.cuda.get_device_name()); print(io.libaio_status())"
step gpu-tests 180 "$py" -m pytest -m gpu -q -rs -p no:cacheprovider tests
step demo 90 "$py" -m offload.cli.main demo --steps 30 --swap-dir /tmp/offload-gpu-check --trace "$out/demo.trace.json"
step bench-step 150 "$py" -m offload.cli.main bench step --device cuda --system offload \
    --rounds 1 --warmup 1 --steps 3 --path /tmp/offload-gpu-check --json
step pinned 240 "$py" -m pytest -q -x -p no:cacheprovider tests/io tests/store
exit $rc

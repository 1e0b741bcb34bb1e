#!/usr/bin/env bash
# The GPU test suite, then the benchmark, from the repository root.
#   bash benchmarks/run_all.sh [extra arguments of python -m benchmarks run]
# Environment: SHARDS (parallel pytest processes, default 14: the suite's time is mostly
# single-threaded kernel compiles; 0 skips the tests), LOGS (folder of the logs, default out/).
# FLA comes from an installed fla-core, else from a fla_core-*.whl under .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${LOGS:-out}
SHARDS=${SHARDS:-14}
mkdir -p "$LOGS"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
GPUS=$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')
pids=()
for ((i = 0; i < SHARDS; i++)); do
    # -v: one line a test as it ends, so that a shard cut short still says which tests passed.
    CUDA_VISIBLE_DEVICES=$((i % GPUS)) python3 -m pytest -v -p no:cacheprovider --shard "$i/$SHARDS" tests \
        > "$LOGS/pytest.$i.log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
if ((SHARDS > 0)); then
    cat "$LOGS"/pytest.*.log > "$LOGS/pytest.log" && rm "$LOGS"/pytest.*.log
    echo "tests: $(grep -c ' PASSED' "$LOGS/pytest.log") passed, $(grep -c ' SKIPPED' "$LOGS/pytest.log")" \
        "skipped, $(grep -cE ' (FAILED|ERROR)' "$LOGS/pytest.log") failed"
fi
python3 -m benchmarks run --warm-fla "$@"

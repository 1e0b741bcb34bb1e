#!/usr/bin/env bash
# Everything a GPU session needs in one device call: the test suite on CUDA and the benchmark.
#   bash benchmarks/gpu_session.sh        (writes to $OUT, default out/)
#
# Phase 1: the test suite in SHARDS parallel pytest processes (default 14; its time is mostly
# single-threaded kernel compiles), alone: on a 2-GPU, 32-core host, 20 shards side by side with
# FLA's warm-ups left 8 shards unfinished after 170 s; alone, 14 shards took ~200 s on the
# 16-core host at an earlier suite; with 322 tests (eleventh session) 12 of 14 finished in
# 168-291 s and two were cut at 300 s (their tests, re-run as four shards of 28 alone, took
# 66-99 s each): give one GPU ~360 s, or a call of its own.
# Phase 2, when FLA is there: one benchmarks/warm_fla.py process per FLA tuning case, so that
# FLA's autotuner (60-100 s per head count, run one after another inside bench.py) runs side by
# side; its picks are cached on disk for phase 3. These processes share
# the GPUs, so FLA's autotuner times its candidates on a busy GPU (its picks may differ from an
# idle one's).
# Phase 3: bench.py, each GPU timing its own parts on an otherwise idle GPU.
# FLA's backward tuning is slower: at d2504fa eight backward warm-ups side by side had not finished
# after 170 s, and bench.py's forward + backward part then ran out of its 160 s; a second call on
# the same machine (FLA's picks on disk) timed it in 32 s. Give the backward warm-ups ~300 s, or a
# call of their own.
# Environment: SHARDS, TEST_SECONDS / WARM_SECONDS / BENCH_SECONDS (limits; 0 skips that phase:
# a session can run tests and warm-ups in one call and the benchmark in a second on the same
# machine, where FLA's picks are still on disk), WARM_BACKWARD=0 (no FLA backward warm-up: pair it with BENCH_ARGS=--fla-forward-only),
# BENCH_ARGS (extra bench.py arguments), PARTS0 / PARTS1 (bench parts per GPU with two GPUs; with one GPU, PARTS0 alone, default all). At most 8 files come back from a device (9 with fla_autotune.tgz: keep the tests and the warm-ups in separate calls)
# call: pytest.log, warm.log, bench.<gpu>.log, results.<gpu>.md, gpu.txt, the plot.
# FLA comes from a carried wheel when .whl/ holds one (see benchmarks/FLA_NOTES.md).
# FLA's autotuner picks travel too: after the warm-ups the script packs Triton's cached picks
# (*.autotune.json) into $OUT/fla_autotune.tgz; put that file in .fla_cache/ (git-ignored) and
# carry it, and a fresh machine unpacks it first, so FLA times with those picks and no warm-up
# (Triton keys each file by its version, the GPU target, the kernel source and the tuning key).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
FLA=0
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} && FLA=1
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
SHARDS=${SHARDS:-14}
CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -f .fla_cache/fla_autotune.tgz ]; then
    mkdir -p "$CACHE" && tar -xzf .fla_cache/fla_autotune.tgz -C "$CACHE" \
        && echo "FLA autotune picks unpacked: $(tar -tzf .fla_cache/fla_autotune.tgz | wc -l) files"
fi
start=$(date +%s)

pids=()
if [ "${TEST_SECONDS:-300}" != 0 ]; then
    for i in $(seq 0 $((SHARDS - 1))); do
        # -v: a line a test as it ends, so that a shard cut by the timeout still says which of
        # its tests passed (with -q a cut shard left nothing: twenty-third session, call 1).
        CUDA_VISIBLE_DEVICES=$((i % GPUS)) timeout "${TEST_SECONDS:-300}" python3 -m pytest -v \
            -p no:cacheprovider --durations=3 --shard "$i/$SHARDS" tests > "$OUT/pytest.$i.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
    pids=()
    echo "tests: $(( $(date +%s) - start )) s"
fi
if [ "$FLA" = 1 ] && [ "${WARM_SECONDS:-300}" != 0 ]; then
    i=0
    kinds="fwd gate_fwd"
    [ "${WARM_BACKWARD:-1}" = 1 ] && kinds="$kinds fwdbwd gate_fwdbwd"
    for kind in $kinds; do
        for shape in 8,4096,16 1,32768,32 1,8192,96 varlen; do
            CUDA_VISIBLE_DEVICES=$((i % GPUS)) timeout "${WARM_SECONDS:-300}" \
                python3 benchmarks/warm_fla.py "$kind:$shape" > "$OUT/warm.$i.log" 2>&1 &
            pids+=($!); i=$((i + 1))
        done
    done
fi
for p in "${pids[@]}"; do wait "$p"; done
echo "tests and FLA warm-up: $(( $(date +%s) - start )) s"
if [ "$FLA" = 1 ] && [ "${WARM_SECONDS:-300}" != 0 ]; then
    (cd "$CACHE" && find . -name '*.autotune.json' | tar -czf "$OUT/fla_autotune.tgz" -T -) \
        && echo "FLA autotune picks packed: $(tar -tzf "$OUT/fla_autotune.tgz" | wc -l) files"
fi
if compgen -G "$OUT/pytest.*.log" > /dev/null; then
    cat "$OUT"/pytest.*.log > "$OUT/pytest.log" && rm "$OUT"/pytest.*.log
    grep -hE "(passed|failed).* in [0-9.]+s|^(FAILED|ERROR)|Timeout|Terminated" "$OUT/pytest.log"
    echo "tests: $(grep -c ' PASSED' "$OUT/pytest.log") passed, $(grep -c ' SKIPPED' "$OUT/pytest.log") skipped," \
        "$(grep -cE ' (FAILED|ERROR)' "$OUT/pytest.log") failed (per-test lines, cut shards included);" \
        "$(grep -cE '(passed|failed).* in [0-9.]+s' "$OUT/pytest.log") of $SHARDS shards finished"
fi
if compgen -G "$OUT/warm.*.log" > /dev/null; then
    cat "$OUT"/warm.*.log > "$OUT/warm.log" && rm "$OUT"/warm.*.log
    grep -h "^warm" "$OUT/warm.log"
fi

if [ "${BENCH_SECONDS:-300}" = 0 ]; then
    echo "total: $(( $(date +%s) - start )) s"
    exit 0
fi
ALL=fwd,gate_fwd,fwdbwd,gate_fwdbwd,profile,gate_profile,decode,throughput
if [ "$GPUS" -ge 2 ]; then
    PARTS=(${PARTS0:-fwd,gate_fwd,decode} ${PARTS1:-profile,gate_profile,throughput,fwdbwd,gate_fwdbwd})
else
    PARTS=(${PARTS0:-$ALL})
fi
pids=()
for g in "${!PARTS[@]}"; do
    mkdir -p "$OUT/b$g"
    CUDA_VISIBLE_DEVICES=$g timeout "${BENCH_SECONDS:-300}" python3 benchmarks/bench.py --out "$OUT/b$g" \
        --parts "${PARTS[$g]}" ${BENCH_ARGS:-} > "$OUT/bench.$g.log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for g in "${!PARTS[@]}"; do
    [ -f "$OUT/b$g/results.md" ] && mv "$OUT/b$g/results.md" "$OUT/results.$g.md"
    [ -f "$OUT/b$g/forward_throughput.png" ] && mv "$OUT/b$g/forward_throughput.png" "$OUT/"
    rmdir "$OUT/b$g" 2>/dev/null
    cat "$OUT/bench.$g.log" | grep -v -i warn
done
echo "total: $(( $(date +%s) - start )) s"

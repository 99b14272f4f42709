#!/usr/bin/env bash
# The GPU benchmarks in one run, for a lent GPU box with no package index (docs/PERFORMANCE.md,
# "GPU figures"): the Publisher on the device in both value modes, an engine's update pause on the
# device against reloading the checkpoint, the codec benchmark on that box's CPUs, and the swarm
# benchmark at the emulator's default rates with 16 and more rollout daemons (a 2-core VM runs 16
# only at a quarter of them; the box has 16 cores).
#
#   bench/gpu.sh                      # on the GPU box, from the repository's root
#   DEVICE=cpu PUBLISH_MIB=256 APPLY_MIB=256 CODEC=0 bench/gpu.sh   # a dry run anywhere
#   APPLY=0 CODEC=0 bench/gpu.sh     # the Publisher alone
#   VALUES=ulp APPLY=0 CODEC=0 OUT=/tmp/base bench/gpu.sh   # one value mode (a baseline tree, say)
#   VALUES= APPLY=0 CODEC=0 SWARM="4:2:0.25:2" bench/gpu.sh  # one small swarm run, no GPU
#
# SWARM is a list of NODES:REGIONS:PATCH_MIB:VERSIONS runs of `sparrowd bench swarm --no-star`
# (empty: none), each with SWARM_ARGS too (e.g. "--keep --log-level debug" for the daemons' logs);
# their figures are packed into swarm.tar.gz with their logs (a lent box returns at most 8 files).
# BASELINE=DIR alternates each swarm run with the same run on another tree of sparrowd (its
# C extension built there too), so that a change is measured against the code before it on the
# same box in the same call (a tree that has the command as sparrowd/cli/; older trees kept it
# in a top-level cli/ and are not run by this script):
#   git archive HEAD~1 | (mkdir -p .base && tar -x -C .base)   # .base ignored, carried with .whl
#   BASELINE=.base VALUES= APPLY=0 CODEC=0 bench/gpu.sh
#
# sparrowd's dependencies that the box lacks come as wheels in .whl/, downloaded here for its
# Python (3.12 in 2026-11) and carried with the call:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     zstandard blake3 cryptography cffi pycparser
# the C extension is built in place there; logs and JSON figures go to $OUT.
set -u
OUT=${OUT:-/tmp/sparrowd-gpu}
DEVICE=${DEVICE:-cuda}
PUBLISH_MIB=${PUBLISH_MIB:-4096}
APPLY_MIB=${APPLY_MIB:-16384}
VALUES=${VALUES-ulp ulp2}
APPLY=${APPLY:-1}
CODEC=${CODEC:-1}
SWARM_ARGS=${SWARM_ARGS:-}
BASELINE=${BASELINE:-}
SWARM=${SWARM-16:4:0.25:3 16:4:2:3 16:4:6:3 16:8:0.25:3 16:4:0.25:3 16:4:2:3 16:4:6:3 16:8:0.25:3 16:4:64:2 32:4:0.25:3 32:4:6:3 32:8:2:3}
PY=${PYTHON:-python3}
case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the baseline builds elsewhere
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sparrowd-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/sparrowd-site${PYTHONPATH:+:$PYTHONPATH}
fi
# sparrowd without an install: the daemons are started as `python -m sparrowd.cli.main` from the
# tree on PYTHONPATH.
base_path=${PYTHONPATH:-}  # the wheels, for a baseline tree too
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    echo "the C extension did not build (see build.log): the codec runs its numpy path"
fi
trees=this
if [ -n "$BASELINE" ]; then
    BASELINE=$(cd "$BASELINE" && pwd) || exit 1
    (cd "$BASELINE" && "$PY" setup.py -q build_ext --inplace >"$OUT/build-baseline.log" 2>&1) ||
        echo "the baseline's C extension did not build (see build-baseline.log)"
    trees="this baseline"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null
    "$PY" -c "import os, sys, torch; from sparrowd.codec import bits; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'cpus', os.cpu_count(), 'native', bits._native is not None)"
} 2>&1 | tee "$OUT/gpu.log"

bench() {  # NAME SECONDS ARGS...: one benchmark, its output in gpu.log, its figures in NAME.json
    local name=$1 limit=$2
    shift 2
    echo "== sparrowd bench $* ($(date -u +%H:%M:%S))" | tee -a "$OUT/gpu.log"
    timeout "$limit" "$PY" -m sparrowd.cli.main bench "$@" --json "$OUT/$name.json" 2>&1 | tee -a "$OUT/gpu.log"
}
for values in $VALUES; do
    bench "publish-$values" 150 publish --device "$DEVICE" --size-mib "$PUBLISH_MIB" --steps 3 --values "$values"
done
if [ "$APPLY" = 1 ]; then
    bench apply 240 apply --engine torch --device "$DEVICE" --size-mib "$APPLY_MIB" --steps 3
fi
if [ "$CODEC" = 1 ]; then
    bench codec 120 codec
fi
if [ -n "$SWARM" ]; then
    if "$PY" -c "import socket; s = socket.socket(); s.bind(('127.11.0.1', 0))" 2>/dev/null; then
        mkdir -p "$OUT/swarm"
        n=0
        for run in $SWARM; do
            IFS=: read -r nodes regions patch versions <<<"$run"
            for tree in $trees; do
                n=$((n + 1))
                name=$n-$nodes-$regions-$patch
                path=$PYTHONPATH
                if [ "$tree" = baseline ]; then
                    name=$name-baseline
                    path=$BASELINE${base_path:+:$base_path}
                fi
                echo "== sparrowd bench swarm $run, $tree tree ($(date -u +%H:%M:%S))" | tee -a "$OUT/gpu.log"
                mkdir -p "$OUT/swarm/$name"  # where --keep leaves the daemons' folders
                TMPDIR=$OUT/swarm/$name PYTHONPATH=$path timeout 240 "$PY" -m sparrowd.cli.main bench swarm --no-star \
                    --nodes "$nodes" --regions "$regions" --patch-mib "$patch" --versions "$versions" \
                    --json "$OUT/swarm/$name.json" $SWARM_ARGS 2>&1 |
                    tee "$OUT/swarm/$name.log" | grep -E "version|time to all|upload|cross-region bytes" | tee -a "$OUT/gpu.log"
            done
        done
        (cd "$OUT" && find swarm -name "*.log" -o -name "*.json" | tar -czf swarm.tar.gz -T -) && rm -rf "$OUT/swarm"
    else
        echo "== no swarm runs: this box cannot bind 127.11.0.1 (the emulator's region addresses)" | tee -a "$OUT/gpu.log"
    fi
fi
echo "== done ($(date -u +%H:%M:%S))" | tee -a "$OUT/gpu.log"

#!/usr/bin/env bash
# The GPU benchmarks in one run, for a lent GPU box with no package index (docs/PERFORMANCE.md,
# "GPU figures"): the Publisher on the device in both value modes, an engine's update pause on the
# device against reloading the checkpoint, and the codec benchmark on that box's CPUs.
#
#   bench/gpu.sh                      # on the GPU box, from the repository's root
#   DEVICE=cpu PUBLISH_MIB=256 APPLY_MIB=256 CODEC=0 bench/gpu.sh   # a dry run anywhere
#   APPLY=0 CODEC=0 bench/gpu.sh     # the Publisher alone
#   VALUES=ulp APPLY=0 CODEC=0 OUT=/tmp/base bench/gpu.sh   # one value mode (a baseline tree, say)
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
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sparrowd-site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/sparrowd-site${PYTHONPATH:+:$PYTHONPATH}
fi
# The CLI's package (cli/ installs as sparrowd_cli) without an install: the daemons are started
# as `python -m sparrowd_cli.main`.
mkdir -p /tmp/sparrowd-path && ln -sfn "$PWD/cli" /tmp/sparrowd-path/sparrowd_cli
export PYTHONPATH=$PWD:/tmp/sparrowd-path${PYTHONPATH:+:$PYTHONPATH}
if ! "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    echo "the C extension did not build (see build.log): the codec runs its numpy path"
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
    timeout "$limit" "$PY" -m sparrowd_cli.main bench "$@" --json "$OUT/$name.json" 2>&1 | tee -a "$OUT/gpu.log"
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
echo "== done ($(date -u +%H:%M:%S))" | tee -a "$OUT/gpu.log"

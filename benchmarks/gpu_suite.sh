#!/usr/bin/env bash
# The GPU checklist in one device call: the whole `cuda` test suite in four parallel processes
# (one H200 holds them all), each writing its log under $OUT. Used as
#   bash benchmarks/gpu_suite.sh            (OUT defaults to ./gpu_out)
# after installing the carried wheels (benchmarks/results/README.md). Exit status: non-zero when
# any process failed; the logs say which tests.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
# Unbuffered, so a log killed by the timeout still shows how far it got; a hang dumps tracebacks;
# four threads each, so the four processes do not oversubscribe the host's cores.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
C="timeout ${SUITE_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m cuda -rf --durations=5 -o faulthandler_timeout=${HANG_S:-150}"
$C tests/capture/test_replay_step.py -k "network and not heads" > "$OUT/suite_a.log" 2>&1 & a=$!
$C tests/capture/test_replay_step.py -k "heads" > "$OUT/suite_b.log" 2>&1 & b=$!
$C tests/capture/test_replay_step.py -k "not network" > "$OUT/suite_c.log" 2>&1 & c=$!
# the inductor compile tests take minutes of compiling: their own run (COMPILE_TESTS=1), not suite d
$C tests --ignore tests/capture/test_replay_step.py --ignore tests/capture/test_replay_compile.py \
  --deselect tests/data/test_builtin.py::test_reference_trainer_learns_the_shapes > "$OUT/suite_d.log" 2>&1; d=$?
if [ "${COMPILE_TESTS:-0}" = 1 ]; then
  $C tests/capture/test_replay_compile.py > "$OUT/suite_e.log" 2>&1 || d=1
fi
rc=$d
for p in $a $b $c; do wait $p || rc=1; done
for f in "$OUT"/suite_?.log; do printf '%s: %s\n' "$f" "$(tail -n 1 "$f")"; done
exit $rc

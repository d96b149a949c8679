#!/usr/bin/env bash
# The GPU checklist in one device call: the whole `cuda` test suite in four parallel processes
# (one H200 holds them all), each writing its log under $OUT. Used as
#   bash benchmarks/gpu_suite.sh            (OUT defaults to ./gpu_out)
# after installing the carried wheels (benchmarks/results/README.md). Exit status: non-zero when
# any process failed; the logs say which tests.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
C="timeout ${SUITE_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m cuda -rf"
$C tests/capture/test_replay_step.py -k "network and not heads" > "$OUT/suite_a.log" 2>&1 & a=$!
$C tests/capture/test_replay_step.py -k "heads" > "$OUT/suite_b.log" 2>&1 & b=$!
$C tests/capture/test_replay_step.py -k "not network" > "$OUT/suite_c.log" 2>&1 & c=$!
$C tests --deselect tests/capture/test_replay_step.py --ignore tests/capture/test_replay_step.py > "$OUT/suite_d.log" 2>&1; d=$?
rc=$d
for p in $a $b $c; do wait $p || rc=1; done
for f in "$OUT"/suite_?.log; do printf '%s: %s\n' "$f" "$(tail -n 1 "$f")"; done
exit $rc

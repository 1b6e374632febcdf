#!/usr/bin/env bash
# One poll of a running burst (tools/gpu_host_burst.sh), in a call of its own: wait until its
# stages are done, a result file (JSON) is written, or $1 seconds (default 540) have passed, then
# pack everything $BURST_OUT (/root/o) holds so far into $OUT, so that a machine taken back mid-run
# (its 30-minute hold, or sooner by the lender) loses at most one poll's interval, and a run's
# record comes back within seconds of its writing. The pack keeps results, job logs and the
# serving servers' logs (a run whose JSON was never written still has its decode throughput in
# them: benchmark/server_log.py); not profiler traces, plots or the accuracy grid's server logs.
# Packs over 15 MiB come back in pieces (a call returns files of at most 16 MiB):
# `cat o.tgz.* | tar xz`. A machine with no burst (the lender swapped it between calls: the call
# reports warm false) fails at once, rather than waiting out the interval on an empty host.
#   bash tools/gpu_host_poll.sh 540
set -u
wait_s=${1:-540} out=${BURST_OUT:-/root/o} tick=${POLL_TICK_S:-5}  # (as gpu_host_stages.sh's)
[ -f "$out/stage.log" ] || { echo "no burst on this machine ($out/stage.log missing): park the parts and start it again" >&2; exit 3; }
results() { find "$out" -maxdepth 1 -name '*.json' -printf '%p %T@\n' 2>/dev/null | sort; }
before=$(results)
for _ in $(seq $((wait_s / tick))); do
  grep -q " done" "$out/stage.log" 2>/dev/null && break
  [ "$(results)" != "$before" ] && { echo "a result was written"; break; }
  sleep "$tick"
done
date +%T
tail -4 "$out/stage.log"
tar czf "$out.tgz" -C "$(dirname "$out")" --exclude='*.png' --exclude='*.trace.json.gz' --exclude='acc*/*.server.log' "$(basename "$out")"
split -b 15M -d "$out.tgz" "$OUT/o.tgz."
ls -la "$OUT"

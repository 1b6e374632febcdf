#!/usr/bin/env bash
# One poll of the detached jobs tools/gpu_host_burst.sh started: wait until their stages are done,
# a result file (JSON) is written, or $1 seconds (default 540) have passed, then pack everything
# $BURST_OUT (/root/o) holds so far into $OUT, so that a run's record is collected within seconds of
# its writing and a host lost mid-run loses at most one poll's interval. The pack keeps results, job
# logs and the serving servers' logs (a run whose JSON was never written still has its decode
# throughput in them: benchmark/server_log.py); not profiler traces, plots or the accuracy grid's
# server logs. It comes in pieces of at most 15 MiB: `cat o.tgz.* | tar xz`. On a host where no
# jobs were started (a fresh one) it fails at once, rather than waiting out the interval.
#   bash tools/gpu_host_poll.sh 540
set -u
wait_s=${1:-540} out=${BURST_OUT:-/root/o} tick=${POLL_TICK_S:-5}  # (as gpu_host_stages.sh's)
[ -f "$out/stage.log" ] || { echo "no burst on this machine ($out/stage.log missing): install the bundle and start the jobs again" >&2; exit 3; }
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

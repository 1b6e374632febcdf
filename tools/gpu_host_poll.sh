#!/usr/bin/env bash
# One poll of a running burst (tools/gpu_host_burst.sh), in a call of its own: wait until its
# stages are done or $1 seconds (default 540) have passed, then pack everything /root/o holds so
# far into $OUT, so that a machine taken back mid-run (its 30-minute hold, or the lender's) loses
# at most one poll's interval. The pack keeps results, job logs and the serving servers' logs (a
# run whose JSON was never written still has its decode throughput in them:
# benchmark/server_log.py); not profiler traces, plots or the accuracy grid's server logs. Packs
# over 15 MiB come back in pieces (a call returns files of at most 16 MiB):
# `cat o.tgz.* | tar xz`.
#   bash tools/gpu_host_poll.sh 540
set -u
wait_s=${1:-540}
for _ in $(seq $((wait_s / 5))); do
  grep -q " done" /root/o/stage.log 2>/dev/null && break
  sleep 5
done
date +%T
tail -4 /root/o/stage.log
tar czf /root/o.tgz -C /root --exclude='*.png' --exclude='*.trace.json.gz' --exclude='acc*/*.server.log' o
split -b 15M -d /root/o.tgz "$OUT/o.tgz."
ls -la "$OUT"

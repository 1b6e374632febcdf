# The stage runner of tools/gpu_host_burst.sh (it sources this file and defines the job_*
# functions). $JOBS: stages separated by commas, each stage's jobs separated by spaces; a stage's jobs
# run side by side, the next stage starts when they have all ended. A job is a chain a+b@GPUS (a,
# then b, on GPUS: "2/3" = GPUs 2 and 3); a job named a:v runs job_a with $JOB_VARIANT=v (the jobs
# that take variants say what v selects), its log in a-v.log. $STAGE_LIMITS: seconds per stage, in
# the same order ("300,": the first stage at most 300 s, the second unlimited); at its limit a
# stage's jobs, and every process they started (servers in their own sessions included), are
# stopped, so a stage that runs long cannot eat the time of the timed stage after it. $BURST_OUT:
# where logs go (default /root/o); host-cpu.log there samples the host's load all along.

run_job_chain() {  # one job of a stage
  local job=$1 chain=${1%@*} out=${BURST_OUT:-/root/o} names name variant
  if [ "$chain" != "$job" ]; then gpus=${job#*@}; export CUDA_VISIBLE_DEVICES=${gpus//\//,}; fi
  IFS='+' read -ra names <<< "$chain"
  for name in "${names[@]}"; do
    variant=
    if [[ $name == *:* ]]; then variant=${name#*:} name=${name%%:*}; fi
    echo "$(date +%T) job: $name${variant:+:$variant}${CUDA_VISIBLE_DEVICES:+ on GPUs $CUDA_VISIBLE_DEVICES}" >> "$out/stage.log"
    JOB_VARIANT=$variant "job_$name" > "$out/$name${variant:+-$variant}.log" 2>&1
  done
}

descendants() {  # every process below $1 (servers start in sessions of their own: not its group)
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$child"; descendants "$child"; done
}

stop_trees() {  # jobs $@ and every process below them: TERM, then KILL what is left $STOP_GRACE_S (15) s later
  local pid tree=()
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && tree+=("$pid" $(descendants "$pid")); done
  [ ${#tree[@]} -eq 0 ] && return 1
  kill -TERM "${tree[@]}" 2>/dev/null
  sleep "${STOP_GRACE_S:-15}"
  kill -KILL "${tree[@]}" 2>/dev/null
  return 0
}

sample_host_cpu() {
  # until killed: every 20 s the host's load and busiest processes (top's second 5 s sample), into
  # $1: jobs share the host's cores with the servers' own threads and their single-threaded HTTP
  # processes, so a run's host-side limits show here (docs/results.md, Parallelism, reads them)
  while true; do
    { date +%T; cat /proc/loadavg; top -b -c -o %CPU -n 2 -d 5 -w 200 | awk '/^top -/ {n++} n == 2' | head -24; } >> "$1" 2>&1
    sleep 15
  done
}

run_stages() {
  local out=${BURST_OUT:-/root/o} stages limits i stage limit job pids watchdog
  IFS=',' read -ra stages <<< "$JOBS"
  IFS=',' read -ra limits <<< "${STAGE_LIMITS:-}"
  sample_host_cpu "$out/host-cpu.log" &
  local sampler=$!
  for i in "${!stages[@]}"; do
    stage=${stages[$i]} limit=${limits[$i]:-} pids=()
    echo "$(date +%T) stage: $stage${limit:+ (at most $limit s)}" >> "$out/stage.log"
    for job in $stage; do
      bash -c 'run_job_chain "$1"' _ "$job" &
      pids+=($!)
    done
    if [ -n "$limit" ]; then
      rm -f "$out/.stage-limit-$i"
      (sleep "$limit"; touch "$out/.stage-limit-$i"
       stop_trees "${pids[@]}" && echo "$(date +%T) stage limit: stopped" >> "$out/stage.log") &
      watchdog=$!
    fi
    wait "${pids[@]}"
    if [ -n "$limit" ]; then  # past the limit: the watchdog's KILL round ends before the next stage
      [ -e "$out/.stage-limit-$i" ] || kill "$watchdog" 2>/dev/null
      wait "$watchdog" 2>/dev/null
    fi
  done
  kill "$sampler"
  echo "$(date +%T) done" >> "$out/stage.log"
}

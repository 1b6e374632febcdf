#!/usr/bin/env bash
# Start benchmark jobs detached on a GPU host with no network, once the offline bundle is installed
# (tools/README.md): copy the tree to /root/repo (the copy it runs from may be replaced while the
# jobs run), build the native kernels, then run $JOBS detached. $JOBS is stages separated by
# commas, each stage jobs separated by spaces: a stage's jobs run side by side, and a stage starts
# when the one before it has ended (so a timing job can have the machine to itself; on a two-GPU
# host "tests@0 grid@1" gives each job one GPU, on a four-GPU one "serving_pair@0/1
# tests+serving_tp@2/3" runs two chains of two-GPU jobs side by side). Results gather in /root/o;
# collect them with `bash tools/gpu_host_poll.sh` while they run; /root/o/stage.log says which
# stage runs. $STAGE_LIMITS bounds stages ("300,": the first at most 300 s, its jobs and their
# servers stopped there, so the timed stage after it keeps its share): tools/gpu_host_stages.sh.
#   SPARSE_SGLANG_COMMIT=<commit> JOBS="pin,startup,soak fuzz" bash tools/gpu_host_burst.sh
# Write <commit> out (your checkout's `git rev-parse --short HEAD`): the host's copy of the tree
# may carry no git data, or other git data than this checkout's.
# Jobs: grid (the accuracy grid; carry .accuracy, the suite's items; $GRID_SPARSE_ARGS: flags for
# its sparse servers; $GRID_VARIANTS: several sets of them side by side; $GRID_CONFIGS: accuracy.py
# grid --configs, more configurations in the same grid; $GRID_VANILLA_CONFIGS: --vanilla-configs, plain SGLang
# under other flags, e.g. densefp8=--kv-cache-dtype fp8_e4m3), decode_bounds (the default page bounds'
# decode step against min/max, bf16 and fp8), attention (decode_kernels at a loaded server's batch, fp8 and bf16, then fp8 with XQA), decode_rerank (the same with --sparse-rerank-factor 2), kernels (the Triton kernel tests and the decode GPU
# tests), tiles (the quantized re-rank's launches by tile), answers (decode_bounds, then kernels beside grid), decode (benchmark/decode.py, quest and sketch; $DECODE_ARGS: more of its
# flags), tests ($GPU_TESTS), fuzz,
# soak (the full 32-layer model, the fuzzer's bad requests mixed in), pin (the pinning probe and
# its GPU test), startup (warm-up starts, then vanilla and sparse cold starts, a 92 GiB host store),
# dp (the two-GPU data-parallel test; its first decode compiles FlashInfer's kernels: minutes),
# tp (the two-GPU tensor-parallel tests),
# serving (benchmark/serving.py, vanilla then sparse, long generation at 2 and long prompt at 0.8 req/s),
# serving_pair (the same on two GPUs of one host, the systems side by side; $PAIR_TRACES, e.g.
# "long-generation 2.0": fewer traces; $SERVING_VARIANTS: several sparse configurations, a GPU each),
# ($SERVING_WINDOW: the serving jobs' window in seconds, default 400; $SERVING_PROFILE_STEPS: profile
# that many forward steps of each loaded server at its window's end, benchmark/server_log.py --trace)
# serving_tp2 (TP=2 sparse and vanilla: side by side on four GPUs), parallel (the summary, after
# serving_tp2, tp and dp; $TP1_JSON: the sparse TP=1 run), serving_tp1 (sparse TP=1 alone),
# serving_tp2_sparse (sparse TP=2 alone, beside sparse TP=1 or after a vanilla run), serving_tp (both, with
# sparse TP=1 between, on two GPUs; $TP_SPARSE_EXTRA: more sparse flags for these, apart from
# the single-GPU headline's; $TP_VARIANTS: sparse configurations these jobs take by name, as in
# serving_tp1:graphs; $TP_WINDOW: their window, 600 s unless set, so that the counted second half spans
# several sparse TP=2 request lifetimes: docs/results.md, Parallelism). On four GPUs, the whole
# TP record in one start:
#   JOBS="serving_tp2@0/1/2/3,serving_pair@0/1 tp+dp@2/3,parallel" PAIR_TRACES="long-generation 2.0" TP1_JSON=/root/o/serving.json
set -x
rm -rf /root/repo && cp -r . /root/repo && cd /root/repo && mkdir -p /root/o
export PYTHONPATH=/tmp/site:/root/repo/python:/root/repo SPARSE_SGLANG_DEFAULT_GGUF=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \
  PYTHONUNBUFFERED=1 SPARSE_SGLANG_RESULTS_DIR=/root/o
echo "export PYTHONPATH=$PYTHONPATH SPARSE_SGLANG_DEFAULT_GGUF=$SPARSE_SGLANG_DEFAULT_GGUF PYTHONUNBUFFERED=1 SPARSE_SGLANG_RESULTS_DIR=/root/o SPARSE_SGLANG_COMMIT=$SPARSE_SGLANG_COMMIT" > /root/env.sh
# FlashInfer modules built ahead on a CPU machine (tools/flashinfer_aot.py; carry .gpu-carry/aot):
# loaded instead of compiled on first use
for d in .gpu-carry/aot/*/; do [ -d "$d" ] && mkdir -p "/tmp/site/flashinfer/data/aot/$(basename "$d")" && cp "$d"*.so "$_"; done
python3 -m sgl_kernels_ext.build > /root/o/build.log 2>&1 || { tail -30 /root/o/build.log; exit 1; }
python3 -c "from sparse_sglang.default_model import default_model_path; print(default_model_path())"

# The serving headline's sparse flags besides its batch: fp8 KV at the calibrated scales (SGLang
# reads a file's scales per TP rank: one file per TP size) and selections reused for 8 steps
SCALES_TP1=benchmark/kv-scales-llama3-8b-dummy.json
SCALES_TP2=benchmark/kv-scales-llama3-8b-dummy-tp2.json
HEADLINE_KV="--kv-cache-dtype fp8_e4m3 --sparse-reselect-interval 8 --quantization-param-path"  # + the scales file

job_grid() {
  # the default model's key basis first, once (grid servers with --sparse-selector sketch read it)
  if [[ "${GRID_SPARSE_ARGS:-} ${GRID_VARIANTS:-} ${GRID_CONFIGS:-}" == *sketch* ]]; then
    python3 -m sparse_sglang.calibrate --model-path "$(python3 -c 'from sparse_sglang.default_model import default_model_path as d; print(d())')"
  fi
  # $GRID_VARIANTS ("name=flags;name=flags"): the grid once per variant, side by side on the job's
  # GPU, its sparse servers with $GRID_SPARSE_ARGS and the variant's flags, into acc-<name> (acc
  # unnamed); unset: one unnamed variant. A job of several GPUs (grid@0/1) shares each variant's
  # runs between them, a grid process per GPU (accuracy.py grid --shard).
  local variants variant name devices i
  IFS=';' read -ra variants <<< "${GRID_VARIANTS:-=}"
  IFS=',' read -ra devices <<< "${CUDA_VISIBLE_DEVICES:-0}"
  for variant in "${variants[@]}"; do
    name=${variant%%=*}
    for i in "${!devices[@]}"; do
      CUDA_VISIBLE_DEVICES=${devices[$i]} python3 -m benchmark.accuracy grid --items .accuracy/items.json.gz \
        --out-dir "/root/o/acc${name:+-$name}" --shard "$i/${#devices[@]}" --parallel "${GRID_PARALLEL:-9}" --stagger "${GRID_STAGGER:-15}" \
        --sparse-args "${GRID_SPARSE_ARGS:-} ${variant#*=}" ${GRID_CONFIGS:+--configs "$GRID_CONFIGS"} \
        ${GRID_VANILLA_CONFIGS:+--vanilla-configs "$GRID_VANILLA_CONFIGS"} ${GRID_ARGS:-} &
    done
  done
  wait
}
job_decode() {  # the decode step, 8B shape: today's default selector and the sketch selector
  for selector in quest sketch; do
    python3 -m benchmark.decode --contexts ${DECODE_CONTEXTS:-131072} --batches ${DECODE_BATCHES:-32} \
      --selector "$selector" --out-dir /root/o ${DECODE_ARGS:-}
  done
}
job_decode_bounds() {  # the default page bounds' decode step against quest's min/max, each cell side by side
  local kv  # $DECODE_KVS: the KV dtypes timed (default both)
  for kv in ${DECODE_KVS:-bf16 fp8_e4m3}; do
    python3 -m benchmark.decode --cells "${DECODE_CELLS:-131072x32,32768x8}" --versus-minmax --kv-dtype "$kv" \
      --miss-fracs 0.1 --out-dir /root/o ${DECODE_ARGS:-}
  done
}
job_decode_rerank() {  # the default with the exact re-rank of twice the candidates against quest's min/max, each KV dtype
  local kv
  for kv in bf16 fp8_e4m3; do
    python3 -m benchmark.decode --cells "${DECODE_CELLS:-131072x32,32768x8}" --kv-dtype "$kv" --page-bounds minmax \
      --miss-fracs 0.1 --out-dir /root/o ${DECODE_ARGS:-}
    python3 -m benchmark.decode --cells "${DECODE_CELLS:-131072x32,32768x8}" --kv-dtype "$kv" --rerank-factor 2 --kernels \
      --miss-fracs 0.1 --out-dir /root/o ${DECODE_ARGS:-}
  done
}
job_kernels() {  # the Triton kernels against their references (compiled here), then the decode GPU tests
  python3 -m pytest -q -p no:cacheprovider test/test_mem_cache_kernels.py test/test_page_bounds.py test/test_selectors.py test/test_rerank.py test/test_sketch_rerank.py test/test_key_codes.py test/test_code_rerank.py \
    > /root/o/kernels.log 2>&1
  python3 -m pytest -m gpu -q -s -p no:cacheprovider ${KERNEL_GPU_TESTS:-test/test_sparse_decode_gpu.py test/test_selection_real_kv_gpu.py} \
    >> /root/o/kernels.log 2>&1
  tail -n 5 /root/o/kernels.log
}
job_attention() {  # the attention over the selected pages at a loaded server's batch, each KV dtype, the GPU alone
  local kv xqa
  for kv in ${ATTENTION_KVS:-fp8_e4m3 bf16 fp8_e4m3-xqa}; do  # $ATTENTION_KVS: fewer of them
    xqa=; [[ $kv == *-xqa ]] && xqa=--xqa  # XQA beside FlashInfer's kernels, a run of its own
    python3 -m benchmark.decode_kernels --contexts 32768 --batches 32 80 --kv-dtype "${kv%-xqa}" --block-n 32 --warps 4 \
      --programs 2048 $xqa --out-dir /root/o > "/root/o/attention-$kv.log" 2>&1
    mv /root/o/decode-kernels-*.json "/root/o/attention-$kv.json" 2>/dev/null
  done
  tail -n 4 /root/o/attention-*.log
}
job_tiles() {  # the quantized re-rank's launches by tile (benchmark.probes.code_rerank_tiles), the GPU alone
  python3 -m benchmark.probes.code_rerank_tiles --out /root/o/code-rerank-tiles.json > /root/o/tiles.log 2>&1
  tail -n 20 /root/o/tiles.log
}
job_answers() {  # the decode step timed alone on the job's GPU, then the kernel tests beside the accuracy grid
  job_decode_bounds
  job_kernels &
  job_grid
  wait
}
job_tests() {  # $GPU_TESTS: groups of pytest arguments separated by "|", the groups run side by side
  # (shell words: a group may quote, -k "not smollm2"); $TESTS_GPUS, e.g. "0 1": group i on the
  # i-th of those GPUs, round robin; unset: all on the job's GPUs
  local i=0 group
  IFS='|' read -ra groups <<< "${GPU_TESTS:-test/test_selection_real_kv_gpu.py}"
  read -ra gpus <<< "${TESTS_GPUS:-}"
  for group in "${groups[@]}"; do
    if [ ${#gpus[@]} -gt 0 ]; then
      eval "CUDA_VISIBLE_DEVICES=${gpus[$((i % ${#gpus[@]}))]} python3 -m pytest -m gpu -q -s $group" > "/root/o/tests-$i.log" 2>&1 &
    else
      eval "python3 -m pytest -m gpu -q -s $group" > "/root/o/tests-$i.log" 2>&1 &
    fi
    i=$((i + 1))
  done
  wait
  tail -n 3 /root/o/tests-*.log
}
job_dp() { python3 -m pytest -m gpu -q -s test/test_dp_gpu.py; }  # a two-GPU host
# the same ($TP_TEST_ARGS, e.g. -k rounding_cannot; $SPARSE_SGLANG_TP_PROMPT_SEED: held-out prompts)
job_tp() { eval "python3 -m pytest -m gpu -q -s test/test_tp_gpu.py ${TP_TEST_ARGS:-}"; }
job_fuzz() {
  python3 -m benchmark.fuzz --launch --requests "${FUZZ_REQUESTS:-5000}" --extra-server-args \
    "--sparse-host-cache-gb 4 --mem-fraction-static 0.1" --out-dir /root/o --log-dir /root/o/fuzz-logs
}
job_soak() {
  python3 -m benchmark.soak --requests "${SOAK_REQUESTS:-300}" --rate 1.5 --host-cache-gb 24 --burst 20 \
    --request-timeout 240 --crashers "${SOAK_CRASHERS:-500}" --extra-server-args "--cuda-graph-max-bs-decode 64" \
    --out-dir /root/o --log-dir /root/o/soak-logs
}
job_pin() {
  python3 -m benchmark.probes.pin_rate --gib 8 --out /root/o/pin-rate.json
  python3 -m pytest -m gpu -q -s test/test_pinned_store.py
}
job_startup() {
  # warm-up starts (untimed, less GPU memory: jobs beside them may hold some) compile FlashInfer's modules
  python3 -m benchmark.startup --sparse-host-cache-gb 92 --repeats "${STARTUP_REPEATS:-1}" --warmup \
    --warmup-args "--mem-fraction-static 0.5" --vanilla-args "--attention-backend flashinfer" \
    --out-dir /root/o --log-dir /root/o/startup-logs
}

job_serving() {
  # the serving headline: vanilla with the sparse server's KV dtype in the same GPU bytes, then
  # sparse, 400 s windows, both traces at their saturated rate ($SERVING_SPARSE_EXTRA: more sparse flags)
  local sparse="--cuda-graph-max-bs-decode 96 $HEADLINE_KV $SCALES_TP1 ${SERVING_SPARSE_EXTRA:-}"
  local common=(--sparse-host-cache-gb 92 --vanilla-server-args "--cuda-graph-max-bs-decode 64" --sparse-server-args "$sparse"
    --out-dir /root/o --log-dir /root/o/serving-logs --merge-into "/root/o/${SERVING_FILE:-serving}.json")
  python3 -m benchmark.serving --systems "${SERVING_SYSTEMS:-vanilla,sparse}" --traces long-generation --rates-long-generation 2.0 "${common[@]}"
  python3 -m benchmark.serving --systems "${SERVING_SYSTEMS:-vanilla,sparse}" --traces long-prompt --rates-long-prompt 0.8 "${common[@]}"
}

job_serving_pair() {
  # the same on two or more GPUs, side by side (the same card type, one host): per trace, vanilla
  # on the job's first GPU and a sparse server on each next one, each into its own file, then one
  # file per sparse variant against that vanilla run. $SERVING_VARIANTS: "name=flags;name=flags"
  # (flags added to the headline's; unset: one variant with $SERVING_SPARSE_EXTRA, into
  # serving.json), one GPU each: on a four-GPU host, three configurations against one vanilla in
  # the same windows (files serving-<name>.json, server logs in serving-logs/<name>/). More
  # variants than GPUs beside vanilla's run in rounds, each round beside a vanilla run of its own
  # (serving-vanilla-r<round>.json): on two GPUs "default=;paced=<flags>" is two pairs in turn.
  # PAIR_VANILLA=0: no vanilla server, a sparse variant on every GPU (two configurations in the same
  # windows, to be combined later with a vanilla run of the same session: serving.py --combine).
  local base="--cuda-graph-max-bs-decode 96 $HEADLINE_KV $SCALES_TP1"
  local common=(--sparse-host-cache-gb 92 --vanilla-server-args "--cuda-graph-max-bs-decode 64"
    --max-seconds-per-rate "${SERVING_WINDOW:-400}" --profile-steps "${SERVING_PROFILE_STEPS:-0}" --out-dir /root/o)
  local trace rate gpu devices variants variant name flags tag per_round rounds round i
  IFS=',' read -ra devices <<< "${CUDA_VISIBLE_DEVICES:-0,1}"  # the job's GPUs
  IFS=';' read -ra variants <<< "${SERVING_VARIANTS:-=${SERVING_SPARSE_EXTRA:-}}"  # one unnamed variant by default
  local with_vanilla=${PAIR_VANILLA:-1} first_sparse=1
  [ "$with_vanilla" = 0 ] && first_sparse=0
  per_round=$((${#devices[@]} - first_sparse))
  if [ "$per_round" -lt 1 ]; then
    echo "serving_pair: vanilla and a sparse server need two GPUs, the job has ${#devices[@]}"; return 1
  fi
  rounds=$(((${#variants[@]} + per_round - 1) / per_round))
  vanilla_file() { if [ "$rounds" -gt 1 ]; then echo "/root/o/serving-vanilla-r$1.json"; else echo /root/o/serving-vanilla.json; fi; }
  IFS=',' read -ra pairs <<< "${PAIR_TRACES:-long-generation 2.0,long-prompt 0.8}"
  for trace in "${pairs[@]}"; do
    read -r trace rate <<< "$trace"
    for ((round = 0; round < rounds; round++)); do
      # vanilla takes the sparse servers' KV dtype and scales from --sparse-server-args
      [ "$with_vanilla" = 0 ] || CUDA_VISIBLE_DEVICES=${devices[0]} python3 -m benchmark.serving --systems vanilla --traces "$trace" "--rates-$trace" "$rate" \
        "${common[@]}" --sparse-server-args "$base" --log-dir /root/o/serving-logs --merge-into "$(vanilla_file "$round")" \
        > "/root/o/serving-vanilla-$trace-r$round.log" 2>&1 &
      gpu=$first_sparse
      for variant in "${variants[@]:$((round * per_round)):$per_round}"; do
        name=${variant%%=*}; flags=${variant#*=}; tag=sparse${name:+-$name}
        CUDA_VISIBLE_DEVICES=${devices[$gpu]} python3 -m benchmark.serving --systems sparse --traces "$trace" "--rates-$trace" "$rate" \
          "${common[@]}" --sparse-server-args "$base $flags" --log-dir "/root/o/serving-logs${name:+/$name}" \
          --merge-into "/root/o/serving-$tag.json" > "/root/o/serving-$tag-$trace.log" 2>&1 &
        gpu=$((gpu + 1))
      done
      wait
    done
  done
  [ "$with_vanilla" = 0 ] && return 0
  for i in "${!variants[@]}"; do
    name=${variants[$i]%%=*}; tag=sparse${name:+-$name}
    python3 -m benchmark.serving --combine "/root/o/${SERVING_FILE:-serving}${name:+-$name}.json" \
      "$(vanilla_file $((i / per_round)))" "/root/o/serving-$tag.json"
  done
  # variants named default and quest: the default's ratio over quest's (summary ratio_vs_quest_default)
  local f=/root/o/${SERVING_FILE:-serving}
  if [ -f "$f-default.json" ] && [ -f "$f-quest.json" ]; then
    python3 -m benchmark.serving --versus-quest "$f-vs-quest.json" "$f-default.json" "$f-quest.json"
  fi
}

# The TP serving jobs take a variant (serving_tp2:graphs@0/1/2/3): $TP_VARIANTS ("name=flags;name=flags")
# gives its sparse flags (added to $TP_SPARSE_EXTRA), and its name goes into the job's files
# (serving-tp2-graphs.json), so one start measures several sparse configurations at TP=2 and TP=1
tp_variant_flags() {
  local variants variant
  [ -z "${JOB_VARIANT:-}" ] && return 0
  IFS=';' read -ra variants <<< "${TP_VARIANTS:-}"
  for variant in "${variants[@]}"; do
    if [ "${variant%%=*}" = "$JOB_VARIANT" ]; then echo "${variant#*=}"; return 0; fi
  done
  echo "variant $JOB_VARIANT is not in \$TP_VARIANTS (\"${TP_VARIANTS:-}\")" >&2
  return 1
}
job_serving_tp2() {
  # TP=2 serving, long generation: sparse against vanilla with the same KV bytes on each GPU. Each
  # rank's host share is TP=1's 92 GiB, so TP=2 holds twice the tokens and runs about twice the
  # requests: its CUDA graphs go twice as far. On four GPUs the two servers run side by side
  # (vanilla on the first two, sparse on the next two, the same windows), on two in turn
  # ($TP2_SYSTEMS: which of them there, default both).
  local flags v=${JOB_VARIANT:+-$JOB_VARIANT} devices systems system
  flags=$(tp_variant_flags) || return 1
  local args=(--traces long-generation --rates-long-generation "${TP2_RATE:-4.0}" --tp-size 2
    --max-seconds-per-rate "${TP_WINDOW:-600}" --out-dir /root/o --log-dir "/root/o/serving-tp-logs$v"
    --profile-steps "${SERVING_PROFILE_STEPS:-0}"
    --sparse-host-cache-gb "${TP2_HOST_GB:-184}" --vanilla-server-args "--cuda-graph-max-bs-decode 128"
    --sparse-server-args "--cuda-graph-max-bs-decode 192 $HEADLINE_KV $SCALES_TP2 ${TP_SPARSE_EXTRA:-} $flags")
  IFS=',' read -ra devices <<< "${CUDA_VISIBLE_DEVICES:-0,1}"
  if [ ${#devices[@]} -lt 4 ]; then  # one invocation per system: each run's record is written when it ends
    IFS=',' read -ra systems <<< "${TP2_SYSTEMS:-vanilla,sparse}"
    for system in "${systems[@]}"; do
      python3 -m benchmark.serving --systems "$system" "${args[@]}" --merge-into "/root/o/${TP2_INTO:-serving-tp2$v}.json"
    done
    return
  fi
  # vanilla takes the sparse server's KV dtype and scales from --sparse-server-args
  CUDA_VISIBLE_DEVICES=${devices[0]},${devices[1]} python3 -m benchmark.serving --systems vanilla "${args[@]}" \
    --merge-into /root/o/serving-tp2-vanilla.json > /root/o/serving-tp2-vanilla.log 2>&1 &
  CUDA_VISIBLE_DEVICES=${devices[2]},${devices[3]} python3 -m benchmark.serving --systems sparse "${args[@]}" \
    --merge-into "/root/o/serving-tp2-sparse$v.json" > "/root/o/serving-tp2-sparse$v.log" 2>&1 &
  wait
  python3 -m benchmark.serving --combine "/root/o/serving-tp2$v.json" /root/o/serving-tp2-vanilla.json "/root/o/serving-tp2-sparse$v.json"
}
job_serving_tp2_sparse() {
  # sparse TP=2 alone on the job's two GPUs, into serving-tp2-alone-<variant>.json (its own name:
  # on four GPUs it runs beside sparse TP=1 for the scaling bar, and serving_tp2's pair in
  # another stage writes serving-tp2-sparse-<variant>.json), then with a vanilla TP=2 run of the
  # same start, if one was made before it, into serving-tp2-<variant>.json
  local v=${JOB_VARIANT:+-$JOB_VARIANT}
  TP2_SYSTEMS=sparse TP2_INTO=serving-tp2-alone$v job_serving_tp2 || return 1
  if [ -e /root/o/serving-tp2-vanilla.json ]; then
    python3 -m benchmark.serving --combine "/root/o/serving-tp2$v.json" /root/o/serving-tp2-vanilla.json "/root/o/serving-tp2-alone$v.json"
  fi
}
job_parallel() {
  # the parallel summary (no GPU): TP=2 serving, sparse TP=1 ($TP1_JSON: e.g. serving_pair's
  # serving.json from the same start, the same flags and window), and the tp and dp tests' records;
  # parallel:graphs summarizes the graphs variant's serving files into parallel-<date>-graphs.json
  # (serving_tp2_sparse's run, if made, is the one the scaling ratio takes; with no vanilla pair
  # among the jobs, the only TP=2 run)
  local v=${JOB_VARIANT:+-$JOB_VARIANT} tp2 alone beside=()
  tp2=/root/o/serving-tp2$v.json alone=/root/o/serving-tp2-alone$v.json
  if [ -e "$alone" ]; then
    if [ -e "$tp2" ]; then beside=(--tp2-beside-tp1 "$alone"); else tp2=$alone; fi
  fi
  python3 -m benchmark.serving --parallel "/root/o/parallel-$(date +%F)$v.json" "$tp2" \
    "${TP1_JSON:-/root/o/serving-tp1$v.json}" /root/o/tp2-exact-gpu-test.json /root/o/dp-gpu-test.json \
    /root/o/tp2-vs-tp1-one-layer-gpu-test.json /root/o/tp2-vs-tp1-gpu-test.json "${beside[@]}"
}
job_serving_tp1() {
  # sparse TP=1 with the TP=2 runs' flags and window, on the job's first GPU, into serving-tp1.json
  # (on four GPUs it runs in the stage before or after serving_tp2@0/1/2/3, so one start has all three)
  local flags v=${JOB_VARIANT:+-$JOB_VARIANT} devices=${CUDA_VISIBLE_DEVICES:-0}
  flags=$(tp_variant_flags) || return 1
  CUDA_VISIBLE_DEVICES=${devices%%,*} python3 -m benchmark.serving --systems sparse \
    --sparse-host-cache-gb 92 --sparse-server-args "--cuda-graph-max-bs-decode 96 $HEADLINE_KV $SCALES_TP1 ${TP_SPARSE_EXTRA:-} $flags" \
    --traces long-generation --rates-long-generation "${TP1_RATE:-2.0}" --max-seconds-per-rate "${TP_WINDOW:-600}" \
    --out-dir /root/o --log-dir "/root/o/serving-tp1-logs$v" --merge-into "/root/o/serving-tp1$v.json"
}
job_serving_tp() {
  # the two-GPU host's whole serving side of TP: TP=2 serving, then sparse TP=1 on
  # the first GPU (unless $TP1_JSON holds that run already), then the summary
  job_serving_tp2
  [ -n "${TP1_JSON:-}" ] || job_serving_tp1
  job_parallel
}
source tools/gpu_host_stages.sh  # run_stages: $JOBS in stages, $STAGE_LIMITS
JOBS=${JOBS:-"grid tests fuzz"}
export -f run_stages run_job_chain descendants stop_trees tp_variant_flags sample_host_cpu $(compgen -A function job_)
export HEADLINE_KV SCALES_TP1 SCALES_TP2 JOBS ATTENTION_KVS GPU_TESTS TESTS_GPUS FUZZ_REQUESTS SOAK_REQUESTS SOAK_CRASHERS GRID_PARALLEL GRID_ARGS GRID_SPARSE_ARGS GRID_VARIANTS GRID_CONFIGS GRID_VANILLA_CONFIGS GRID_STAGGER DECODE_CELLS KERNEL_GPU_TESTS STARTUP_REPEATS \
  STAGE_LIMITS DECODE_CONTEXTS DECODE_BATCHES DECODE_ARGS SERVING_SPARSE_EXTRA SERVING_SYSTEMS SERVING_FILE SERVING_WINDOW SERVING_PROFILE_STEPS SERVING_VARIANTS PAIR_TRACES PAIR_VANILLA TP_SPARSE_EXTRA TP_VARIANTS TP_WINDOW TP_TEST_ARGS TP2_HOST_GB TP2_RATE TP1_RATE TP1_JSON TP2_SYSTEMS TP2_INTO
setsid nohup bash -c run_stages > /root/o/burst.log 2>&1 < /dev/null &
sleep 2; echo started

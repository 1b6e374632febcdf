# A local stand-in for lmsysorg/sglang:v0.5.17-cu130, for machines that cannot pull it (no Docker
# Hub): what docker/Dockerfile relies on from that image, installed from PyPI and Debian only.
# FROM is a Debian bookworm minbase rootfs made by debootstrap (python3 3.11, pip, g++, curl) and
# imported as an image; tools/build_image_local.sh builds it, then docker/Dockerfile on top:
#
#   buildah bud -f docker/base.Dockerfile --build-arg DEBIAN_IMAGE=localhost/debian-bookworm-minbase \
#     -t localhost/sglang-local:v0.5.17-cu130 docker/
#
# Differences from the official image: Debian 12 and its python 3.11 (not the official image's
# Ubuntu and python), no NVIDIA driver libraries or CUDA apt packages; the CUDA 13.0 toolkit
# (nvcc, headers, cudart) comes from NVIDIA's PyPI wheels, laid out as /usr/local/cuda-13.0.
ARG DEBIAN_IMAGE=localhost/debian-bookworm-minbase
FROM ${DEBIAN_IMAGE}

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_HOME=/usr/local/cuda \
    PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# Debian marks its python as externally managed (PEP 668); the official image installs into its
# system python with plain `python3 -m pip install`, and docker/Dockerfile does the same.
# SGLang's release with its pins (torch 2.11.0 cu130, FlashInfer, sglang-kernel), accelerate (the
# GGUF default model), ninja (torch's extension builder), and the CUDA 13.0 toolkit's wheels.
RUN rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \
    && python3 -m pip install --no-cache-dir sglang==0.5.17 accelerate ninja \
    && python3 -m pip install --no-cache-dir --no-deps --target /opt/cuda-13.0-wheels \
        nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
        nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96 \
    && ln -s /opt/cuda-13.0-wheels/nvidia/cu13 /usr/local/cuda-13.0 \
    && ln -s /usr/local/cuda-13.0 /usr/local/cuda \
    && cd /usr/local/cuda-13.0 \
    && ln -s lib lib64 && ln -sf libcudart.so.13 lib/libcudart.so \
    && mkdir -p targets/x86_64-linux && ln -s ../../include targets/x86_64-linux/include \
    && ln -s ../../lib targets/x86_64-linux/lib \
    && nvcc --version \
    && python3 -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)"

CMD ["/bin/bash"]

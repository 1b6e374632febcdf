"""Native kernels of sparse-sglang (sources in ``csrc/``), compiled on first use by the cached
loaders in :mod:`sgl_kernels_ext.build`: ``load_host_ext()`` and ``load_cuda_ext()``."""

"""Helpers shared by the GPU tests and the benchmarks: model folders and real server processes."""

"""Tools around pagedkv: the profiler comparison (python -m pagedkv.tools.profile), the compiled
PyTorch decoder it is measured against, and the embedded default model."""

"""GPU state, the user package's side: NVML, hardware fingerprints and the restore rules (the
server), the arena and the VMM segments (kernels). The CUDA driver's process checkpoint API and
the checkpoint preflight are the helper's (infinijup_helper/cuda_driver.py, cuda_preflight.py),
which imports nothing from here.

Nothing here imports cuda-python or NVML at module import time: a machine without a GPU (or
without those packages) imports this package fine and is told what is missing when it asks.
"""

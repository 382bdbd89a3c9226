"""GPU state: the CUDA driver's process checkpoint API, NVML preflight, hardware fingerprints.

Nothing here imports cuda-python or NVML at module import time: a machine without a GPU (or
without those packages) imports this package fine and is told what is missing when it asks.
"""

"""Entry point of Infinijup kernels: ipykernel with the Infinijup magics loaded.

Used by the kernelspec as ``python -m infinijup.kernel_magics.launch -f {connection_file}``.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    # The restored kernel's parent is the helper, not the launcher: the parent poller must not
    # take that for the launcher's death.
    os.environ.pop("JPY_PARENT_PID", None)
    from ipykernel import kernelapp

    from .isolation import install

    install()  # the kernel's own random draws (banner tips...) stay off the user's `random`
    from .gpu_vmm import arm

    arm()  # PyTorch's CUDA memory on the VMM allocator, once the user initializes CUDA
    from .engines_vllm import arm as arm_vllm

    arm_vllm()  # vLLM's AsyncLLM engines parked for snapshots, once the user imports vLLM

    argv = sys.argv[1:]
    from .ipc_pipe import install as pipe_on_ipc
    from .ipc_pipe import ip_of

    ip = ip_of(argv)
    if ip is not None:
        pipe_on_ipc(ip)  # no TCP port at all: the subprocess pipe beside the channels
    if not any(a.startswith("--ext") for a in argv):
        argv = [*argv, "--ext=infinijup.kernel_magics"]
    # Input history lives in memory, so it is part of every snapshot: a history file on disk
    # would be shared by every state restored from it (IPython then reports duplicate lines).
    if not any(a.startswith("--HistoryManager.hist_file") for a in argv):
        argv = [*argv, "--HistoryManager.hist_file=:memory:"]
    kernelapp.launch_new_instance(argv=argv)


if __name__ == "__main__":
    main()

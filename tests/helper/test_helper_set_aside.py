"""A restore beside the kernel it replaces, which is set aside alive (``park``: an undo
restores first and dumps the kernel it left afterwards, serverext/undo.py). The kernel set
aside keeps its state and its listeners, and dumps later as it was; where it cannot stay beside
the restore (no PID namespace: the restore takes its pids back; GPU state), the helper refuses
before it touches anything."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import pytest
from helperkit import HelperDaemon, Kernel, needs_root_and_criu, own_helper, wait_for

from infinijup.errors import InfinijupError

pytestmark = needs_root_and_criu

PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _moved(kernel: Kernel) -> tuple[str, tuple[tuple[int, int], ...]]:
    """A connection file like the kernel's on other ports, and the port map to it (a helper
    kernel listens on TCP: the restored copy cannot take the ports of the one set aside)."""
    info = json.load(open(kernel.connection_file))
    ports = {name: _free_port() for name in PORTS}
    path = kernel.connection_file[:-5] + "-beside.json"
    with open(path, "w") as f:
        json.dump({**info, **ports}, f)
    return path, tuple((info[n], ports[n]) for n in PORTS)


def _connect(connection_file: str, pid: int) -> Kernel:
    from jupyter_client import BlockingKernelClient

    kc = BlockingKernelClient(connection_file=connection_file)
    kc.load_connection_file()
    kc.start_channels()
    k = Kernel(pid=pid, connection_file=connection_file, log_path="", kc=kc)
    k.wait_answering(timeout=60)
    return k


def _dump(client, kernel: Kernel, name: str, **kwargs) -> str:  # noqa: ANN001
    images = os.path.join(client.work_dir(), f"{name}-{kernel.pid}")
    client.dump(kernel.pid, images, **kwargs)
    return images


def test_the_kernel_set_aside_lives_listening_and_dumps_as_it_was(client, kernel: Kernel,
                                                                   trees) -> None:
    if not client.hello().features["pid_namespace"]:
        pytest.skip("this helper runs kernels without PID namespaces (a CUDA machine): "
                    "nothing can be set aside there (see the test below)")
    kernel.execute("x = 1")
    images = _dump(client, kernel, "before")
    kernel.execute("x = 2")
    beside, port_map = _moved(kernel)
    restored = client.restore(images, replace_pid=kernel.pid, park=True, port_map=port_map)
    trees.add(restored.pid)
    assert restored.pid != kernel.pid
    new = _connect(beside, restored.pid)
    assert new.evaluate(x="x") == {"x": "1"}
    # set aside: alive, its state as it was, still listening (a new connection is answered)
    assert os.path.exists(f"/proc/{kernel.pid}")
    old = _connect(kernel.connection_file, kernel.pid)
    assert old.evaluate(x="x") == {"x": "2"}
    old.close()
    # dumped (and ended) behind the restored kernel, it comes back as it was
    left = _dump(client, kernel, "left", leave_running=False)
    wait_for(lambda: not os.path.exists(f"/proc/{kernel.pid}"), timeout=30,
             what="the kernel set aside to be ended")
    back = client.restore(left, replace_pid=restored.pid)
    trees.add(back.pid)
    new.close()
    kernel.wait_answering(timeout=60)  # on its own ports again
    assert kernel.evaluate(x="x") == {"x": "2"}


def test_a_kernel_that_maps_the_cuda_driver_is_not_set_aside(client, kernel: Kernel, trees,
                                                            tmp_path) -> None:
    """Its GPU memory would stay held beside the restore: refused before anything is
    touched, and the kernel goes on as it was."""
    if not client.hello().features["pid_namespace"]:
        pytest.skip("no PID namespaces here: refused for that first (the test below)")
    kernel.execute("x = 1")
    images = _dump(client, kernel, "cpu")  # the snapshot itself holds no GPU state
    driver = tmp_path / "libcuda.so.1"  # a stand-in of that name: this machine has none
    driver.write_bytes(b"\x7fELF" + bytes(8188))
    kernel.execute(f"import mmap\ncuda_file = open({str(driver)!r}, 'rb')\n"
                   "cuda_map = mmap.mmap(cuda_file.fileno(), 8192, prot=mmap.PROT_READ)\n"
                   "x = 2")
    _beside, port_map = _moved(kernel)
    before = sorted(client.trees())
    with pytest.raises(InfinijupError) as refused:
        client.restore(images, replace_pid=kernel.pid, park=True, port_map=port_map)
    assert refused.value.reason == "cannot_park", refused.value
    assert "uses the GPU" in refused.value.message
    assert kernel.evaluate(x="x") == {"x": "2"}
    assert sorted(client.trees()) == before


@pytest.fixture(scope="module")
def no_namespace() -> Iterator[HelperDaemon]:
    """A helper that runs kernels without PID namespaces (as on the GPU hosts)."""
    with own_helper("--pid-namespace", "never") as daemon:
        yield daemon


def test_without_a_pid_namespace_nothing_is_set_aside(no_namespace, trees) -> None:
    """The restore would take the kernel's pids back: refused, the kernel untouched."""
    from helperkit import start_kernel

    from infinijup.helper_client import HelperClient

    client = HelperClient(no_namespace.socket_path, timeout=120)
    kernel = start_kernel(client, trees)
    try:
        kernel.execute("x = 1")
        images = _dump(client, kernel, "nons")
        kernel.execute("x = 2")
        before = sorted(client.trees())
        with pytest.raises(InfinijupError) as refused:
            client.restore(images, replace_pid=kernel.pid, park=True)
        assert refused.value.reason == "cannot_park", refused.value
        assert "PID namespace" in refused.value.message
        assert kernel.evaluate(x="x") == {"x": "2"}
        assert sorted(client.trees()) == before
    finally:
        kernel.close()

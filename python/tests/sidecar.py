"""A real `kvtier serve` process on a Unix socket in a temporary directory, for the client
tests (python/tests/test_client.py). The binary is `$KVTIER_BIN` (conftest.kvtier_bin)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import free_port, kvtier_bin

__all__ = ["BIG_GEOMETRY_FLAGS", "GEOMETRY_FLAGS", "Sidecar", "free_port", "start_sidecar"]

#: A larger geometry for transfers that take a few milliseconds: a block is 256 KiB (64 KiB a
#: layer), so a 512-block load copies 128 MiB, 32 MiB a layer.
BIG_GEOMETRY_FLAGS = (
    "--set", "model.layers=4",
    "--set", "model.kv_heads=8",
    "--set", "model.head_dim=128",
    "--set", "model.dtype=f16",
    "--set", "model.block_tokens=16",
)

#: The small geometry the test sidecars serve: 4 layers, 2 KV heads of 16, f16, 4-token blocks
#: (a block-layer is 512 bytes, a block 2 KiB).
GEOMETRY_FLAGS = (
    "--set", "model.layers=4",
    "--set", "model.kv_heads=2",
    "--set", "model.head_dim=16",
    "--set", "model.dtype=f16",
    "--set", "model.block_tokens=4",
)


@dataclass
class Sidecar:
    """A running `kvtier serve`: its socket, process and stderr lines."""

    process: subprocess.Popen[str]
    socket: Path
    dir: Path
    log: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def pause(self) -> None:
        """SIGSTOP: the process stays alive and answers nothing; returns once every thread of
        it is stopped (state T in /proc), so no request still gets through."""
        os.kill(self.process.pid, signal.SIGSTOP)
        stat = Path(f"/proc/{self.process.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvtier serve (pid {self.process.pid}) did not stop")
            time.sleep(0.001)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL if it has not exited within 20 s."""
        stop_process(self.process, 20)


def stop_process(process: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM by PID, then SIGKILL if it has not exited within ``grace_s`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_sidecar(tmp: Path, *flags: str, host_capacity: str = "16MiB",
                  geometry: tuple[str, ...] = GEOMETRY_FLAGS, timeout: float = 60) -> Sidecar:
    """Starts `kvtier serve` on `tmp`/kvtier.sock (metrics off) and returns once it serves."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "kvtier.sock"
    proc = subprocess.Popen(
        [str(kvtier_bin()), "serve", "--socket", str(sock), "--metrics", "off",
         "--host-capacity", host_capacity, *geometry, *flags],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    log: list[str] = []
    deadline = time.monotonic() + timeout
    for line in proc.stderr:
        log.append(line)
        if "kvtier: serving" in line:
            break
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError("kvtier serve did not start in time:\n" + "".join(log))
    else:
        proc.wait()
        raise RuntimeError(f"kvtier serve exited ({proc.returncode}):\n{''.join(log)}")
    stderr = proc.stderr
    threading.Thread(target=lambda: log.extend(stderr), daemon=True).start()
    return Sidecar(proc, sock, tmp, log)

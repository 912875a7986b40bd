"""Fixtures that start real kvtier processes (never fakes).

The binary is `$KVTIER_BIN`, or the debug build `cargo test` makes (target/debug/kvtier).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def kvtier_bin() -> Path:
    """The kvtier binary the tests run."""
    path = Path(os.environ.get("KVTIER_BIN", REPO / "target" / "debug" / "kvtier"))
    if not path.is_file():
        pytest.exit(f"{path}: no kvtier binary; run `cargo build` or set KVTIER_BIN", 2)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Engine:
    """A running `kvtier engine` process."""

    process: subprocess.Popen[str]
    port: int
    log: list[str]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def start_engine(*flags: str) -> Engine:
    """Starts `kvtier engine` on a free loopback port; returns once it says it serves."""
    port = free_port()
    process = subprocess.Popen(
        [str(kvtier_bin()), "engine", "--listen", f"127.0.0.1:{port}", *flags],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    log: list[str] = []
    for line in process.stderr:
        log.append(line)
        if "kvtier engine: serving" in line:
            break
    else:
        process.wait()
        raise RuntimeError(f"kvtier engine exited ({process.returncode}):\n{''.join(log)}")
    stderr = process.stderr
    threading.Thread(target=lambda: log.extend(stderr), daemon=True).start()
    return Engine(process, port, log)


def stop(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Engine]]:
    """Starts engines with the given flags; stops them all at the end of the test."""
    started: list[Engine] = []

    def factory(*flags: str) -> Engine:
        e = start_engine(*flags)
        started.append(e)
        return e

    yield factory
    for e in started:
        stop(e.process)

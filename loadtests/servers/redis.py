"""A real ``redis-server`` on a free loopback port for tests: start, kill (crash), restart on one port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from loadtests.servers.ports import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def available() -> bool:
    return Path(REDIS_SERVER).exists()


class RedisServer:
    """One throwaway, non-persistent redis-server process bound to 127.0.0.1."""

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None) -> None:
        """``password``: the server requires it (``requirepass``)."""
        self.host = "127.0.0.1"
        self.port = port if port is not None else free_port()
        self.password = password
        self._workdir = workdir
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, deadline_s: float = 10.0) -> None:
        """Start the server and return once it answers PING (or raise with its log)."""
        log_path = self._workdir / f"redis-{self.port}.log"
        self._proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port", str(self.port),
                "--bind", self.host,
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self._workdir),
                "--logfile", str(log_path),
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + deadline_s
        while not self.ping():
            if self._proc.poll() is not None:
                log = log_path.read_text() if log_path.exists() else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {log[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server on port {self.port} did not answer PING in {deadline_s} s")
            time.sleep(0.005)  # poll interval, bounded by the deadline above

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2) as sock:
                if self.password:
                    sock.sendall(f"AUTH {self.password}\r\n".encode())
                    if not sock.recv(16).startswith(b"+OK"):
                        return False
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def kill(self) -> None:
        """SIGKILL (a crash, not a shutdown) and reap; a no-op when not running."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None

    def restart(self) -> None:
        """Kill and start again on the same port, empty (no persistence)."""
        self.kill()
        self.start()

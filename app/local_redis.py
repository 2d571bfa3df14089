"""A real ``redis-server`` process on a loopback port, owned by this process.

Used by the tests and by the run CLI (development): its own temporary directory, AOF on
(``appendfsync everysec``) so :meth:`LocalRedis.restart` brings the data back, no RDB
snapshots unless asked. ``cache_max_memory`` makes it a cache instead, the kind the KV
blocks want (``dataplane.kv_redis``): no persistence, at most that much memory, least
recently used keys evicted. Install the binary with ``scripts/install_redis.sh``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional


class LocalRedisError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout_s: float = 0.5) -> bool:
    """Raw RESP PING, so this module needs no redis client."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = s.recv(64)
            # NOAUTH: up and answering, just password-protected (--requirepass).
            return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
    except OSError:
        return False


class LocalRedis:
    def __init__(
        self,
        port: Optional[int] = None,
        *,
        data_dir: Optional[str | os.PathLike] = None,
        save: str = "",
        binary: Optional[str] = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout_s: float = 20.0,
        cache_max_memory: Optional[str] = None,
    ):
        self.port = port or _free_port()
        self._own_dir = data_dir is None
        # Absolute: redis-server runs in this directory and resolves its log path there.
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="llm-redis-")).resolve()
        self._save = save
        self._binary = binary or shutil.which("redis-server")
        self._extra_args = tuple(extra_args)
        self._startup_timeout_s = startup_timeout_s
        self.cache_max_memory = cache_max_memory
        self._proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> Optional[int]:
        """The server's process id while it runs (benchmarks account its CPU)."""
        return self._proc.pid if self.running else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def start(self) -> "LocalRedis":
        if self.running:
            return self
        if not self._binary:
            raise LocalRedisError(
                "redis-server not found on PATH; run scripts/install_redis.sh"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.cache_max_memory:
            persistence = [
                "--appendonly", "no",
                "--save", "",
                "--maxmemory", self.cache_max_memory,
                "--maxmemory-policy", "allkeys-lru",
            ]
        else:
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec", "--save", self._save]
        args = [
            self._binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            *persistence,
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            *self._extra_args,
        ]
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
                self._proc = None
                raise LocalRedisError(f"redis-server exited at start on port {self.port}: {err}{log}")
            if _ping(self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise LocalRedisError(f"redis-server on port {self.port} did not answer PING in time")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM and wait (Redis flushes its AOF on a clean shutdown)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr:
            proc.stderr.close()

    def restart(self) -> "LocalRedis":
        """Same port, same directory: what the AOF holds comes back."""
        self.stop()
        return self.start()

    def cleanup(self) -> None:
        """Stop, and remove the directory if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def __del__(self):
        try:
            self.stop()
        except Exception:
            pass

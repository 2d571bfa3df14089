"""A minimal RESP2 client for the bulk KV-block paths, with no copies of its own.

redis-py moves a 256 KiB value through three to four Python-level copies (asyncio's
stream buffer, ``readexactly``, ``tail + data``, ``[:-2]``; on the way out ``b"".join`` of
the whole pipeline, then the transport's buffer). Measured on the 2-core test machine,
64 x 256 KiB per MGET, 4 in flight: redis-py 0.63-0.81 GB/s, this client 1.0-1.15 GB/s.

* :meth:`RawBlockClient.mget_packed` reads the values of an MGET straight from the socket
  into one numpy buffer (``recv_into`` at each value's offset): the buffer is the packed
  form that crosses the Serve hop (``blocks.pack_blocks``), so a block read from Redis is
  copied once, by the kernel, before Ray's object store takes it. A large read goes as
  several MGETs of a few MiB, one after the other, which Redis serves about twice as fast.
  A client reads up to ``MGET_CALLS_AT_ONCE`` calls at once, each on its own
  connection with one piece outstanding; calls beyond that queue in order.
* :meth:`RawBlockClient.pipeline` sends commands with ``sendmsg`` over the caller's
  buffers (memoryviews of L2) and parses the small replies.

Only plain TCP: for TLS (``rediss://``) or a Unix socket :meth:`from_redis` returns None
and the store keeps using redis-py. Errors are redis-py's exception types, so callers map
them as they map redis-py's: connection trouble is ``redis.exceptions.ConnectionError`` or
``TimeoutError`` (the connection is closed, and so are the idle ones, which a restarted
Redis has broken too); an error reply is ``ResponseError`` (a ``LOADING`` reply is
``BusyLoadingError``, a connection error). The timeout is the socket timeout between two
pieces of progress, not for the whole call: a 16 MiB reply on a busy machine is no outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections import deque
from typing import Callable, Optional, Sequence

import numpy as np
from redis import exceptions as rexc

_CRLF = b"\r\n"
_SCRATCH = 64 * 1024
# Bytes per value added to an MGET buffer's size estimate.
_SLACK = 64
# Values at least this large are sent from the caller's buffer, not copied into a header.
_INLINE_MAX = 4096
# sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call.
_IOV_MAX = 1024
# An MGET asks for about this many bytes of values, shared among the MGETs in flight on
# one client; the size of a value is guessed from those already read, at first this.
MGET_IN_FLIGHT_BYTES = 4 << 20
_VALUE_GUESS = 64 * 1024
# MGETs of one call outstanding on its connection at once. One: Redis then holds at most
# one piece of each read in its reply buffers (4 MiB for one read, 1 MiB each for four),
# which cost it less CPU per byte than two (loadtests/README.md, "Four L3 reads at once,
# one piece each"). LLM_RAW_MGET_AHEAD sets it (benchmarks).
MGET_AHEAD = max(1, int(os.environ.get("LLM_RAW_MGET_AHEAD", "1")))
# mget_packed calls of one client reading at once, each on its own connection (0: no
# limit); the others queue, in order. With one piece of each outstanding, four at once
# read faster than one after the other: seven pairs of ``loadtests.dataplane_throughput``
# runs, the worker's reader alone 0.73 against 0.63 of redis-benchmark's GET, its L3
# loads 0.43 against 0.39, a lone 128-block load no slower (medians). With two pieces
# each, four at once had been the slower (0.82 against 1.06 GB/s, "One L3 read at a
# time"). LLM_RAW_MGET_CALLS_AT_ONCE sets it (benchmarks).
MGET_CALLS_AT_ONCE = int(os.environ.get("LLM_RAW_MGET_CALLS_AT_ONCE", "4"))


def _arg(a) -> bytes | memoryview:
    if isinstance(a, (bytes, memoryview)):
        return a
    if isinstance(a, str):
        return a.encode()
    if isinstance(a, int) and not isinstance(a, bool):
        return str(a).encode()
    if isinstance(a, (bytearray, np.ndarray)):
        return memoryview(a).cast("B")
    raise TypeError(f"unsupported RESP argument type {type(a).__name__}")


def encode_commands(commands: Sequence[Sequence]) -> list[bytes | memoryview]:
    """RESP2 arrays of bulk strings, as a list of buffers: small parts joined, large
    values passed through as they are (no copy)."""
    out: list[bytes | memoryview] = []
    head = bytearray()
    for cmd in commands:
        head += b"*%d\r\n" % len(cmd)
        for raw in cmd:
            a = _arg(raw)
            n = len(a) if not isinstance(a, memoryview) else a.nbytes
            head += b"$%d\r\n" % n
            if n < _INLINE_MAX:
                head += a
                head += _CRLF
            else:
                out.append(bytes(head))
                out.append(a)
                head = bytearray(_CRLF)
    if head:
        out.append(bytes(head))
    return out


def _error(line: bytes) -> Exception:
    msg = line[1:].decode(errors="replace")
    if msg.startswith("LOADING"):
        return rexc.BusyLoadingError(msg)
    if msg.startswith(("NOAUTH", "WRONGPASS")):
        return rexc.AuthenticationError(msg)
    return rexc.ResponseError(msg)


class _Conn:
    """One non-blocking socket plus a small read buffer for reply headers."""

    def __init__(self, sock: socket.socket, timeout_s: Optional[float]):
        self.sock = sock
        self.timeout_s = timeout_s
        self.buf = bytearray(_SCRATCH)
        self.view = memoryview(self.buf)
        self.start = 0  # unread bytes are buf[start:end]
        self.end = 0
        self.loop = asyncio.get_running_loop()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    async def _wait(self, fut_fn, *args):
        try:
            if self.timeout_s is None:
                return await fut_fn(*args)
            return await asyncio.wait_for(fut_fn(*args), self.timeout_s)
        except asyncio.TimeoutError:
            raise rexc.TimeoutError(f"Redis did not answer within {self.timeout_s}s") from None

    async def _recv_into(self, view: memoryview) -> int:
        # Try at once (the common case: data is there), then wait for readability.
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            n = await self._wait(self.loop.sock_recv_into, self.sock, view)
        if n == 0:
            raise rexc.ConnectionError("Redis closed the connection")
        return n

    async def send(self, buffers: list) -> None:
        pending = [memoryview(b).cast("B") for b in buffers if len(b)]
        while pending:
            try:
                sent = self.sock.sendmsg(pending[:_IOV_MAX])
            except (BlockingIOError, InterruptedError):
                await self._wait(self._writable)
                continue
            while sent and pending:
                first = pending[0]
                if sent >= first.nbytes:
                    sent -= first.nbytes
                    pending.pop(0)
                else:
                    pending[0] = first[sent:]
                    sent = 0

    def _writable(self) -> asyncio.Future:
        fut = self.loop.create_future()
        fd = self.sock.fileno()

        def ready():
            self.loop.remove_writer(fd)
            if not fut.done():
                fut.set_result(None)

        self.loop.add_writer(fd, ready)
        fut.add_done_callback(lambda _: self.loop.remove_writer(fd))
        return fut

    async def _fill(self) -> None:
        """Read more into the header buffer (compacting it first)."""
        if self.start:
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start : self.end]
            self.start, self.end = 0, n
        if self.end == len(self.buf):
            self.buf.extend(bytes(len(self.buf)))  # a header line longer than the buffer
            self.view = memoryview(self.buf)
        self.end += await self._recv_into(self.view[self.end :])

    async def readline(self) -> bytes:
        while True:
            i = self.buf.find(_CRLF, self.start, self.end)
            if i >= 0:
                line = bytes(self.buf[self.start : i])
                self.start = i + 2
                return line
            await self._fill()

    async def read_into(self, out: memoryview) -> None:
        """Exactly ``len(out)`` bytes: first what is buffered, then straight from the
        socket into ``out``."""
        have = min(self.end - self.start, len(out))
        if have:
            out[:have] = self.view[self.start : self.start + have]
            self.start += have
        pos = have
        while pos < len(out):
            pos += await self._recv_into(out[pos:])

    async def skip_crlf(self) -> None:
        while self.end - self.start < 2:
            await self._fill()
        if self.buf[self.start : self.start + 2] != _CRLF:
            raise rexc.InvalidResponse("expected CRLF after a bulk string")
        self.start += 2

    async def read_reply(self):
        """One reply of any type; bulk strings as bytes (small replies only)."""
        line = await self.readline()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return _error(line)
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            out = bytearray(n)
            await self.read_into(memoryview(out))
            await self.skip_crlf()
            return bytes(out)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [await self.read_reply() for _ in range(n)]
        raise rexc.InvalidResponse(f"unexpected reply {line[:40]!r}")


def _empty_bytes(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


class RawBlockClient:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: Optional[str] = None,
        password: Optional[str] = None,
        pool_size: int = 32,
        socket_timeout: Optional[float] = None,
        connect_timeout: Optional[float] = None,
    ):
        self._addr = (host, port)
        self._db = int(db or 0)
        self._username = username
        self._password = password
        self._timeout = socket_timeout
        self._connect_timeout = connect_timeout
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(pool_size)
        self._mgets_in_flight = 0
        self._mget_turns = asyncio.Semaphore(MGET_CALLS_AT_ONCE) if MGET_CALLS_AT_ONCE > 0 else None
        # A value's size as the last call read them (the first piece of a call is sized
        # by it).
        self._value_hint = _VALUE_GUESS
        # Where mget_packed's reply buffers come from (nbytes -> uint8 array): a torch
        # worker's reads take them from its KV arena, pages touched once
        # (engines/kv_arena.py:host_bytes), the data plane's from malloc.
        self.buffer = _empty_bytes

    @classmethod
    def from_redis(cls, client) -> Optional["RawBlockClient"]:
        """A raw client with the settings of a ``redis.asyncio.Redis``, or None where it
        cannot serve (TLS, Unix socket, a connection class of its own)."""
        from redis.asyncio.connection import Connection

        pool = client.connection_pool
        if pool.connection_class is not Connection:
            return None
        kw = pool.connection_kwargs
        return cls(
            kw.get("host", "localhost"),
            int(kw.get("port", 6379)),
            db=kw.get("db", 0),
            username=kw.get("username"),
            password=kw.get("password"),
            pool_size=pool.max_connections,
            socket_timeout=kw.get("socket_timeout"),
            connect_timeout=kw.get("socket_connect_timeout"),
        )

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in self._addr[0] else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            try:
                connect = loop.sock_connect(sock, self._addr)
                if self._connect_timeout:
                    await asyncio.wait_for(connect, self._connect_timeout)
                else:
                    await connect
            except asyncio.TimeoutError:
                raise rexc.TimeoutError(f"connecting to Redis at {self._addr} timed out") from None
            except OSError as e:
                raise rexc.ConnectionError(f"cannot connect to Redis at {self._addr}: {e}") from e
            conn = _Conn(sock, self._timeout)
            setup = []
            if self._password:
                setup.append(["AUTH", self._username, self._password] if self._username else ["AUTH", self._password])
            if self._db:
                setup.append(["SELECT", self._db])
            if setup:
                await conn.send(encode_commands(setup))
                for _ in setup:
                    reply = await conn.read_reply()
                    if isinstance(reply, Exception):
                        raise reply
            return conn
        except BaseException:
            sock.close()
            raise

    async def _run(self, fn):
        """``fn(conn)`` on a pooled connection. A connection that failed, or whose call
        was cancelled midway, is closed (its stream position is unknown); a connection
        error closes the idle ones too."""
        async with self._slots:
            conn = self._idle.pop() if self._idle else await self._connect()
            try:
                result = await fn(conn)
            except rexc.ResponseError:
                self._idle.append(conn)  # an error reply leaves the stream in step
                raise
            except (rexc.ConnectionError, rexc.TimeoutError, OSError) as e:
                conn.close()
                self.close()
                if isinstance(e, OSError):
                    raise rexc.ConnectionError(f"Redis connection failed: {e}") from e
                raise
            except BaseException:
                conn.close()
                raise
            self._idle.append(conn)
            return result

    def close(self) -> None:
        """Close the idle connections (those in use close when their call ends)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def pipeline(self, commands: Sequence[Sequence]) -> list:
        """Send all ``commands`` at once; their replies in order. An error reply comes
        back as the exception object in its place (as redis-py's
        ``execute(raise_on_error=False)``)."""
        if not commands:
            return []

        async def run(conn: _Conn):
            await conn.send(encode_commands(commands))
            return [await conn.read_reply() for _ in commands]

        return await self._run(run)

    async def mget_packed(
        self, keys: Sequence, *, on_value: Optional[Callable[[int, memoryview], object]] = None
    ) -> tuple[np.ndarray, list[Optional[int]]]:
        """MGET ``keys``: (one uint8 buffer holding the present values back to back,
        each value's length or None where the key is absent).

        Sent as consecutive MGETs of about ``MGET_IN_FLIGHT_BYTES`` / (MGETs in flight on
        this client) each, on one connection: Redis serves one reply of many large values
        far slower than the same bytes in pieces. Measured here, 64 x 256 KiB per call:
        4 callers at once, one MGET each 1.07-1.52 GB/s, pieces of this budget 2.17-2.58;
        one caller, 1.32-3.41 against 2.50-3.39. (redis-benchmark shows the same: GET
        with 64 pipelined per connection runs slower than one at a time.) ``MGET_AHEAD``
        pieces are outstanding at once (one by default: Redis's reply buffers then hold
        less, see above).

        ``on_value(i, view)`` is called with each present value (``keys[i]``) as soon as
        it has been read, while its bytes are still in the CPU's cache and Redis is
        sending the next ones: a caller's check of every block then costs little beside
        the transfer, against a second pass over memory after it (128 blocks, 32 MiB,
        medians of ``python -m loadtests.l3_read``: 30.4 ms read then checked, 19.2 ms
        checked as they came with two pieces ahead). The
        view is for that call only (the buffer may still be grown by copying). If it
        raises, the rest of the reply is still read and the first exception is raised
        at the end (the connection stays in step)."""
        if not keys:
            return np.empty(0, np.uint8), []

        async def run(conn: _Conn):
            lengths: list[Optional[int]] = []
            out: Optional[np.ndarray] = None
            offset = 0
            sent = 0  # keys asked for so far
            pieces: deque[int] = deque()  # sizes of the MGETs sent and not yet read
            failed: Optional[BaseException] = None
            try:
                while sent < len(keys) or pieces:
                    while sent < len(keys) and len(pieces) < MGET_AHEAD:
                        present = len(lengths) - lengths.count(None)
                        per_value = max(1, offset // present) if present else self._value_hint
                        budget = MGET_IN_FLIGHT_BYTES // max(1, self._mgets_in_flight)
                        chunk = keys[sent : sent + max(1, budget // per_value)]
                        await conn.send(encode_commands([["MGET", *chunk]]))
                        pieces.append(len(chunk))
                        sent += len(chunk)
                    line = await conn.readline()
                    if line[:1] == b"-":
                        pieces.popleft()
                        raise _error(line)
                    if line[:1] != b"*" or int(line[1:]) != pieces[0]:
                        raise rexc.InvalidResponse(f"unexpected MGET reply {line[:40]!r}")
                    for _ in range(pieces.popleft()):
                        head = await conn.readline()
                        if head[:1] != b"$":
                            raise rexc.InvalidResponse(f"unexpected MGET item {head[:40]!r}")
                        n = int(head[1:])
                        if n < 0:
                            lengths.append(None)
                            continue
                        if out is None or offset + n > len(out):
                            # Sized for the rest of the keys at this value's size plus a
                            # little (blocks of one model differ only in their header's
                            # digits); grown by copying if a value is larger still.
                            rest = len(keys) - len(lengths)
                            grown = self.buffer(offset + (n + _SLACK) * rest + (offset >> 2))
                            if out is not None:
                                grown[:offset] = out[:offset]
                            out = grown
                        view = memoryview(out)[offset : offset + n]
                        await conn.read_into(view)
                        await conn.skip_crlf()
                        if on_value is not None and failed is None:
                            try:
                                on_value(len(lengths), view)
                            except Exception as e:  # noqa: BLE001 - raised after the reply
                                failed = e
                        lengths.append(n)
                        offset += n
            except rexc.ResponseError:
                # An error reply: read the replies still due, so that the connection
                # goes back to the pool in step.
                for _ in pieces:
                    await conn.read_reply()
                raise
            present = len(lengths) - lengths.count(None)
            if present:
                self._value_hint = max(1, offset // present)
            if out is None:
                return np.empty(0, np.uint8), lengths, failed
            if 4 * offset < 3 * len(out) and None not in lengths:
                # Values of mixed sizes left the buffer mostly unused: a caller keeping
                # views of it should not hold that much hidden memory.
                return out[:offset].copy(), lengths, failed
            return out[:offset], lengths, failed

        turn = self._mget_turns if self._mget_turns is not None else contextlib.nullcontext()
        async with turn:
            self._mgets_in_flight += 1
            try:
                data, lengths, failed = await self._run(run)
            finally:
                self._mgets_in_flight -= 1
        if failed is not None:
            raise failed  # after the connection went back to the pool
        return data, lengths

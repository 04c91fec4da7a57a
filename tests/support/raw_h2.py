"""A bare HTTP/2 client for gRPC calls that a well-behaved client library never makes: bodies sent slowly
or never finished, and answers never read (no WINDOW_UPDATE is ever sent, so the server may send at most
the stream window the client announced, 0 by default).

It speaks just enough of RFC 9113 for that: the preface, SETTINGS (acknowledged), PING (answered, so
keepalive sees a live peer), HEADERS with HPACK literals (RFC 7541 §6.2.2, no Huffman, no table), DATA,
and it notes which streams the server ended (END_STREAM or RST_STREAM) or has begun to answer. `send`
honours the server's flow control (its SETTINGS and WINDOW_UPDATEs), so a body goes only as fast as the
server asks for it. It decodes nothing the server sends beyond frame types, flags and those windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
DEFAULT_WINDOW = 65_535
MAX_FRAME = 16_384


def _integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) in a prefix of `prefix_bits` bits, high bits from `first`."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A header as a literal without indexing, new name (RFC 7541 §6.2.2)."""
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x00" + _integer(len(raw_name), 7) + raw_name + _integer(len(raw_value), 7) + raw_value


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def grpc_message(body: bytes, declared: int | None = None) -> bytes:
    """A gRPC length-prefixed message; `declared` claims a length other than the body's (a body cut short)."""
    return b"\x00" + struct.pack(">I", len(body) if declared is None else declared) + body


class RawH2:
    """One HTTP/2 connection to a gRPC server on loopback; `close()` it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._next_stream = 1
        self.answering: set[int] = set()
        """Streams on which the server has sent HEADERS or DATA."""
        self.ended: set[int] = set()
        """Streams the server ended (END_STREAM, RST_STREAM, or a GOAWAY past them)."""
        self.data_bytes = 0
        self._initial_window = DEFAULT_WINDOW
        self._connection_window = DEFAULT_WINDOW
        self._stream_windows: dict[int, int] = {}
        self._window_moved = asyncio.Event()
        self._reading = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, port: int, *, window: int = 0) -> RawH2:
        """Connect and announce a stream window of `window` bytes (the server may send no more per stream)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            PREFACE + _frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, window))
        )
        await writer.drain()
        return cls(reader, writer)

    async def call(
        self, method: str, metadata: dict[str, str], body: bytes = b"", *, end: bool = True
    ) -> int:
        """Open a call of `method` (`/package.Service/Method`), send `body` (gRPC-framed bytes), half-close
        unless `end` is False; the stream id."""
        stream = self._next_stream
        self._next_stream += 2
        headers = {
            ":method": "POST",
            ":scheme": "http",
            ":path": method,
            ":authority": "127.0.0.1",
            "content-type": "application/grpc",
            "te": "trailers",
            **metadata,
        }
        block = b"".join(_literal(name, value) for name, value in headers.items())
        self._stream_windows[stream] = self._initial_window
        self._writer.write(
            _frame(HEADERS, END_HEADERS | (END_STREAM if end and not body else 0), stream, block)
        )
        if body:
            await self.send(stream, body, end=end)
        await self._writer.drain()
        return stream

    async def send(self, stream: int, data: bytes, *, end: bool = False) -> None:
        """Send `data` on `stream` as the server's windows allow (waits while they are closed); stops
        early if the server ends the stream."""
        while stream not in self.ended:
            room = min(self._connection_window, self._stream_windows[stream], MAX_FRAME, len(data))
            if room > 0 or not data:
                chunk, data = data[:room], data[room:]
                self._connection_window -= len(chunk)
                self._stream_windows[stream] -= len(chunk)
                self._writer.write(_frame(DATA, END_STREAM if end and not data else 0, stream, chunk))
                await self._writer.drain()
                if not data:
                    return
                continue
            self._window_moved.clear()
            await self._window_moved.wait()

    async def close(self) -> None:
        """Close the connection (the server sees every open stream end)."""
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading
        self._writer.close()
        with contextlib.suppress(ConnectionError):
            await self._writer.wait_closed()

    async def _read(self) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await self._reader.readexactly(9)
                length = int.from_bytes(head[:3], "big")
                kind, flags = head[3], head[4]
                stream = int.from_bytes(head[5:], "big") & 0x7FFFFFFF
                payload = await self._reader.readexactly(length)
                if kind == SETTINGS and not flags & ACK:
                    self._settings(payload)
                    self._writer.write(_frame(SETTINGS, ACK, 0))
                elif kind == WINDOW_UPDATE:
                    grant = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                    if stream == 0:
                        self._connection_window += grant
                    elif stream in self._stream_windows:
                        self._stream_windows[stream] += grant
                    self._window_moved.set()
                elif kind == PING and not flags & ACK:
                    self._writer.write(_frame(PING, ACK, 0, payload))
                elif kind in (HEADERS, DATA):
                    self.answering.add(stream)
                    self.data_bytes += length if kind == DATA else 0
                    if flags & END_STREAM:
                        self.ended.add(stream)
                elif kind == RST_STREAM:
                    self.ended.add(stream)
                if kind in (RST_STREAM, GOAWAY) or flags & END_STREAM:
                    self._window_moved.set()  # a sender waiting on an ended stream must look again
                if kind == GOAWAY:
                    last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
                    self.ended.update(range(last + 2, self._next_stream, 2))

    def _settings(self, payload: bytes) -> None:
        """Apply a change of the server's initial stream window to every open stream (RFC 9113 §6.9.2)."""
        for offset in range(0, len(payload) - 5, 6):
            key, value = struct.unpack(">HI", payload[offset : offset + 6])
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                for stream in self._stream_windows:
                    self._stream_windows[stream] += value - self._initial_window
                self._initial_window = value
        self._window_moved.set()

"""What goes on the wire: HTTP/2 frame and settings layouts and codes (RFC 9113), the gRPC message
prefix and status codes, the few HPACK blocks we send, and the decoder for the blocks we receive.

The server is built on ``hpack`` alone (no ``h2`` state machine): frames are parsed by
``Connection`` with the layouts here. We encode headers ourselves, as literals that leave no
HPACK table state, so every response's header block is a constant or nearly one.
"""

from __future__ import annotations

import struct
from urllib.parse import quote

import hpack

from router.transport.h2.limits import MAX_STATUS_MESSAGE, KiB

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x3
FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x7, 0x9, 0xB

SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

# gRPC status codes we send.
OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 3, 8, 12, 13

FRAME_HEAD = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
SETTING = struct.Struct(">HI")
U32 = struct.Struct(">I")
MESSAGE_HEAD = struct.Struct(">BI")  # gRPC length prefix: compressed flag, length


class H2ConnectionError(Exception):
    """A connection error (RFC 9113 5.4.1): the connection ends with GOAWAY ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def unpad(payload: bytes) -> bytes:
    """A PADDED frame's payload without its pad length byte and its padding."""
    if not payload or payload[0] >= len(payload):
        raise H2ConnectionError(PROTOCOL_ERROR, "bad padding")
    return payload[1 : len(payload) - payload[0]]


# -- header blocks we send ----------------------------------------------------------------------------
def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing (new name, no Huffman): leaves no table state."""
    raw_name, raw_value = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(raw_name), 7) + raw_name + _hpack_int(len(raw_value), 7) + raw_value


_STATUS_200 = b"\x88"  # static table index 8 is ":status: 200"
# "Dynamic table size update to 0" (RFC 7541 6.3), at the start of our first header block: a peer
# whose SETTINGS_HEADER_TABLE_SIZE is under the default 4096 requires one (nghttp2 in Envoy fails
# the connection otherwise), and at 0 no later SETTINGS can require another. We never index.
TABLE_SIZE_ZERO = b"\x20"
RESPONSE_HEADERS = _STATUS_200 + _literal("content-type", "application/grpc")
_OK_TRAILERS = _literal("grpc-status", "0")


def trailers_block(code: int, message: str = "") -> bytes:
    """The header block that ends a call: ``grpc-status``, and ``grpc-message`` when there is one."""
    if code == OK and not message:
        return _OK_TRAILERS
    block = _literal("grpc-status", str(code))
    if message:
        block += _literal("grpc-message", quote(message[:MAX_STATUS_MESSAGE], safe=" !#$&'()*+,/:;=?@[]~"))
    return block


# -- header blocks we receive -------------------------------------------------------------------------
class HeaderDecoder:
    """``hpack``'s decoder plus a cache of the blocks that leave its dynamic table as it was.

    Once its table is warm, Envoy sends the very same block for every ext_proc stream (indexed
    fields and a never-indexed ``:path``): decoding it in pure Python costs ~80 µs, a lookup does
    not. A cached block is only valid while the table is unchanged, so a block that changes it
    (an insertion, a size update) is never cached and empties the cache.
    """

    MAX_CACHED = 64

    def __init__(self, max_header_list_size: int = 64 * KiB) -> None:
        self.hpack = hpack.Decoder(max_header_list_size=max_header_list_size)
        self.cache: dict[bytes, dict[str, str]] = {}

    def decode(self, block: bytes) -> dict[str, str]:
        cached = self.cache.get(block)
        if cached is not None:
            return dict(cached)
        before = self._table_state()
        headers = dict(self.hpack.decode(block))
        if self._table_state() == before:  # identity of the newest entry: compared by ``is``
            if len(self.cache) >= self.MAX_CACHED:
                self.cache.clear()
            self.cache[block] = headers
            return dict(headers)
        self.cache.clear()
        return headers

    def _table_state(self) -> tuple[object, int, int]:
        table = self.hpack.header_table
        entries = table.dynamic_entries
        return (_Same(entries[0]) if entries else None, len(entries), table.maxsize)


class _Same:
    """Equal only to a wrapper of the very same object (a tuple's ``==`` would compare values)."""

    __slots__ = ("item",)

    def __init__(self, item: object) -> None:
        self.item = item

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.item is self.item

    __hash__ = None  # type: ignore[assignment]

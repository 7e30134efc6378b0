"""Every bound the HTTP/2 gRPC server puts on what one peer can make it spend, in one place.

Each field of ``H2Limits`` says why its default is what it is. Crossing one ends the attacking
connection with ``GOAWAY ENHANCE_YOUR_CALM`` (or the error RFC 9113 names: ``FRAME_SIZE_ERROR`` for
a frame over our ``SETTINGS_MAX_FRAME_SIZE``, ``FLOW_CONTROL_ERROR`` for data beyond our window,
``COMPRESSION_ERROR`` for a block HPACK refuses), or bounds its memory by backpressure:

* streams reset before we answered anything (RST_STREAM from the peer, or refused by us) spend
  a per-connection budget that refills over time and with every call that completes (rapid
  reset, CVE-2023-44487; Envoy resets every ext_proc stream it is done with, answered ones);
* CONTINUATION frames per header block are counted and the header block's size is checked on
  HEADERS and CONTINUATION alike, before HPACK sees it (CVE-2024-27316);
* frames are at most ``max_frame_size``; SETTINGS are rate-limited; PINGs closer together than
  ``min_ping_interval_s`` with nothing sent in between are strikes (grpc-core's ping policy);
* receive windows are refilled only for bytes handed to a handler (or discarded), so a peer
  can have at most one connection window of request bytes buffered here; responses waiting for
  the peer's window are capped per call (reset past it) and per connection (past it the peer's
  receive window is no longer refilled: it gets no new request bytes until it reads its answers);
  frames leave in slices of ``max_write_per_turn`` per loop turn;
* one read is processed for at most ``max_frames_per_read`` frames or ``max_time_per_read_s``,
  then the connection yields the loop to the others (grpc-core's ``max_requests_per_read``);
* connections: a cap (the longest-unused idle connection makes room for a new one), an idle
  timeout, a handshake timeout, and a listen backlog sized for reconnect bursts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

KiB, MiB = 1024, 1024 * 1024

DEFAULT_WINDOW = 65_535
MAX_WINDOW = 2**31 - 1
MIN_MAX_FRAME, MAX_MAX_FRAME = 16_384, 2**24 - 1
# grpc-message characters we send: percent-encoded (up to 12 bytes each) they still fit the 16 KiB
# frame every peer accepts, and we never split a header block over CONTINUATION frames.
MAX_STATUS_MESSAGE = 1000


@dataclass(frozen=True, slots=True)
class H2Limits:
    """Every bound the server puts on what one peer can make it spend, with the reason for each.

    Defaults are sized so that legitimate Envoy traffic (thousands of streams per connection,
    keepalive PINGs, streams reset when downstream clients go away) never reaches one, while each
    attack in ``loadtests/bench/h2_attacks.py`` ends with the attacking connection closed or its
    memory bounded. ``H2GrpcServer(limits=...)`` takes one; ``dataclasses.replace`` tunes a field.
    """

    # -- streams and messages -------------------------------------------------------------------
    max_concurrent_streams: int = 10_000
    """SETTINGS_MAX_CONCURRENT_STREAMS: Envoy multiplexes every in-flight request of a worker on
    one connection (one ext_proc stream each); streams over it are refused (and spend the reset
    budget). Each open stream holds its handler and its headers (up to max_header_list_size)."""

    max_message_bytes: int = 4 * MiB
    """The largest gRPC message a call accepts (RESOURCE_EXHAUSTED beyond). The stream window and
    the floors of ``connection_window`` and ``max_call_send_bytes`` are derived from it so that a
    message in flight always fits."""

    max_header_list_size: int = 16 * KiB
    """SETTINGS_MAX_HEADER_LIST_SIZE, enforced on the encoded block (HEADERS + CONTINUATIONs, before
    HPACK runs: ENHANCE_YOUR_CALM) and on the decoded list (HPACK's own cap: COMPRESSION_ERROR).
    Envoy's ext_proc metadata is a few hundred bytes and grpc-core's default hard limit for
    metadata is 16 KiB; a block this size costs HPACK (pure Python) ~5 ms and an open call keeps
    it, so larger caps only buy an attacker time and memory."""

    max_continuation_frames: int = 16
    """CONTINUATION frames per header block (h2's CONTINUATION_BACKLOG is 64): a maximal block
    fits one frame, and peers that split at 16 KiB need none; empty or 1-byte CONTINUATIONs would
    otherwise cost a frame parse each for free (CVE-2024-27316)."""

    max_frame_size: int = 64 * KiB
    """SETTINGS_MAX_FRAME_SIZE we advertise (larger frames: FRAME_SIZE_ERROR as soon as the frame
    head arrives). A 4 MiB body is 64 frames, while a connection holding a frame in progress holds
    at most this much."""

    # -- flow control and buffers -----------------------------------------------------------------
    connection_window: int = 8 * MiB
    """Receive window per connection, refilled only for bytes handed to a handler or discarded:
    the most request bytes one connection can have buffered here. Raised to the stream window
    (twice the largest message) so that one message in progress always completes."""

    max_call_send_bytes: int = 8 * MiB
    """Response bytes one call may have waiting (for the peer's window or the socket); past it the
    call is reset with ENHANCE_YOUR_CALM and its handler cancelled. Raised to twice the largest
    message: ext_proc sends a whole request body back."""

    max_connection_send_bytes: int = 4 * MiB
    """Response bytes one connection may have waiting before its receive window stops being
    refilled: a peer that does not read its answers gets no more request bytes (backpressure, not
    an error). Memory per connection is then about this + ``connection_window``."""

    max_write_per_turn: int = 1 * MiB
    """Bytes moved from calls' queues to the socket per loop turn: a window opening on many
    blocked calls leaves in slices instead of one copy of everything (and one long turn)."""

    # -- time on the loop -----------------------------------------------------------------------
    max_frames_per_read: int = 1000
    """Frames processed per turn before the connection yields the loop to others (grpc-core's
    max_requests_per_read); the rest of the read is processed on the next turn, reading paused."""

    max_time_per_read_s: float = 0.005
    """Loop time one connection may take per turn (checked every 32 frames and after every frame
    of 1 KiB or more): handlers and HPACK run inside frame processing, so the frame count alone
    does not bound it."""

    # -- abuse budgets ----------------------------------------------------------------------------
    reset_burst: int = 1000
    """Streams a connection may have reset before we answered anything on them (peer RST_STREAM,
    or refused by us) in a burst; one more is GOAWAY ENHANCE_YOUR_CALM (rapid reset,
    CVE-2023-44487). Envoy resets every ext_proc stream it is done with (answered: not counted)
    and one that a downstream client left before its answer (counted), so the budget is large and
    refills (below)."""

    reset_refill_per_s: float = 100.0
    """The reset budget refills at this rate, and by one for every call that completes: a busy
    peer cancelling a share of its calls never runs out, a peer that only resets is held to this."""

    settings_burst: int = 100
    """Non-ACK SETTINGS frames a connection may send in a burst (each costs an ACK and, with a new
    initial window, a pass over its calls); one more is GOAWAY ENHANCE_YOUR_CALM. Peers send one
    at the start, grpc-core a few more as it sizes its windows."""

    settings_refill_per_s: float = 10.0
    """The SETTINGS budget refills at this rate."""

    min_ping_interval_s: float = 1.0
    """A PING arriving sooner than this after the previous one, with no new stream and no DATA
    sent to the peer in between, is a strike (grpc-core's policy: keepalive and BDP pings of a
    peer that gets answers never count)."""

    max_ping_strikes: int = 10
    """Strikes tolerated; one more is GOAWAY ENHANCE_YOUR_CALM "too_many_pings"."""

    # -- connections ------------------------------------------------------------------------------
    max_connections: int = 1024
    """Open connections per server. At the cap a new connection closes the longest-unused idle one
    (GOAWAY NO_ERROR: a client reconnects), or is refused (GOAWAY ENHANCE_YOUR_CALM) when every
    connection has calls open. Keep it under the process's open-file limit, which the router
    shares with its upstream connections."""

    idle_timeout_s: float = 300.0
    """A connection with no call open and no new stream for this long gets GOAWAY NO_ERROR and is
    closed. Envoy reconnects on demand; its health checks every few seconds keep theirs open."""

    handshake_timeout_s: float = 10.0
    """Time to complete the TLS handshake and send the client preface; slower is closed."""

    close_linger_s: float = 1.0
    """After our GOAWAY (and FIN), how long a connection is kept reading and discarding so the
    peer gets the GOAWAY instead of a reset, before the socket is dropped."""

    listen_backlog: int = 4096
    """listen(2) backlog: a fleet of Envoys reconnecting at once must not find the accept queue
    full (the kernel caps it at net.core.somaxconn; asyncio's default is 100)."""

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"H2Limits.{item.name} must be a positive number, got {value!r}")
        if not MIN_MAX_FRAME <= self.max_frame_size <= MAX_MAX_FRAME:
            raise ValueError(f"H2Limits.max_frame_size must be in [16384, 2**24 - 1]: {self.max_frame_size}")
        if self.connection_window > MAX_WINDOW:
            raise ValueError(f"H2Limits.connection_window must be under 2**31: {self.connection_window}")

    @property
    def stream_window(self) -> int:
        """SETTINGS_INITIAL_WINDOW_SIZE we advertise: twice the largest message (with its 5-byte
        prefix), so a message in progress always fits between two refills (refills come at half)."""
        return min(MAX_WINDOW, max(DEFAULT_WINDOW, 2 * (self.max_message_bytes + 5)))

    @property
    def effective_connection_window(self) -> int:
        return min(MAX_WINDOW, max(self.connection_window, self.stream_window))

    @property
    def effective_call_send_bytes(self) -> int:
        return max(self.max_call_send_bytes, 2 * (self.max_message_bytes + 5))

"""Fault-injecting HTTP/1.1 reverse proxy for S3 integration tests (stdlib only).

The proxy listens on 127.0.0.1 (free port) and forwards each request to one upstream S3
endpoint *byte for byte*, including the client's ``Host`` header: SigV4 signs ``host``, and
SeaweedFS verifies the signature against the Host header it receives (whatever its own port is),
so rewriting Host would break every signed request. Point boto3's ``endpoint_url`` at
``proxy.endpoint_url`` with path-style addressing.

Supported: keep-alive (one upstream connection per client connection, same lifetime rules as
the upstream's responses), Content-Length and chunked bodies streamed in 64 KiB pieces in both
directions, ``Expect: 100-continue`` (the upstream's interim 100 responses are relayed, so the
client sends the body only when the server asks for it), HEAD/204/304 responses without body.

Faults are added as rules, e.g.::

    with FaultProxy(server.endpoint_url) as proxy:
        proxy.add_rule(FaultRule(Fault.slow_down(), method="PUT", query="partNumber=", times=2))
        client = server.client(endpoint_url=proxy.endpoint_url)
        ...
        assert proxy.count(method="PUT", faulted=True) == 2

S3's request-rate limit is a rule too: ``proxy.add_rule(RateLimit(writes_per_s=2, reads_per_s=4))`` admits that
many writes (PUT, POST, DELETE) and reads (GET, HEAD) per second through token buckets and answers the rest
``503 SlowDown``; it counts what it admitted and throttled, for tests and benchmarks.

Every request is recorded in ``proxy.requests`` (method, path, query, status, user agent, fault).

Bucket kinds (``credentials=`` the upstream's keys, which every forwarded request is then re-signed with):

* ``directory_buckets=True`` behaves like S3 Express One Zone where that can be imitated locally: a ListObjectsV2
  prefix that does not end in ``/`` (or a delimiter other than ``/``) gets S3 Express's 400 ``InvalidRequest``;
  listings come back shuffled; ETags are random strings, consistent per object (listings, HEAD, GET, PUT and
  CompleteMultipartUpload answers), and the ``If-Match`` / ``If-None-Match`` a client sends are translated back;
  prefixes of in-progress multipart uploads appear in listings as ``CommonPrefixes`` (with a ``/`` delimiter: the
  first level below the prefix; without one: every "directory" holding an upload); ``CreateSession`` (which boto3
  sends first for a ``--x-s3`` bucket) is answered with session credentials. Requests may be path-style (boto3
  uses path style for a directory bucket behind an IP endpoint) or virtual-hosted (``Host: bucket.localhost``).
* ``access_points={"my-ap-123456789012": "real-bucket", "my-ap-abc-s3alias": "real-bucket"}`` maps access point
  names to buckets: the virtual host label boto3 builds from an ARN (``{name}-{account}``) or an alias in the path.
  Clients reach a virtual host such as ``my-ap-123456789012.127.0.0.1`` by using the proxy as their HTTP proxy
  (``HTTP_PROXY=proxy.endpoint_url``): requests then arrive in absolute form, which the proxy accepts too.

Stores without conditional writes (``conditional_writes=``): ``"refuse"`` answers a PUT or POST that carries
``If-Match`` / ``If-None-Match`` with 501 ``NotImplemented`` (recorded with the fault ``conditional:refused``);
``"ignore"`` (needs ``credentials=``) drops those headers and re-signs, so the store writes unconditionally
(recorded as ``conditional:ignored``). The default ``"honour"`` forwards them.

In these modes rules match, and ``requests`` record, the upstream's path-style path (``/bucket/key``). Re-signing
keeps the client's ``x-amz-content-sha256`` (a body hash or ``UNSIGNED-PAYLOAD``), so bodies are forwarded as they
come; chunk-signed ``STREAMING-AWS4-HMAC-SHA256-PAYLOAD`` bodies (which boto3 does not send) would not verify.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import logging
import random
import re
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from urllib.parse import parse_qs, quote, unquote, unquote_plus, urlsplit

log = logging.getLogger("fault_proxy")

_CHUNK = 64 * 1024
_MAX_HEAD = 64 * 1024
_CRLF = b"\r\n"

_DEFAULT_ERROR_CODES = {
    400: "BadRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    409: "OperationAborted",
    500: "InternalError",
    501: "NotImplemented",
    503: "SlowDown",
}
_DEFAULT_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
}
_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    409: "Conflict",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


# --------------------------------------------------------------------------------------------
# Public API: faults, rules, records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """What the proxy does to a matching request; build one with the classmethods."""

    kind: str
    status_code: int = 0
    s3_error_code: str = ""
    message: str = ""
    seconds: float = 0.0
    n_bytes: int | None = None
    offset: int = 0

    @classmethod
    def status(cls, code: int, s3_error_code: str | None = None, message: str | None = None) -> Fault:
        """Answer with an S3 XML error (``<Error><Code>..``) without contacting the upstream."""
        err = s3_error_code or _DEFAULT_ERROR_CODES.get(code, "InternalError")
        msg = message if message is not None else _DEFAULT_MESSAGES.get(err, f"Injected {code} {err}")
        return cls("status", status_code=code, s3_error_code=err, message=msg)

    @classmethod
    def slow_down(cls) -> Fault:
        """503 SlowDown, S3's throttling answer."""
        return cls.status(503, "SlowDown")

    @classmethod
    def reset_before_response(cls) -> Fault:
        """Read the whole request, then reset the connection (client sees ECONNRESET)."""
        return cls("reset_before_response")

    @classmethod
    def reset_mid_request(cls, after_bytes: int | None = None) -> Fault:
        """Read ``after_bytes`` of the body (default: half of it), then reset the connection."""
        return cls("reset_mid_request", n_bytes=after_bytes)

    @classmethod
    def reset_mid_response(cls, after_bytes: int | None = None) -> Fault:
        """Forward upstream's headers and ``after_bytes`` of its body (default: half), then reset."""
        return cls("reset_mid_response", n_bytes=after_bytes)

    @classmethod
    def stall(cls, seconds: float) -> Fault:
        """Read the request, send nothing for ``seconds`` (past the client's read timeout), then close."""
        return cls("stall", seconds=seconds)

    @classmethod
    def truncate_body(cls, n_bytes: int) -> Fault:
        """Forward upstream's response but stop after ``n_bytes`` of body (Content-Length kept), then close."""
        return cls("truncate_body", n_bytes=n_bytes)

    @classmethod
    def corrupt_body(cls, offset: int = 0) -> Fault:
        """Forward upstream's response with the body byte at ``offset`` bit-flipped (length kept)."""
        return cls("corrupt_body", offset=offset)

    def describe(self) -> str:
        """Short label stored in ``RecordedRequest.fault``, e.g. ``status:503:SlowDown``."""
        if self.kind == "status":
            return f"status:{self.status_code}:{self.s3_error_code}"
        if self.kind == "stall":
            return f"stall:{self.seconds:g}s"
        if self.kind in ("truncate_body", "reset_mid_request", "reset_mid_response") and self.n_bytes is not None:
            return f"{self.kind}:{self.n_bytes}"
        if self.kind == "corrupt_body":
            return f"corrupt_body:{self.offset}"
        return self.kind

    @property
    def needs_upstream(self) -> bool:
        """True for faults applied to the upstream's response (the request is forwarded)."""
        return self.kind in ("reset_mid_response", "truncate_body", "corrupt_body")


_REFUSED_CONDITIONS = Fault.status(
    501, "NotImplemented", "A header you provided implies functionality that is not implemented"
)


@dataclass
class FaultRule:
    """Match requests and decide whether ``action`` fires.

    Matching (all given criteria must hold): ``method`` (case-insensitive), ``path_regex``
    (``re.search`` on the URL-decoded path, e.g. ``/bucket/dir/key``), ``query`` (substring of the
    raw query string, e.g. ``partNumber=``, ``uploads``, ``list-type=2``), ``query_regex``,
    ``user_agent`` (substring, e.g. a ``user_agent_extra`` rank tag).

    Budget: the first ``after_requests`` matches are let through; after that the rule fires on
    each match while ``times`` (None = unlimited) is not used up, and, if ``probability`` is set,
    only with that probability (``random.Random(seed)``, so runs are reproducible).
    """

    action: Fault
    method: str | None = None
    path_regex: str | None = None
    query: str | None = None
    query_regex: str | None = None
    user_agent: str | None = None
    times: int | None = None
    probability: float | None = None
    seed: int = 0
    after_requests: int = 0
    matched: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)
    _rng: random.Random = field(init=False, repr=False, compare=False)
    _lock: threading.Lock = field(init=False, repr=False, compare=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        if self.probability is not None and not 0.0 <= self.probability <= 1.0:
            raise ValueError("probability must be within [0, 1]")

    def matches(self, method: str, path: str, query: str, user_agent: str) -> bool:
        """True if the request meets all of this rule's criteria (budget not considered)."""
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if self.path_regex is not None and not re.search(self.path_regex, path):
            return False
        if self.query is not None and self.query not in query:
            return False
        if self.query_regex is not None and not re.search(self.query_regex, query):
            return False
        return self.user_agent is None or self.user_agent in user_agent

    def try_fire(self, method: str, path: str, query: str, user_agent: str) -> bool:
        """Count a match and consume budget; True if the fault is to be applied to this request."""
        if not self.matches(method, path, query, user_agent):
            return False
        with self._lock:
            self.matched += 1
            if self.matched <= self.after_requests:
                return False
            if self.times is not None and self.fired >= self.times:
                return False
            if self.probability is not None and self._rng.random() >= self.probability:
                return False
            self.fired += 1
            return True


WRITE_METHODS = frozenset({"PUT", "POST", "DELETE"})
"""What S3 counts as writes (3,500 per second per prefix); GET and HEAD are reads (5,500)."""


class TokenBucket:
    """Admits `rate` requests per second with a burst of `capacity` (S3's per-prefix limit, seen from outside).

    `admit(now)` takes a token if there is one. `clock` is ``time.monotonic`` unless a test gives its own.
    """

    def __init__(self, rate: float, capacity: float | None = None, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"rate must be > 0, got {rate!r}")
        self.rate = float(rate)
        self.capacity = float(capacity) if capacity is not None else max(1.0, self.rate)
        self._clock = clock
        self._tokens = self.capacity
        self._at = clock()
        self._lock = threading.Lock()

    def admit(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


@dataclass
class RateLimit:
    """A rule that throttles like S3: writes (PUT, POST, DELETE) and reads (GET, HEAD) each get a `TokenBucket`
    (None: that direction is not limited) with a burst of `burst_s` seconds' worth of requests (at least one), and
    a request that finds its bucket empty is answered ``503 SlowDown``. Only requests whose path matches
    `path_regex` (if given) count. Add it like a FaultRule (``proxy.add_rule(RateLimit(writes_per_s=2))``).

    Counters for tests and benchmarks: `admitted` and `throttled` per direction (``"write"``, ``"read"``), the time of
    the first request and of the last admitted one per direction (``time.monotonic()``), and `burst` (the bucket
    capacity: what goodput subtracts, since a burst is served before the rate applies).
    """

    writes_per_s: float | None = None
    reads_per_s: float | None = None
    burst_s: float = 1.0
    path_regex: str | None = None
    action: Fault = field(default_factory=Fault.slow_down)
    admitted: dict[str, int] = field(default_factory=lambda: {"write": 0, "read": 0})
    throttled: dict[str, int] = field(default_factory=lambda: {"write": 0, "read": 0})
    first_request: dict[str, float] = field(default_factory=dict)
    last_admitted: dict[str, float] = field(default_factory=dict)
    _buckets: dict[str, TokenBucket] = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        rates = {"write": self.writes_per_s, "read": self.reads_per_s}
        self._buckets = {
            direction: TokenBucket(rate, max(1.0, rate * self.burst_s))
            for direction, rate in rates.items()
            if rate is not None
        }

    def burst(self, direction: str) -> float:
        bucket = self._buckets.get(direction)
        return bucket.capacity if bucket is not None else 0.0

    def try_fire(self, method: str, path: str, query: str, user_agent: str) -> bool:
        """Take a token for the request (False: let it through) or count it throttled (True: answer SlowDown)."""
        if self.path_regex is not None and not re.search(self.path_regex, path):
            return False
        direction = "write" if method.upper() in WRITE_METHODS else "read"
        bucket = self._buckets.get(direction)
        if bucket is None:
            return False
        admitted = bucket.admit()
        with self._lock:
            now = time.monotonic()
            self.first_request.setdefault(direction, now)
            if admitted:
                self.admitted[direction] += 1
                self.last_admitted[direction] = now
            else:
                self.throttled[direction] += 1
        return not admitted

    def slowdowns_per_admitted(self, direction: str) -> float:
        return self.throttled[direction] / max(1, self.admitted[direction])

    def goodput(self, direction: str) -> float:
        """The seconds the admitted requests beyond the burst need at the bucket's rate, over the seconds from the
        first request to the last admitted one: 1.0 when the bucket never idled while clients waited."""
        bucket = self._buckets[direction]
        span = self.last_admitted.get(direction, 0.0) - self.first_request.get(direction, 0.0)
        needed = max(0.0, self.admitted[direction] - bucket.capacity) / bucket.rate
        return needed / span if span > 0 else 0.0


@dataclass(frozen=True)
class RecordedRequest:
    """One request seen by the proxy. ``status`` is None when no response was sent (reset/stall).

    ``started``/``ended`` are ``time.monotonic()`` values; ``ended`` is None while in flight.
    """

    method: str
    path: str
    query: str
    status: int | None
    user_agent: str
    fault: str | None
    started: float
    ended: float | None = None
    deleted_keys: tuple[str, ...] = ()  # the keys a DeleteObjects request named (its body, as sent upstream)


# --------------------------------------------------------------------------------------------
# HTTP plumbing
# --------------------------------------------------------------------------------------------


class _GoneError(Exception):
    """A peer closed or broke its connection."""


class _Reader:
    """Buffered reads from a socket (heads, lines, exact lengths)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> bool:
        try:
            data = self.sock.recv(_CHUNK)
        except OSError as exc:
            raise _GoneError(str(exc)) from exc
        if not data:
            return False
        self.buf += data
        return True

    def read_head(self) -> bytes | None:
        """Return one message head (through the blank line); None on clean EOF before any byte."""
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self.buf[: end + 4])
                del self.buf[: end + 4]
                return head
            if len(self.buf) > _MAX_HEAD:
                raise _GoneError("message head too large")
            if not self._fill():
                if self.buf:
                    raise _GoneError("EOF inside message head")
                return None

    def read_line(self) -> bytes:
        """Return one CRLF-terminated line including the CRLF."""
        while True:
            end = self.buf.find(_CRLF)
            if end >= 0:
                line = bytes(self.buf[: end + 2])
                del self.buf[: end + 2]
                return line
            if len(self.buf) > _MAX_HEAD or not self._fill():
                raise _GoneError("EOF or overlong line in chunked body")

    def read_some(self, limit: int) -> bytes:
        """Return 1..limit bytes (b"" on EOF)."""
        if not self.buf and not self._fill():
            return b""
        data = bytes(self.buf[:limit])
        del self.buf[:limit]
        return data


@dataclass
class _Head:
    """A parsed request or response head; ``raw`` is forwarded unchanged."""

    raw: bytes
    first_line: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "

    @classmethod
    def parse(cls, raw: bytes) -> _Head:
        lines = raw.decode("latin-1").split("\r\n")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep:
                raise _GoneError(f"malformed header line {line!r}")
            key = name.strip().lower()
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        return cls(raw, lines[0], headers)

    def has_token(self, name: str, token: str) -> bool:
        """True if comma-separated header ``name`` contains ``token`` (case-insensitive)."""
        return token in (t.strip().lower() for t in self.headers.get(name, "").split(","))


# Body framing: ("length", n), ("chunked", 0) or ("eof", 0).
_Framing = tuple[str, int]


def _request_framing(head: _Head) -> _Framing:
    if head.has_token("transfer-encoding", "chunked"):
        return ("chunked", 0)
    return ("length", int(head.headers.get("content-length", "0") or 0))


def _response_framing(head: _Head, status: int, request_method: str) -> _Framing:
    if request_method == "HEAD" or 100 <= status < 200 or status in (204, 304):
        return ("length", 0)
    if head.has_token("transfer-encoding", "chunked"):
        return ("chunked", 0)
    if "content-length" in head.headers:
        return ("length", int(head.headers["content-length"]))
    return ("eof", 0)


def _iter_body(reader: _Reader, framing: _Framing) -> Iterator[tuple[bytes, bool]]:
    """Yield the raw body bytes as (piece, is_payload); chunk framing comes with is_payload=False."""
    kind, length = framing
    if kind == "length":
        remaining = length
        while remaining > 0:
            piece = reader.read_some(min(remaining, _CHUNK))
            if not piece:
                raise _GoneError(f"EOF with {remaining} body bytes missing")
            remaining -= len(piece)
            yield piece, True
    elif kind == "chunked":
        while True:
            size_line = reader.read_line()
            yield size_line, False
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the final blank line
                    line = reader.read_line()
                    yield line, False
                    if line == _CRLF:
                        return
            remaining = size
            while remaining > 0:
                piece = reader.read_some(min(remaining, _CHUNK))
                if not piece:
                    raise _GoneError("EOF inside chunk")
                remaining -= len(piece)
                yield piece, True
            crlf = reader.read_line()
            if crlf != _CRLF:
                raise _GoneError("bad chunk terminator")
            yield crlf, False
    else:
        while piece := reader.read_some(_CHUNK):
            yield piece, True


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise _GoneError(str(exc)) from exc


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0 so the peer gets a TCP RST (ECONNRESET)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _close(sock: socket.socket | None) -> None:
    """Orderly close (FIN)."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _s3_error_response(fault: Fault, method: str, path: str, close: bool) -> bytes:
    """Build an S3-style XML error response for a ``status`` fault."""
    request_id = uuid.uuid4().hex[:16].upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{_xml_escape(fault.s3_error_code)}</Code>"
        f"<Message>{_xml_escape(fault.message)}</Message>"
        f"<Resource>{_xml_escape(path)}</Resource><RequestId>{request_id}</RequestId></Error>"
    ).encode()
    reason = _REASONS.get(fault.status_code, "Error")
    head = (
        f"HTTP/1.1 {fault.status_code} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        "Server: s3ckpt-fault-proxy\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    ).encode()
    return head if method == "HEAD" else head + body


def _xml_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# --------------------------------------------------------------------------------------------
# The proxy
# --------------------------------------------------------------------------------------------


class FaultProxy:
    """Reverse proxy on 127.0.0.1 in front of ``upstream_url`` that injects faults by rule.

    Starts listening in the constructor; use as a context manager or call ``close()``.
    """

    def __init__(
        self,
        upstream_url: str,
        *,
        port: int = 0,
        connect_timeout: float = 10.0,
        upstream_timeout: float = 300.0,
        directory_buckets: bool = False,
        access_points: dict[str, str] | None = None,
        credentials: tuple[str, str] | None = None,
        seed: int = 0,
        conditional_writes: str = "honour",
    ) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy forwards plain http:// endpoints only, got {upstream_url!r}")
        if conditional_writes not in ("honour", "ignore", "refuse"):
            raise ValueError(f"conditional_writes must be 'honour', 'ignore' or 'refuse', got {conditional_writes!r}")
        self.conditional_writes = conditional_writes
        self._rewriter: _BucketKindRewriter | None = None
        if directory_buckets or access_points or conditional_writes == "ignore":
            if credentials is None:
                raise ValueError(
                    "directory_buckets / access_points / conditional_writes='ignore' re-sign requests: "
                    "pass credentials=(key, secret)"
                )
            self._rewriter = _BucketKindRewriter(
                parts.netloc, credentials, directory_buckets, access_points or {}, seed
            )
            self._rewriter.strip_conditions = conditional_writes == "ignore"
        self.upstream_url = upstream_url
        self._upstream_addr = (parts.hostname, parts.port or 80)
        self._connect_timeout = connect_timeout
        self._upstream_timeout = upstream_timeout
        self._rules: list[FaultRule | RateLimit] = []
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self.connections_accepted = 0
        """Client connections opened so far (keep-alive reuse keeps this low)."""

        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"fault-proxy-{self.port}", daemon=True)
        self._accept_thread.start()

    # ---- public API ---------------------------------------------------------------------------

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_rule(self, rule: FaultRule | RateLimit) -> FaultRule | RateLimit:
        """Append a rule (rules are tried in order; the first that fires wins). Returns it."""
        with self._lock:
            self._rules.append(rule)
        return rule

    def remove_rule(self, rule: FaultRule | RateLimit) -> None:
        """Remove a previously added rule."""
        with self._lock:
            self._rules.remove(rule)

    def clear_rules(self) -> None:
        """Remove all rules; requests are forwarded untouched afterwards."""
        with self._lock:
            self._rules.clear()

    @property
    def requests(self) -> list[RecordedRequest]:
        """Snapshot of all recorded requests in arrival order."""
        with self._lock:
            return [entry.rec for entry in self._entries]

    def count(
        self,
        method: str | None = None,
        query_contains: str | None = None,
        path_regex: str | None = None,
        faulted: bool | None = None,
    ) -> int:
        """Number of recorded requests matching all given filters."""
        return sum(
            1
            for r in self.requests
            if (method is None or r.method == method.upper())
            and (query_contains is None or query_contains in r.query)
            and (path_regex is None or re.search(path_regex, r.path))
            and (faulted is None or (r.fault is not None) == faulted)
        )

    @property
    def open_uploads(self) -> list[tuple[str, str]]:
        """``(bucket, key)`` of the multipart uploads started and not yet completed or aborted (directory mode)."""
        return sorted(self._rewriter.uploads.values()) if self._rewriter is not None else []

    def clear(self) -> None:
        """Forget recorded requests (rules and their counters stay)."""
        with self._lock:
            self._entries = []

    def close(self) -> None:
        """Stop accepting, break all open connections and join the handler threads."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._accept_thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
            threads = list(self._threads)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(timeout=5)

    # ---- internals --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(
                target=self._serve_connection, args=(conn,), name=f"fault-proxy-{self.port}-conn", daemon=True
            )
            with self._lock:
                self._sockets.add(conn)
                self._threads.add(thread)
                self.connections_accepted += 1
            thread.start()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
        if self._stop.is_set():  # opened while close() ran: break it now so the handler ends
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _untrack(self, *socks: socket.socket | None) -> None:
        with self._lock:
            for sock in socks:
                self._sockets.discard(sock)  # type: ignore[arg-type]

    def _record(self, rec: RecordedRequest) -> _Entry:
        entry = _Entry(rec)
        with self._lock:
            self._entries.append(entry)
        return entry

    def _finish(self, entry: _Entry, status: int | None) -> None:
        """Complete a record (first call wins). Called before the last byte goes to the client,
        so a client that has its full response always finds its request finished in ``requests``."""
        with self._lock:
            if not entry.done:
                entry.rec = replace(entry.rec, status=status, ended=time.monotonic())
                entry.done = True

    def _pick_fault(self, method: str, path: str, query: str, user_agent: str) -> Fault | None:
        with self._lock:
            rules = list(self._rules)
        for rule in rules:
            if rule.try_fire(method, path, query, user_agent):
                return rule.action
        return None

    def _serve_connection(self, client: socket.socket) -> None:
        """Handle one client connection: a loop over keep-alive requests."""
        conn = _Connection(self, client)
        try:
            conn.run()
        finally:
            conn.close()
            with self._lock:
                self._threads.discard(threading.current_thread())


@dataclass
class _Entry:
    """Mutable holder of one record while its request is in flight."""

    rec: RecordedRequest
    done: bool = False


class _Connection:
    """One client connection and its (lazily opened) upstream connection."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.creader = _Reader(client)
        self.upstream: socket.socket | None = None
        self.ureader: _Reader | None = None
        self.client_open = True
        self.entry: _Entry | None = None

    def _done(self, status: int | None) -> None:
        """Finish the current request's record (before its last byte is sent)."""
        if self.entry is not None:
            self.proxy._finish(self.entry, status)

    def close(self) -> None:
        self.proxy._untrack(self.client, self.upstream)
        self._close_upstream()
        if self.client_open:
            _close(self.client)
            self.client_open = False

    def _reset_client(self) -> None:
        self.proxy._untrack(self.client)
        _reset(self.client)
        self.client_open = False

    def _close_upstream(self) -> None:
        if self.upstream is not None:
            self.proxy._untrack(self.upstream)
            _close(self.upstream)
        self.upstream = None
        self.ureader = None

    def _upstream_dropped(self) -> bool:
        """True if the idle upstream connection was closed by the server."""
        assert self.upstream is not None
        try:
            readable, _, _ = select.select([self.upstream], [], [], 0)
            if not readable:
                return False
            return self.upstream.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _connect_upstream(self) -> None:
        if self.upstream is not None and not self._upstream_dropped():
            return
        self._close_upstream()
        sock = socket.create_connection(self.proxy._upstream_addr, timeout=self.proxy._connect_timeout)
        sock.settimeout(self.proxy._upstream_timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.upstream = sock
        self.ureader = _Reader(sock)
        self.proxy._track(sock)

    def run(self) -> None:
        while self.client_open and not self.proxy._stop.is_set():
            try:
                raw = self.creader.read_head()
            except _GoneError:
                return
            if raw is None:
                return
            try:
                head = _Head.parse(raw)
                method, target, version = head.first_line.split(" ", 2)
            except (ValueError, _GoneError):
                _send_quietly(self.client, _simple_response(400, "Bad Request"))
                return
            if not self._handle(head, method.upper(), target, version):
                return

    def _handle(self, head: _Head, method: str, target: str, version: str) -> bool:
        """Serve one request; return False when the client connection must end."""
        parts = urlsplit(target)
        path = unquote(parts.path)
        user_agent = head.headers.get("user-agent", "")
        routed = self.proxy._rewriter.route(head, method, target) if self.proxy._rewriter is not None else None
        if routed is not None:  # rules and records see the upstream's path-style path
            path = unquote(urlsplit(routed.head.first_line.split(" ")[1]).path)
        fault = self.proxy._pick_fault(method, path, parts.query, user_agent)
        conditional = method in ("PUT", "POST") and ("if-match" in head.headers or "if-none-match" in head.headers)
        if fault is None and conditional and self.proxy.conditional_writes == "refuse":
            fault = _REFUSED_CONDITIONS
        label = fault.describe() if fault else (routed.label if routed is not None else None)
        if fault is _REFUSED_CONDITIONS:
            label = "conditional:refused"
        self.entry = self.proxy._record(
            RecordedRequest(
                method=method,
                path=path,
                query=parts.query,
                status=None,
                user_agent=user_agent,
                fault=label,
                started=time.monotonic(),
            )
        )
        status: int | None = None
        try:
            if fault is not None and not fault.needs_upstream:
                status, keep = self._local_fault(fault, head, method, path, version)
            elif routed is not None and routed.local is not None:
                self._consume_request_body(head)
                status, keep = routed.local_status, True
                self._done(status)
                _send(self.client, routed.local)
            else:
                status, keep = self._forward(routed.head if routed else head, method, fault, routed)
        except (_GoneError, ValueError) as exc:  # ValueError: unparsable length/status from a peer
            log.debug("%s %s ended the connection: %s", method, target, exc)
            keep = False
        except OSError as exc:  # e.g. upstream refused the connection
            log.debug("%s %s upstream error: %r", method, target, exc)
            if status is None:
                status = 502
                _send_quietly(self.client, _simple_response(502, "Bad Gateway"))
            keep = False
        finally:
            self._done(status)
        return keep

    # ---- faults answered by the proxy itself ---------------------------------------------------

    def _consume_request_body(self, head: _Head, limit: int | None = None) -> None:
        """Read (and drop) the request body, sending our own 100 Continue when the client waits for one."""
        framing = _request_framing(head)
        if framing == ("length", 0):
            return
        if head.has_token("expect", "100-continue"):
            _send(self.client, b"HTTP/1.1 100 Continue\r\n\r\n")
        seen = 0
        for piece, _ in _iter_body(self.creader, framing):
            seen += len(piece)
            if limit is not None and seen >= limit:
                return

    def _local_fault(self, fault: Fault, head: _Head, method: str, path: str, version: str) -> tuple[int | None, bool]:
        if fault.kind == "reset_mid_request":
            framing = _request_framing(head)
            limit = fault.n_bytes
            if limit is None:
                limit = max(1, framing[1] // 2) if framing[0] == "length" else 1
            self._consume_request_body(head, limit)
            self._done(None)
            self._reset_client()
            return None, False
        self._consume_request_body(head)
        if fault.kind == "status":
            close = head.has_token("connection", "close") or version == "HTTP/1.0"
            self._done(fault.status_code)
            _send(self.client, _s3_error_response(fault, method, path, close))
            return fault.status_code, not close
        if fault.kind == "reset_before_response":
            self._done(None)
            self._reset_client()
            return None, False
        if fault.kind == "stall":
            self.proxy._stop.wait(fault.seconds)
            return None, False
        raise ValueError(f"unknown fault kind {fault.kind!r}")

    # ---- forwarding -----------------------------------------------------------------------------

    def _forward(
        self, head: _Head, method: str, fault: Fault | None, routed: _Routed | None = None
    ) -> tuple[int | None, bool]:
        """Forward one request upstream and relay the response (applying a response fault)."""
        self._connect_upstream()
        assert self.upstream is not None and self.ureader is not None
        _send(self.upstream, head.raw)
        framing = _request_framing(head)
        has_body = framing != ("length", 0)

        if has_body and head.has_token("expect", "100-continue"):
            final = self._await_continue()
            if final is not None:
                # Upstream answered before asking for the body: relay that answer; the client may or
                # may not send the body now, so this connection cannot be reused safely.
                status, _ = self._relay_response(final, method, fault, routed)
                return status, False
        capture = method == "POST" and "?delete" in head.first_line.split(" ")[1] and self.entry is not None
        body = bytearray()
        if has_body:
            try:
                for piece, _ in _iter_body(self.creader, framing):
                    if capture:
                        body += piece
                    _send(self.upstream, piece)
                if capture and self.entry is not None:  # which keys a DeleteObjects names: what a removal touched
                    found = re.findall(r"<Key>(.*?)</Key>", body.decode(errors="replace"))
                    named = tuple(html.unescape(key) for key in found)
                    with self.proxy._lock:
                        self.entry.rec = replace(self.entry.rec, deleted_keys=named)
            except _GoneError:
                # Either side broke off. If the client vanished there is nothing to do; if the
                # upstream stopped reading it may still have sent an answer, which we try to relay.
                if not self._upstream_has_data():
                    raise
        resp = self._read_final_response_head()
        return self._relay_response(resp, method, fault, routed)

    def _upstream_has_data(self) -> bool:
        assert self.upstream is not None and self.ureader is not None
        if self.ureader.buf:
            return True
        try:
            return bool(select.select([self.upstream], [], [], 1.0)[0])
        except OSError:
            return False

    def _await_continue(self) -> _Head | None:
        """For ``Expect: 100-continue``: wait until the upstream answers or the client starts the body.

        Relays an interim 1xx to the client and returns None (go on with the body), or returns the
        upstream's final response head if it answered without reading the body.
        """
        assert self.upstream is not None and self.ureader is not None
        deadline = time.monotonic() + self.proxy._upstream_timeout
        while not self.proxy._stop.is_set() and time.monotonic() < deadline:
            if self.creader.buf:
                return None  # client already sent body bytes (it gave up waiting)
            if self.ureader.buf:
                readable = [self.upstream]
            else:
                readable, _, _ = select.select([self.upstream, self.client], [], [], 0.2)
            if self.upstream in readable:
                raw = self.ureader.read_head()
                if raw is None:
                    raise _GoneError("upstream closed before answering")
                resp = _Head.parse(raw)
                if _status_of(resp) < 200:
                    _send(self.client, resp.raw)
                    return None
                return resp
            if self.client in readable:
                return None
        raise _GoneError("timed out waiting for 100 Continue")

    def _read_final_response_head(self) -> _Head:
        """Read upstream response heads, relaying interim 1xx ones, until the final one."""
        assert self.ureader is not None
        while True:
            raw = self.ureader.read_head()
            if raw is None:
                raise _GoneError("upstream closed without a response")
            resp = _Head.parse(raw)
            if _status_of(resp) >= 200 or _status_of(resp) == 101:
                return resp
            _send(self.client, resp.raw)

    def _relay_response(
        self, resp: _Head, method: str, fault: Fault | None, routed: _Routed | None = None
    ) -> tuple[int, bool]:
        """Send the final response head and body to the client; returns (status, keep_alive)."""
        assert self.ureader is not None
        status = _status_of(resp)
        framing = _response_framing(resp, status, method)
        if routed is not None and self.proxy._rewriter is not None:
            resp, transform = self.proxy._rewriter.response(routed, resp, status)
            if transform is not None and method != "HEAD":
                return self._relay_rewritten(resp, status, framing, transform)
        keep = not (
            resp.has_token("connection", "close")
            or framing[0] == "eof"
            or (resp.first_line.startswith("HTTP/1.0") and not resp.has_token("connection", "keep-alive"))
        )
        body_len = framing[1] if framing[0] == "length" else None

        cut_at: int | None = None  # payload bytes after which we stop
        reset = False
        if fault is not None and fault.kind == "truncate_body":
            cut_at = fault.n_bytes or 0
        elif fault is not None and fault.kind == "reset_mid_response":
            cut_at = fault.n_bytes if fault.n_bytes is not None else (body_len // 2 if body_len else 0)
            reset = True
        corrupt_at = fault.offset if fault is not None and fault.kind == "corrupt_body" else None

        if framing == ("length", 0) or (cut_at is not None and cut_at <= 0):
            self._done(status)
        _send(self.client, resp.raw)
        if cut_at is not None and cut_at <= 0:
            return self._cut(status, reset)
        sent = 0
        pending = b""  # one piece held back so the record is finished before the last byte goes out
        for piece, is_payload in _iter_body(self.ureader, framing):
            if is_payload:
                if corrupt_at is not None and sent <= corrupt_at < sent + len(piece):
                    buf = bytearray(piece)
                    buf[corrupt_at - sent] ^= 0xFF
                    piece = bytes(buf)
                if cut_at is not None and sent + len(piece) >= cut_at:
                    self._done(status)
                    _send(self.client, pending + piece[: cut_at - sent])
                    return self._cut(status, reset)
                sent += len(piece)
            if pending:
                _send(self.client, pending)
            pending = piece
        self._done(status)
        if pending:
            _send(self.client, pending)
        if cut_at is not None:  # body shorter than the cut point: still end the connection abruptly
            return self._cut(status, reset)
        if not keep:
            self._close_upstream()
        return status, keep

    def _relay_rewritten(
        self, resp: _Head, status: int, framing: _Framing, transform: Callable[[bytes], bytes]
    ) -> tuple[int, bool]:
        """Read the whole (small, XML) body, rewrite it and send it with its new length."""
        assert self.ureader is not None
        body = transform(b"".join(piece for piece, is_payload in _iter_body(self.ureader, framing) if is_payload))
        first, pairs = _header_lines(resp.raw)
        pairs = [(n, v) for n, v in pairs if n.lower() not in ("content-length", "transfer-encoding")]
        pairs.append(("Content-Length", str(len(body))))
        keep = framing[0] != "eof" and not resp.has_token("connection", "close")
        self._done(status)
        _send(self.client, _build_head(first, pairs).raw + body)
        if not keep:
            self._close_upstream()
        return status, keep

    def _cut(self, status: int, reset: bool) -> tuple[int, bool]:
        """End a truncated response: RST (reset) or FIN (truncate) to the client; drop upstream."""
        self._close_upstream()
        if reset:
            self._reset_client()
        else:
            self.proxy._untrack(self.client)
            _close(self.client)
            self.client_open = False
        return status, False


def _status_of(head: _Head) -> int:
    try:
        return int(head.first_line.split(" ", 2)[1])
    except (IndexError, ValueError) as exc:
        raise _GoneError(f"malformed status line {head.first_line!r}") from exc


def _simple_response(code: int, reason: str) -> bytes:
    """An empty response that closes the connection (malformed request, unreachable upstream)."""
    return f"HTTP/1.1 {code} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# Bucket kinds: directory-bucket behaviour, access point names, re-signing
# --------------------------------------------------------------------------------------------

_UNSIGNED_HEADERS = ("host", "authorization", "x-amz-s3session-token", "proxy-connection", "proxy-authorization")
_ETAG_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_UNKNOWN_ETAG = '"s3ckpt-proxy-unknown-etag"'
_PREFIX_NOT_DELIMITED = (
    "This bucket does not support a prefix that does not end in a delimiter. "
    "Specify a prefix path ending with a delimiter and try again."
)


@dataclass
class _Routed:
    """Where a request goes upstream, as the rewriter decided; ``local`` is an answer given without the upstream."""

    head: _Head
    bucket: str
    key: str
    query: dict[str, list[str]]
    method: str
    local: bytes | None = None
    local_status: int = 0
    label: str | None = None  # recorded as the request's fault, e.g. "directory:prefix-not-delimited"


def _header_lines(raw: bytes) -> tuple[str, list[tuple[str, str]]]:
    lines = raw.decode("latin-1").split("\r\n")
    pairs = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            pairs.append((name.strip(), value.strip()))
    return lines[0], pairs


def _build_head(first_line: str, pairs: list[tuple[str, str]]) -> _Head:
    raw = (first_line + "\r\n" + "".join(f"{name}: {value}\r\n" for name, value in pairs) + "\r\n").encode("latin-1")
    return _Head.parse(raw)


def _is_ip_or_localhost(hostname: str) -> bool:
    return hostname == "localhost" or bool(re.fullmatch(r"[0-9.]+|\[[0-9a-fA-F:.]+\]", hostname))


def _canonical_query(raw_query: str) -> str:
    pairs = []
    for item in raw_query.split("&") if raw_query else []:
        name, _, value = item.partition("=")
        pairs.append((quote(unquote(name), safe="-_.~"), quote(unquote(value), safe="-_.~")))
    return "&".join(f"{name}={value}" for name, value in sorted(pairs))


def _sigv4_authorization(
    method: str,
    raw_path: str,
    raw_query: str,
    headers: dict[str, str],
    signed: list[str],
    secret_key: str,
    access_key: str,
    region: str,
) -> str:
    """The ``Authorization`` value for a request, signed for service ``s3`` with the given keys (SigV4)."""
    amz_date = headers["x-amz-date"]
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    canonical_headers = "".join(f"{name}:{' '.join(headers[name].split())}\n" for name in signed)
    payload = headers.get("x-amz-content-sha256", "UNSIGNED-PAYLOAD")
    canonical = "\n".join(
        [method, raw_path or "/", _canonical_query(raw_query), canonical_headers, ";".join(signed), payload]
    )
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = f"AWS4{secret_key}".encode()
    for part in (amz_date[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    return f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={';'.join(signed)}, Signature={signature}"


class _BucketKindRewriter:
    """Turns what a client sends for a directory bucket or an access point into path-style requests the upstream
    serves, re-signed with the upstream's keys, and makes the answers look like S3 Express One Zone's."""

    def __init__(
        self,
        upstream_host: str,
        credentials: tuple[str, str],
        directory_buckets: bool,
        access_points: dict[str, str],
        seed: int,
    ) -> None:
        self.upstream_host = upstream_host
        self.access_key, self.secret_key = credentials
        self.directory_buckets = directory_buckets
        self.access_points = dict(access_points)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._fake_etags: dict[tuple[str, str, str], str] = {}  # (bucket, key, upstream ETag) -> the client's
        self._real_etags: dict[str, str] = {}  # the client's ETag -> the upstream's
        self.uploads: dict[str, tuple[str, str]] = {}  # in-progress multipart uploads: id -> (bucket, key)
        self.strip_conditions = False  # conditional_writes="ignore": drop If-Match / If-None-Match from writes

    # ---- requests -------------------------------------------------------------------------------

    def route(self, head: _Head, method: str, target: str) -> _Routed:
        parts = urlsplit(target)
        host = parts.netloc or head.headers.get("host", "")
        hostname = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        raw_path = parts.path or "/"
        if "." in hostname and not _is_ip_or_localhost(hostname):  # virtual-hosted: the bucket is the first label
            bucket = hostname.split(".", 1)[0]
            rest = "" if raw_path == "/" else raw_path
        else:
            bucket, _, tail = raw_path.lstrip("/").partition("/")
            bucket = unquote(bucket)
            rest = "/" + tail if (tail or raw_path.endswith(bucket + "/")) else ""
        bucket = self.access_points.get(bucket, bucket)
        key = unquote(rest.lstrip("/"))
        query = parse_qs(parts.query, keep_blank_values=True)
        upstream_path = f"/{quote(bucket)}{rest}" if bucket else (rest or "/")
        _, pairs = _header_lines(head.raw)
        signed_by_client: list[str] = []
        region = "us-east-1"
        kept: list[tuple[str, str]] = []
        stripped = False
        for name, value in pairs:
            lower = name.lower()
            if self.strip_conditions and method in ("PUT", "POST") and lower in ("if-match", "if-none-match"):
                stripped = True
                continue
            if lower == "authorization":
                match = re.search(r"Credential=[^/]+/\d{8}/([^/]+)/[^,]+, ?SignedHeaders=([^,]+)", value)
                if match:
                    region, signed_by_client = match.group(1), match.group(2).split(";")
                continue
            if lower in _UNSIGNED_HEADERS:
                continue
            if self.directory_buckets and lower in ("if-match", "if-none-match"):
                value = ", ".join(self._upstream_etag(tag.strip()) for tag in value.split(","))
            kept.append((name, value))
        kept.insert(0, ("Host", self.upstream_host))
        first = f"{method} {upstream_path}{'?' + parts.query if parts.query else ''} HTTP/1.1"
        if signed_by_client:
            values = {name.lower(): value for name, value in kept}
            signed = sorted({n for n in signed_by_client if n in values and n not in _UNSIGNED_HEADERS} | {"host"})
            authorization = _sigv4_authorization(
                method, upstream_path, parts.query, values, signed, self.secret_key, self.access_key, region
            )
            kept.append(("Authorization", authorization))
        routed = _Routed(_build_head(first, kept), bucket, key, query, method)
        if stripped:
            routed.label = "conditional:ignored"
        if self.directory_buckets:
            self._answer_locally(routed)
        return routed

    def _answer_locally(self, routed: _Routed) -> None:
        """What S3 Express answers without the store: CreateSession, and its refusal of undelimited listings."""
        if routed.method == "GET" and not routed.key and "session" in routed.query:
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
            routed.local = _xml_response(
                200,
                "<CreateSessionResult><Credentials>"
                f"<SessionToken>s3ckpt-proxy-session</SessionToken><SecretAccessKey>{self.secret_key}"
                f"</SecretAccessKey><AccessKeyId>{self.access_key}</AccessKeyId><Expiration>{expires}</Expiration>"
                "</Credentials></CreateSessionResult>",
            )
            routed.local_status = 200
        elif routed.method == "GET" and not routed.key and routed.query.get("list-type") == ["2"]:
            prefix = routed.query.get("prefix", [""])[0]
            delimiter = routed.query.get("delimiter", [""])[0]
            problem = None
            if prefix and not prefix.endswith("/"):
                problem = _PREFIX_NOT_DELIMITED
            elif delimiter and delimiter != "/":
                problem = "This bucket supports only '/' as a delimiter."
            if problem:
                body = f"<Error><Code>InvalidRequest</Code><Message>{_xml_escape(problem)}</Message></Error>"
                routed.local = _xml_response(400, body)
                routed.local_status, routed.label = 400, "directory:prefix-not-delimited"

    # ---- ETags ----------------------------------------------------------------------------------

    def _client_etag(self, bucket: str, key: str, upstream: str) -> str:
        with self._lock:
            identity = (bucket, key, upstream.strip('"'))
            fake = self._fake_etags.get(identity)
            if fake is None:
                fake = '"' + "".join(self._rng.choice(_ETAG_ALPHABET) for _ in range(32)) + '"'
                self._fake_etags[identity] = fake
                self._real_etags[fake] = upstream if upstream.startswith('"') else f'"{upstream}"'
            return fake

    def _upstream_etag(self, tag: str) -> str:
        if tag == "*":
            return tag
        with self._lock:
            return self._real_etags.get(tag if tag.startswith('"') else f'"{tag}"', _UNKNOWN_ETAG)

    # ---- responses ------------------------------------------------------------------------------

    def response(self, routed: _Routed, resp: _Head, status: int) -> tuple[_Head, Callable[[bytes], bytes] | None]:
        """The head to send the client, and how to rewrite the body (None: relay it as it comes)."""
        if not self.directory_buckets or not 200 <= status < 300:
            return resp, None
        query, method = routed.query, routed.method
        if method == "GET" and not routed.key and query.get("list-type") == ["2"]:
            return resp, lambda body: self._listing(routed, body)
        if method == "POST" and "uploads" in query:
            return resp, lambda body: self._upload_started(routed, body)
        if method == "POST" and "uploadId" in query:
            return resp, lambda body: self._upload_completed(routed, body)
        if method == "DELETE" and "uploadId" in query:
            with self._lock:
                self.uploads.pop(query["uploadId"][0], None)
            return resp, None
        if routed.key and method in ("GET", "HEAD", "PUT") and "uploadId" not in query and "etag" in resp.headers:
            first, pairs = _header_lines(resp.raw)
            pairs = [
                (n, self._client_etag(routed.bucket, routed.key, v) if n.lower() == "etag" else v) for n, v in pairs
            ]
            return _build_head(first, pairs), None
        return resp, None

    def _upload_started(self, routed: _Routed, body: bytes) -> bytes:
        text = body.decode()
        upload = re.search(r"<UploadId>(.*?)</UploadId>", text)
        if upload:
            with self._lock:
                self.uploads[html.unescape(upload.group(1))] = (routed.bucket, routed.key)
        return body

    def _upload_completed(self, routed: _Routed, body: bytes) -> bytes:
        text = body.decode()
        if "<CompleteMultipartUploadResult" not in text:
            return body  # an error inside a 200: leave it to the client
        with self._lock:
            self.uploads.pop(routed.query["uploadId"][0], None)
        return self._replace_etag(text, routed.bucket, routed.key).encode()

    def _replace_etag(self, text: str, bucket: str, key: str) -> str:
        def swap(match: re.Match[str]) -> str:
            fake = self._client_etag(bucket, key, html.unescape(match.group(1)))
            return f"<ETag>{_xml_escape(fake).replace(chr(34), '&quot;')}</ETag>"

        return re.sub(r"<ETag>(.*?)</ETag>", swap, text, flags=re.S)

    def _listing(self, routed: _Routed, body: bytes) -> bytes:
        """Shuffle the objects, give them this proxy's ETags, add the prefixes of in-progress uploads."""
        text = body.decode()
        contents = re.findall(r"<Contents>.*?</Contents>", text, flags=re.S)
        rewritten = []
        url_encoded = routed.query.get("encoding-type") == ["url"]
        for item in contents:
            found = re.search(r"<Key>(.*?)</Key>", item, flags=re.S)
            key = html.unescape(found.group(1)) if found else ""
            rewritten.append(self._replace_etag(item, routed.bucket, unquote_plus(key) if url_encoded else key))
        with self._lock:
            self._rng.shuffle(rewritten)
        if contents:
            first = text.index(contents[0])
            text = text[:first] + "\x00" + text[first:]
            for item in contents:
                text = text.replace(item, "", 1)
            text = text.replace("\x00", "".join(rewritten), 1)
        prefixes = self._upload_prefixes(routed)
        existing = set(re.findall(r"<CommonPrefixes><Prefix>(.*?)</Prefix></CommonPrefixes>", text))
        added = "".join(
            f"<CommonPrefixes><Prefix>{_xml_escape(p)}</Prefix></CommonPrefixes>"
            for p in sorted(prefixes)
            if _xml_escape(p) not in existing
        )
        return text.replace("</ListBucketResult>", added + "</ListBucketResult>", 1).encode()

    def _upload_prefixes(self, routed: _Routed) -> set[str]:
        prefix = routed.query.get("prefix", [""])[0]
        delimited = routed.query.get("delimiter", [""])[0] == "/"
        with self._lock:
            keys = [key for bucket, key in self.uploads.values() if bucket == routed.bucket]
        found = set()
        for key in keys:
            if not key.startswith(prefix):
                continue
            if delimited:
                head, sep, _ = key[len(prefix) :].partition("/")
                if sep:
                    found.add(prefix + head + "/")
            else:  # every "directory" the upload is in, from the listed one down
                parts = key.split("/")[:-1]
                for depth in range(1, len(parts) + 1):
                    candidate = "/".join(parts[:depth]) + "/"
                    if candidate.startswith(prefix):
                        found.add(candidate)
        return found


def _xml_response(status: int, body: str) -> bytes:
    data = ('<?xml version="1.0" encoding="UTF-8"?>\n' + body).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(data)}\r\nServer: s3ckpt-fault-proxy\r\n\r\n"
    ).encode()
    return head + data


__all__ = ["Fault", "FaultProxy", "FaultRule", "RecordedRequest"]


def _demo(argv: list[str] | None = None) -> None:  # pragma: no cover - manual use only
    """``python tests/fault_proxy.py http://127.0.0.1:PORT``: run a pass-through proxy until Ctrl-C."""
    import sys

    args = argv if argv is not None else sys.argv[1:]
    with FaultProxy(args[0]) as proxy:
        print(f"proxy {proxy.endpoint_url} -> {proxy.upstream_url}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":  # pragma: no cover
    _demo()

"""Retries and the request pacer: what this process does when S3 fails a request or answers SlowDown.

A core file, standard library only (botocore's exceptions are looked up where it is installed), imported by s3_utils
(whose `S3Utils.with_retries` sends every request through the process's `RequestPacer`, made by
`s3_utils.request_pacer`, and retries it under a `RetryPolicy`). Four parts:

1. `RequestRates`: a job-wide budget of requests per second, from a number, a ``write=N,read=M`` string or a mapping.
2. Throttling answers: `is_throttling_error` (S3's ``SlowDown`` and its kin).
3. Retries: `RetryPolicy` (attempts, time, backoff), `CallRetries` (one call's decision after each failure: wait how
   long, or give up), `is_retriable_error` (throttling, 5xx, timeouts, resets; never a credentials error).
4. The pacer: `PacerLane`, an adaptive token bucket for one direction (writes or reads), and `RequestPacer`, the two
   lanes of one process for one bucket, or for one spread prefix of it (``run/s3ckpt-spread-03/``: S3 serves each
   from a partition of its own, so each is paced apart). A lane may keep its state in a store shared by the job's
   processes on the host (`SharedLaneStore`; ``s3_node_sharing.SharedPacerFile`` is one), so a process learns from
   its neighbours' SlowDowns too.

Why and with what figures: docs/scale.md ("Under S3 throttling"); benchmarks/s3_sim.py simulates thousands of ranks
with these very classes (their clock is an argument).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

if __package__:
    from . import s3_process as _process
else:  # installed (or copied) as a top-level module
    import s3_process as _process

__all__ = ["PacerLane", "RequestPacer", "RequestRates", "RetryPolicy"]

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------------------------
# Budgets
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestRates:
    """A job-wide budget of requests per second: `write` (PUT, POST, DELETE), `read` (GET, HEAD); None: no budget."""

    write: float | None = None
    read: float | None = None

    def __post_init__(self) -> None:
        for name in ("write", "read"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"max_requests_per_second: {name} must be a positive number, got {value!r}")
            object.__setattr__(self, name, float(value))

    @classmethod
    def from_value(cls, value: float | str | Mapping[str, float] | RequestRates | None) -> RequestRates | None:
        """A budget from a number, a ``write=..,read=..`` string or a mapping with keys ``write`` / ``read``."""
        if value is None or isinstance(value, RequestRates):
            return value
        if isinstance(value, str):
            text = value.strip()
            pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
            problem = f"max_requests_per_second must be a number or 'write=N,read=M', got {value!r}"
            try:
                if "=" not in text:
                    value = dict.fromkeys(("write", "read"), float(text))
                elif all(len(pair) == 2 for pair in pairs):
                    value = {key.strip(): float(number) for key, number in pairs}
                else:
                    raise ValueError(text)
            except ValueError:
                raise ValueError(problem) from None
        if isinstance(value, Mapping):
            unknown = sorted(str(key) for key in value if key not in ("write", "read"))
            if unknown:
                raise ValueError(f"max_requests_per_second takes the keys 'write' and 'read', got {unknown}")
            rates = cls(value.get("write"), value.get("read"))
            return rates if (rates.write, rates.read) != (None, None) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"max_requests_per_second must be a number or a mapping, got {type(value).__name__}")
        return cls(value, value)



# --------------------------------------------------------------------------------------------------------------------
# Throttling answers: what the pacer slows down for
# --------------------------------------------------------------------------------------------------------------------

# botocore's list (retries/standard.py's _THROTTLED_ERROR_CODES) less the DynamoDB-only codes: copied, as that name is
# private (tests/test_private_surface.py checks that botocore's lists have not grown past RETRIABLE_ERROR_CODES).
THROTTLING_ERROR_CODES = frozenset(  # Package-internal (docs/api.md)
    {
        *("SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled"),
        *("RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded"),
        *("EC2ThrottledException", "PriorRequestNotComplete"),
    }
)
"""The codes that mean "too many requests" (as do HTTP 429 and 503): paced, not counted
(``s3_utils.S3Utils.with_retries``). Package-internal (docs/api.md)."""

_THROTTLING_HTTP_STATUSES = frozenset({429, 503})


def is_throttling_error(exc: BaseException) -> bool:
    """True for S3's "slow down" answers: a throttling code (`THROTTLING_ERROR_CODES`) or HTTP 429 / 503.
    Package-internal (docs/api.md): the API's name is ``s3_utils.is_throttling_error``."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return response.get("Error", {}).get("Code") in THROTTLING_ERROR_CODES or status in _THROTTLING_HTTP_STATUSES


# --------------------------------------------------------------------------------------------------------------------
# Retries: which failures are retried, and how long a call waits after each
# --------------------------------------------------------------------------------------------------------------------

# botocore's own lists (retries/standard.py's _THROTTLED_ERROR_CODES: THROTTLING_ERROR_CODES above, and
# _TRANSIENT_ERROR_CODES, retries/special.py's IDPCommunicationError) less the DynamoDB-only codes, plus S3's 5xx
# codes: copied, as those names are private (tests/test_private_surface.py checks that botocore's lists have not grown
# past these).
RETRIABLE_ERROR_CODES = THROTTLING_ERROR_CODES | frozenset(
    {
        *("ServiceUnavailable", "InternalError", "InternalFailure", "RequestTimeout", "RequestTimeoutException"),
        "IDPCommunicationError",
        "ConditionalRequestConflict",  # 409: a conditional write raced another one on the key; S3 says retry
    }
)
"""S3 error codes that mean "try again later" (throttling, server-side and transient errors)."""

RETRIABLE_HTTP_STATUSES = frozenset({500, 502, 503, 504})


class TransientTransferError(IOError):
    """A response ended early or was shorter than promised; retrying the request may succeed. Package-internal
    (docs/api.md)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How every S3 request is retried: exponential backoff, full jitter, bounded by attempts and time (or paced)."""

    max_attempts: int = 8  # attempts per call, the first included (1 disables retries)
    max_elapsed_s: float = 120.0  # no attempt starts this long after the first (throttling: after a success)
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 20.0  # the longest backoff; the pacer never spaces requests further apart

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_elapsed_s <= 0 or self.initial_backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"RetryPolicy times must be positive: {self}")


class CallRetries:
    """One call's failed attempts under a `RetryPolicy`: `after_failure` says how long to wait, or to give up. Times
    are the caller's (`S3Utils.with_retries` reads ``time.monotonic``; benchmarks/s3_sim.py its simulated clock).
    Package-internal (docs/api.md)."""

    def __init__(self, policy: RetryPolicy, started: float) -> None:
        self.policy, self.started = policy, started
        self.attempts = self.counted = 0  # failed attempts; those that count against ``max_attempts``
        self.first_counted = 0.0

    def after_failure(self, sent: float, now: float, throttled: bool, last_success: float) -> float | None:
        """Seconds until the next attempt of a retriable failure sent at `sent` (0.0: when the pacer allows), or None
        to give up. A throttling answer counts no attempt: it gives up after ``max_elapsed_s`` without a success
        (`last_success`: its pacer lane's); other errors back off exponentially with full jitter."""
        policy = self.policy
        self.attempts += 1
        if throttled:
            return None if now - max(self.started, last_success) >= policy.max_elapsed_s else 0.0
        self.counted += 1
        self.first_counted = self.first_counted or sent
        delay = random.uniform(0.0, min(policy.max_backoff_s, policy.initial_backoff_s * 2.0 ** (self.counted - 1)))
        give_up = self.counted >= policy.max_attempts or now + delay - self.first_counted >= policy.max_elapsed_s
        return None if give_up else delay


def is_retriable_error(exc: BaseException) -> bool:
    """True for throttling, 5xx, timeouts, connection resets and unparsable replies; False for anything else.
    Package-internal (docs/api.md)."""
    if isinstance(exc, TransientTransferError):
        return True
    try:
        bexc = _process.import_optional_dependency("botocore.exceptions", "S3 access")
    except _process.MissingOptionalDependencyError:
        return isinstance(exc, (ConnectionError, TimeoutError))
    if isinstance(exc, bexc.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error.get("Code") in RETRIABLE_ERROR_CODES or status in RETRIABLE_HTTP_STATUSES
    if isinstance(exc, (bexc.SSLError, bexc.NoCredentialsError, bexc.PartialCredentialsError)):
        return False
    if isinstance(
        exc,
        (
            bexc.ConnectionError,  # endpoint unreachable, connect timeout, proxy errors
            bexc.HTTPClientError,  # connection closed, read timeout, broken response stream
            bexc.IncompleteReadError,
            http.client.IncompleteRead,  # a body that ended early, read straight from the socket
            ConnectionError,  # ConnectionResetError and friends, raised while streaming a body
            TimeoutError,
        ),
    ):
        return True
    parsers = _process.optional_module("botocore.parsers")
    if parsers is not None and isinstance(exc, parsers.ResponseParserError):
        return True  # a reply whose XML is cut or garbled (a throttled store, a proxy in between): botocore says so
    urllib3_exceptions = _process.optional_module("urllib3.exceptions")
    return urllib3_exceptions is not None and isinstance(
        exc, (urllib3_exceptions.ProtocolError, urllib3_exceptions.ReadTimeoutError)
    )


def error_code(exc: BaseException) -> str:
    """S3's error code of a botocore error (``"NoSuchKey"``, ``"SlowDown"``...), else the exception's class name.
    Package-internal (docs/api.md)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return type(exc).__name__


# --------------------------------------------------------------------------------------------------------------------
# The pacer: lanes, their state shared on a host, and one process's pacer of a bucket (or of a spread prefix)
# --------------------------------------------------------------------------------------------------------------------


class PacerLaneState(NamedTuple):
    """What a `PacerLane` keeps in its host's shared state (`SharedLaneStore`), loaded and stored under its lock.
    Package-internal (docs/api.md)."""

    active: bool
    rate: float
    tokens: float
    refilled_at: float
    epoch: float
    changed_at: float
    streak: float
    last_success: float
    throttles: int
    activations: int
    sends: tuple[float, ...]  # send times (oldest first), the newest 64


class SharedLaneStore(Protocol):
    """The host-shared state behind the lanes of a `RequestPacer` (``s3_node_sharing.SharedPacerFile``).
    Package-internal (docs/api.md)."""

    processes: int  # the processes using the state, as of the last `locked` section

    def locked(self) -> contextlib.AbstractContextManager[None]: ...
    def load(self, lane: int) -> PacerLaneState: ...
    def store(self, lane: int, state: PacerLaneState) -> None: ...
    def active_flag(self, lane: int) -> tuple[Any, int]: ...
    def last_success(self, lane: int) -> float: ...


_alone = threading.local()  # `sending_alone`'s depth in this thread


@contextlib.contextmanager
def sending_alone() -> Iterator[None]:
    """Within it, this thread's requests do not wait for a budget's share: they are requests one process sends while
    the rest of the job sends none (a DCP save's commit, once every rank's files are written), which a share of the
    budget over the job's processes (3,500 / 16,384 writes per second) would hold back for seconds. A lane that S3
    has throttled paces them as before. Package-internal (docs/api.md)."""
    depth = getattr(_alone, "depth", 0)
    _alone.depth = depth + 1
    try:
        yield
    finally:
        _alone.depth = depth


class PacerLane:
    """One direction (reads or writes) of a `RequestPacer`: a token bucket whose rate adapts to S3's answers.

    Dormant until the first throttling answer or a budget. The rate starts at `BETA` times the send rate, drops by
    `BETA` on a throttling answer to a request sent after the last drop, and grows on each success (faster when slow,
    on a long run, and the longer since the last drop: `QUIET_S`; plus `CATCH_UP` for fairness), within
    ``[floor, 2 x send rate]`` and the budget's share. A lane whose requests wait for its tokens (none lies unused)
    is using all of its rate, which the send rate measured over `WINDOW_S` shows only a window late: it may double
    every `DOUBLING_S` instead. The floor is `MIN_RATE` per process, less in a job of more than
    ``JOB_MIN_RATE / MIN_RATE`` processes (`world`), whose floors together stay at `JOB_MIN_RATE`. A lane shared by n
    processes (`SharedLaneStore`) acts as n lanes in lock step. Times are arguments, else `clock`'s
    (``time.monotonic``; benchmarks/s3_sim.py: simulated).
    """

    BETA = 0.7
    GROWTH = 0.1
    CATCH_UP = 0.05  # requests per second added per second of successes, whatever the rate (fairness between processes)
    STREAK_SCALE = 4.0
    MAX_STREAK = 64
    MIN_RATE = 0.2  # requests/s per process a lane never goes under (to learn when the store has room)
    JOB_MIN_RATE = 800.0  # the most a job's floors add up to: a quarter of one S3 prefix's writes, at any world size
    QUIET_S, MAX_QUIET = 0.25, 64.0  # s seconds after WINDOW_S without a cut, growth is 1 + s / QUIET_S times faster
    DOUBLING_S = 0.5  # a lane whose requests wait for tokens may double its rate this often (else: 2x what it sends)
    WINDOW_S = 2.0  # the window over which a lane measures its send rate (to start from, and to cap its growth)

    def __init__(
        self, name: str, limit: Callable[[], float | None] | None = None, shared: SharedLaneStore | None = None,
        index: int = 0, clock: Callable[[], float] = time.monotonic, world: Callable[[], int] | None = None,
    ) -> None:
        self.name, self._limit, self._shared, self._index, self._clock = name, limit, shared, index, clock
        self._world = world  # the job's process count (None: 1)
        self._flag = shared.active_flag(index) if shared is not None else None  # (mapping, offset) of `active`
        self._cond = threading.Condition(threading.Lock())
        self._active, self._rate = False, math.inf
        self._tokens, self._refilled_at, self._epoch, self._changed_at, self._streak = 0.0, 0.0, -math.inf, 0.0, 0.0
        self._sends: collections.deque[float] = collections.deque(maxlen=64)
        self._own_sends = self._sends  # this process's sends (a shared lane's `_sends` are the host's while pacing)
        self._processes, self._last_success = 1, -math.inf
        self._host_last_success = -math.inf  # a shared lane's host-wide figures, as loaded
        self._host_throttles = self._host_activations = 0
        self.throttles = 0  # throttling answers this process saw
        self.waits = 0  # requests of this process that waited for a token
        self.waited_s = 0.0  # seconds they waited, summed over threads
        self.activations = 0  # times this process woke the lane
        if self._has_budget():
            with self._state():
                if not self._active:
                    self._activate_with_budget(clock())

    def __repr__(self) -> str:
        state = f"{self.rate:.3g} requests/s" if self.active else "dormant"
        where = f", shared by {self.processes} processes" if self._shared is not None else ""
        return f"<PacerLane {self.name}: {state}{where}, {self.throttles} throttled, {self.waited_s:.2f} s waited>"

    @property
    def shared(self) -> bool:
        """Whether this lane is the host's (shared with the job's other processes on this host)."""
        return self._shared is not None

    @property
    def processes(self) -> int:
        """The processes this lane paces: 1, or those of the job on this host that share it."""
        return self._processes

    @property
    def active(self) -> bool:
        flag = self._flag
        return self._active if flag is None else flag[0][flag[1]] != 0

    @property
    def rate(self) -> float:
        """Requests per second this lane lets through (infinite while dormant); a shared lane's is the host's."""
        if self._shared is not None:
            with self._state():
                pass
        return self._rate if self._active else math.inf

    @property
    def last_success(self) -> float:
        """`time.monotonic()` of the last success through this lane (a shared lane's: of any process of the host)."""
        if self._shared is not None:
            return max(self._last_success, self._shared.last_success(self._index))
        return self._last_success

    # ---- the shared state ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _state(self) -> Iterator[None]:
        """Hold the lane; for a shared lane, hold the host's state too and work on a copy of it (stored back)."""
        with self._cond:
            shared = self._shared
            if shared is None:
                yield
                return
            with shared.locked():
                self._load(shared)
                yield
                self._store(shared)

    def _load(self, shared: SharedLaneStore) -> None:
        state = shared.load(self._index)
        self._active = state.active
        self._rate = state.rate if state.active else math.inf
        self._tokens, self._refilled_at, self._epoch, self._changed_at, self._streak = state[2:7]
        self._host_last_success, self._host_throttles, self._host_activations = state[7:10]
        self._sends = collections.deque(state.sends, maxlen=64)
        self._processes = shared.processes

    def _store(self, shared: SharedLaneStore) -> None:
        shared.store(
            self._index,
            PacerLaneState(
                self._active, self._rate, self._tokens, self._refilled_at, self._epoch, self._changed_at, self._streak,
                self._host_last_success, self._host_throttles, self._host_activations, tuple(self._sends),
            ),
        )

    # ---- the arithmetic (times from time.monotonic(), or a test's clock) ----------------------------------------
    def record_send(self, now: float) -> None:
        self._sends.append(now)

    def measured_rate(self, now: float, sends: Iterable[float] | None = None) -> float:
        """Requests sent per second over the last `WINDOW_S` (by this lane, or the given send times)."""
        sends = tuple(self._sends if sends is None else sends)
        recent = [t for t in sends if t > now - self.WINDOW_S]
        if len(recent) == 64 and now > recent[0]:
            return len(recent) / (now - recent[0])
        return len(recent) / self.WINDOW_S

    def reserve(self, now: float, floor: float = 0.0) -> float:
        """Take a token (0.0: send now) or say how many seconds until one is there (at `floor` per second at least)."""
        with self._state():
            return self._reserve(now, floor)

    def _reserve(self, now: float, floor: float = 0.0) -> float:
        if not self._active:
            self._own_sends.append(now)
            return 0.0
        if getattr(_alone, "depth", 0) and self._paced_by_budget_alone():  # `sending_alone`: no share to keep
            self._sends.append(now)
            return 0.0
        limit = self._apply_limit(now)
        floor *= self._processes  # each process's waiting request gets one at least that often
        rate = max(self._rate, min(floor, limit if limit is not None else math.inf))  # a budget is never exceeded
        self._tokens = min(1.0, self._tokens + (now - self._refilled_at) * rate)
        self._refilled_at = now
        if self._tokens >= 1.0 - 1e-9:  # (1 / rate) * rate may come out a hair under 1
            self._tokens = max(0.0, self._tokens - 1.0)
            self._sends.append(now)
            return 0.0
        return max((1.0 - self._tokens) / rate, 1e-4)

    def on_throttle(self, sent: float, now: float) -> None:
        """A throttling answer to a request sent at `sent`."""
        with self._state():
            self.throttles += 1
            self._host_throttles += 1
            self._streak = 0.0
            n = self._processes
            if not self._active:
                self._active = True
                self.activations += 1
                self._host_activations += 1
                self._rate = max(self._floor(), self.BETA * self.measured_rate(now, self._own_sends) * n)
                if self._shared is not None:
                    self._sends = collections.deque(self._own_sends, maxlen=64)
                self._apply_limit(now)
                self._tokens, self._refilled_at, self._epoch, self._changed_at = 0.0, now, now, now
                whose = f"the {n} processes of this job on this host share" if n > 1 else "this process's"
                message = "S3 throttles %s: pacing %s %s at %.3g requests/s from now on"
                logger.info(message, self.name, whose, self.name, self._rate)
            elif sent >= self._epoch:
                self._set_rate(max(self._floor(), self.BETA * self._rate), now)
                self._epoch = self._changed_at = now
                logger.debug("S3 throttles %s: %.3g requests/s", self.name, self._rate)

    def on_success(self, sent: float, now: float) -> None:
        """A success of a request sent at `sent`."""
        self._last_success = now
        if not self.active:
            return
        with self._state():
            self._host_last_success = now
            if not self._active:
                return
            n = self._processes
            self._streak = min(self._streak + 1.0 / n, self.MAX_STREAK)
            quiet = min(1.0 + max(0.0, now - self._epoch - self.WINDOW_S) / self.QUIET_S, self.MAX_QUIET)
            step = quiet * self.GROWTH * (1.0 + self._streak / self.STREAK_SCALE) / math.sqrt(self._rate * n)
            grown = self._rate * (1.0 + step) + quiet * self.CATCH_UP * n * max(0.0, now - self._changed_at)
            cap = max(self._rate, 2.0 * self.measured_rate(now))
            if self._tokens + (now - self._refilled_at) * self._rate < 1.0:  # no token lies unused: requests wait
                cap = max(cap, self._rate * 2.0 ** min((now - self._changed_at) / self.DOUBLING_S, 64.0))
            grown = min(grown, cap)
            self._changed_at = now
            if grown > self._rate:
                self._set_rate(grown, now)
                self._cond.notify_all()

    def _floor(self) -> float:
        """The lane's least rate: `MIN_RATE` per process it paces, but a job's floors add up to `JOB_MIN_RATE` at
        most (2,048 hosts of 8 processes would otherwise never go under 3,277 requests/s together, 94 % of what one S3
        prefix serves, and could not make room by slowing down)."""
        world = max(1, self._world()) if self._world is not None else 1
        return min(self.MIN_RATE, self.JOB_MIN_RATE / world) * self._processes

    def _set_rate(self, rate: float, now: float) -> None:
        self._tokens = min(1.0, self._tokens + (now - self._refilled_at) * self._rate)
        self._refilled_at = now
        self._rate = rate
        self._apply_limit(now)

    def _has_budget(self) -> bool:
        return self._limit is not None and self._limit() is not None

    def _paced_by_budget_alone(self) -> bool:
        """Active under a budget and never throttled (for a shared lane: on this host): its share is what paces it."""
        return self._active and self._host_throttles == 0 and self._has_budget()

    def _activate_with_budget(self, now: float) -> None:
        self._active = True
        self._rate = math.inf
        self._apply_limit(now)
        self._tokens, self._refilled_at, self._changed_at = 1.0, now, now

    def _apply_limit(self, now: float) -> float | None:
        limit = self._limit() if self._limit is not None else None
        if limit is not None:
            limit *= self._processes  # the host's lane: the shares of the processes that use it
            self._rate = min(self._rate, limit)
        return limit

    # ---- the blocking side ------------------------------------------------------------------------------------
    def acquire(self, max_interval_s: float = math.inf) -> float:
        """Wait for a token if pacing (one comes at least every `max_interval_s`); return the send time to report."""
        now = self._clock()
        if not self.active:
            self._own_sends.append(now)  # thread-safe, and the only cost of a dormant lane
            return now
        started = now
        floor = 1.0 / max_interval_s if max_interval_s > 0 else math.inf
        while True:
            with self._state():
                wait = self._reserve(now, floor)
            if wait <= 0.0:
                break
            with self._cond:
                self._cond.wait(wait)  # woken early when this process's successes grow the rate
            now = self._clock()
        if now > started:
            with self._cond:
                self.waits += 1
                self.waited_s += now - started
        return now


_WRITE_OPERATIONS = frozenset(
    {
        *("put_object", "upload_part", "upload_part_copy", "copy_object", "create_multipart_upload"),
        *("complete_multipart_upload", "abort_multipart_upload", "delete_object", "delete_objects", "create_bucket"),
        "delete_bucket",
    }
)
"""boto3 operations S3 counts as writes (PUT, POST, DELETE); every other operation is a read (GET, HEAD)."""


class RequestPacer:
    """The request pacer of one process for one bucket and endpoint (or one spread prefix of the bucket:
    `s3_utils.request_pacer`'s ``partition``): a `PacerLane` each for writes and for reads. A budget (`limit`) is
    per prefix, as S3's rates are, and job-wide: this process takes its share, the rate over the job's processes that
    send to the prefix: `world_size()` (``s3_process.world_size`` as `s3_utils.request_pacer` builds it; None: this
    process alone), or 1/N of them for one of N spread prefixes (`spread_over`)."""

    def __init__(
        self, endpoint_url: str | None, bucket: str, shared: SharedLaneStore | None = None,
        clock: Callable[[], float] = time.monotonic, world_size: Callable[[], int] | None = None,
    ) -> None:
        self.endpoint_url, self.bucket, self._clock, self._world_size = endpoint_url, bucket, clock, world_size
        self._budget: RequestRates | None = None
        self._world: tuple[float, int] = (-math.inf, 1)
        self._spread = 1  # the prefixes this pacer's is one of (`spread_over`)
        self.writes = PacerLane("writes", lambda: self._share("write"), shared, 0, clock, self._processes_of_job)
        self.reads = PacerLane("reads", lambda: self._share("read"), shared, 1, clock, self._processes_of_job)

    def __repr__(self) -> str:
        return f"<RequestPacer s3://{self.bucket} ({self.endpoint_url or 'AWS'}): {self.writes!r}, {self.reads!r}>"

    @property
    def shared(self) -> bool:
        """Whether the lanes are shared with the job's other processes on this host."""
        return self.writes.shared

    def lane(self, operation: str) -> PacerLane:
        return self.writes if operation in _WRITE_OPERATIONS else self.reads

    def limit(self, budget: RequestRates) -> None:
        """Apply a job-wide budget (the smallest one given so far wins, per direction)."""
        old = self._budget or RequestRates()
        if self._budget is not None and _smaller(old, budget) == old:
            return  # nothing new: the common case, one check per request of an S3Utils with a budget
        self._budget = _smaller(old, budget)
        now = self._clock()
        for lane in (self.writes, self.reads):
            with lane._state():
                if lane._has_budget() and not lane._active:
                    lane._activate_with_budget(now)
                lane._apply_limit(now)

    def spread_over(self, prefixes: int) -> None:
        """This pacer's prefix is one of `prefixes` over which a spread checkpoint's files go, each written and read by
        about 1/`prefixes` of the job's processes: its budget's share, and its floor's, are over those processes."""
        spread = max(1, int(prefixes))
        if spread == self._spread:
            return
        self._spread, self._world = spread, (-math.inf, 1)  # counted again now
        now = self._clock()
        for lane in (self.writes, self.reads):  # a lane paced by the budget alone takes its new share at once
            with lane._state():
                if lane._paced_by_budget_alone():
                    lane._activate_with_budget(now)

    def _share(self, direction: str) -> float | None:
        """The job-wide rate over the job's processes that send to this pacer's prefix (`_processes_of_job`)."""
        budget = self._budget
        rate = getattr(budget, direction) if budget is not None else None
        return None if rate is None else rate / self._processes_of_job()

    def _processes_of_job(self) -> int:
        """The job's processes that send to this pacer's prefix: `world_size()` (asked again every 5 s: the process
        group starts after S3 requests; 1 without it), over the spread prefixes (`spread_over`), rounded up."""
        checked, world = self._world
        now = self._clock()
        if now - checked > 5.0:
            world = self._world_size() if self._world_size is not None else 1
            world = max(1, -(-world // self._spread))
            self._world = (now, world)
        return world


def _smaller(first: RequestRates, second: RequestRates) -> RequestRates:
    def least(a: float | None, b: float | None) -> float | None:
        return b if a is None else a if b is None else min(a, b)

    return RequestRates(least(first.write, second.write), least(first.read, second.read))

"""A discrete-event model of S3 at scale, driving this package's own request pacer and retry policy in simulated time.

What is the package's (imported, not copied): `s3_pacing.RequestPacer` / `PacerLane` (one per simulated process for
the bucket and one for each spread prefix it sends to, chosen by the package's rule, ``s3_dirpath_utils.spread_prefix``;
the ranks of a host sharing each one's lanes' state through a `SharedLaneStore`, as ``s3_node_sharing.SharedPacerFile``
does on a real host, a file per bucket and per spread prefix), the job budget (`RequestPacer.limit`, per prefix, each
process's share by ``WORLD_SIZE`` and, for a spread prefix, `RequestPacer.spread_over`), `s3_pacing.sending_alone`
(the DCP coordinator's commit), `s3_pacing.CallRetries`
(what `S3Utils.with_retries` does after each failed attempt), and `s3_node_sharing.downloading_ranks` (who downloads
on a shared resume). What is modelled here:

* **S3's partitions.** Keys map to partitions by key range (sorted key space, a partition owns the keys from its
  lower bound up to the next partition's): one partition for the whole bucket unless a layout says S3 has already
  partitioned its prefixes. Each partition admits `write_rate` (3,500) PUT/POST/DELETE and `read_rate` (5,500)
  GET/HEAD per second, token buckets with `burst_s` seconds of burst; beyond that it answers ``503 SlowDown``.
  A partition that has answered SlowDown for `split_after_s` of sustained load (no quiet gap of `quiet_s`) splits in
  two at the median key of its recent requests, each half with the full rates (S3 splits "gradually", over minutes:
  the time is not documented, so it is a parameter). Because a checkpoint's keys carry its step, a split learned on
  one save's keys does not help the next save unless the layout puts something stable before the step.
* **Connections and hosts.** An admitted request takes `latency_s` plus its bytes at the smaller of the per-connection
  rate (`conn_bytes_per_s`, S3's ~5 Gb/s per connection) and the host's NIC shared by the transfers in flight on it
  when the request starts (a fluid approximation); a SlowDown answer takes `slowdown_latency_s` (no body is sent: the
  SDK waits for ``100-continue``).
* **The client.** Each rank keeps up to `concurrency` parts (or ranges) of a file in flight, as the package does
  (`max_write_concurrency` / `max_read_concurrency`). A request waits in its host's queue (one per pacer: the
  bucket's, each spread prefix's) for a token of its process's lane (`PacerLane.reserve`, at the floor `acquire` uses), is sent, and on SlowDown calls `on_throttle`
  then `CallRetries.after_failure` (give up, or retry when the pacer allows); on success `on_success`. One
  difference from threads blocked in `acquire`: the host's waiting requests queue in order, and only the first polls
  the lane (real threads all wake and all but one go back to sleep: the same grants, far fewer events); a success that
  grows a lane's rate polls the host's queue again at once if the rank that succeeded has a request in it
  (`acquire`'s threads wait on a condition that their own process's growing successes notify).
* **The oracle** (``ClientParams(pacer="oracle")``): not a client, a measure. One job-wide queue per partition and
  direction, whose head is sent the moment the partition holds a token: nothing is throttled and no token lies
  unused while a request waits, so its time is the least any client takes in this model, request latencies and
  phases included (the partition-capacity bound leaves those out).

Deterministic: the only randomness is `random.uniform` in `CallRetries` (for errors other than throttling), seeded
by `run`.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import heapq
import math
import os
import random
import sys
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import s3_dirpath_utils  # noqa: E402
import s3_node_sharing  # noqa: E402
import s3_pacing  # noqa: E402
import s3_prefix_spreading  # noqa: E402
import s3_process  # noqa: E402
import s3_utils  # noqa: E402

MiB = 1 << 20
T0 = 1000.0  # simulated clock's start (a lane's fresh state says "no success yet" with 0.0)


# --------------------------------------------------------------------------------------------------------------------
# S3: partitions by key range, token buckets, SlowDown, splits
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class S3Params:
    write_rate: float = 3500.0  # PUT/POST/DELETE per second per partition
    read_rate: float = 5500.0  # GET/HEAD per second per partition
    burst_s: float = 1.0  # a partition's token buckets hold this many seconds of its rate
    split_after_s: float = 300.0  # sustained SlowDown before a partition splits (undocumented: "minutes")
    quiet_s: float = 5.0  # a gap this long without SlowDown ends "sustained"
    latency_s: float = 0.1  # an admitted request's fixed time (first byte, or the PUT's answer)
    slowdown_latency_s: float = 0.02  # a SlowDown answer's round trip
    latency_jitter: float = 0.2  # each request's fixed time is drawn from (1 +- this) x latency_s / slowdown_latency_s
    latency_draw: int = 0  # which stream of those draws (0: the one every published run used; others: other draws)
    conn_bytes_per_s: float = 625e6  # 5 Gb/s per connection
    host_bytes_per_s: float = 12.5e9  # 100 Gb/s host NIC toward S3
    unlimited: bool = False  # no partition limits at all (the bandwidth bound)


class Partition:
    def __init__(self, low: str, params: S3Params, now: float) -> None:
        self.low = low
        self.rates = {"write": params.write_rate, "read": params.read_rate}
        self.tokens = {d: r * params.burst_s for d, r in self.rates.items()}
        self.refilled = {"write": now, "read": now}
        self.hot_since: float | None = None
        self.last_throttle = -math.inf
        self.recent: deque[str] = deque(maxlen=512)
        self.admitted = {"write": 0, "read": 0}
        self.throttled = {"write": 0, "read": 0}
        self.last_admitted: dict[str, float] = {}


class S3Model:
    """The bucket: `request(direction, key, now)` is True (admitted) or False (503 SlowDown)."""

    def __init__(self, params: S3Params, prefixes: list[str] | None = None, now: float = T0) -> None:
        self.params = params
        lows = sorted({"", *(prefixes or [])})
        self.partitions = [Partition(low, params, now) for low in lows]
        self.lows = lows
        self.splits: list[tuple[float, str]] = []
        self.first_request: dict[str, float] = {}
        self.last_admitted: dict[str, float] = {}

    def partition_of(self, key: str) -> Partition:
        return self.partitions[bisect.bisect_right(self.lows, key) - 1]

    def request(self, direction: str, key: str, now: float) -> bool:
        self.first_request.setdefault(direction, now)
        part = self.partition_of(key)
        if self.params.unlimited:
            part.admitted[direction] += 1
            part.last_admitted[direction] = self.last_admitted[direction] = now
            return True
        rate = part.rates[direction]
        tokens = min(rate * self.params.burst_s, part.tokens[direction] + (now - part.refilled[direction]) * rate)
        part.refilled[direction] = now
        part.recent.append(key)
        if tokens >= 1.0:
            part.tokens[direction] = tokens - 1.0
            part.admitted[direction] += 1
            part.last_admitted[direction] = self.last_admitted[direction] = now
            if part.hot_since is not None and now - part.last_throttle > self.params.quiet_s:
                part.hot_since = None
            return True
        part.tokens[direction] = tokens
        part.throttled[direction] += 1
        if part.hot_since is None or now - part.last_throttle > self.params.quiet_s:
            part.hot_since = now
        part.last_throttle = now
        if now - part.hot_since >= self.params.split_after_s:
            self._split(part, now)
        return False

    def _split(self, part: Partition, now: float) -> None:
        keys = sorted(part.recent)
        median = keys[len(keys) // 2]
        if median <= part.low or median in self.lows:
            part.hot_since = now
            return
        child = Partition(median, self.params, now)
        index = bisect.bisect_right(self.lows, median)
        self.lows.insert(index, median)
        self.partitions.insert(index, child)
        part.hot_since = None
        part.recent.clear()
        self.splits.append((now, median))

    def totals(self, direction: str) -> tuple[int, int]:
        return (
            sum(p.admitted[direction] for p in self.partitions),
            sum(p.throttled[direction] for p in self.partitions),
        )


# --------------------------------------------------------------------------------------------------------------------
# A host's shared pacer state, in memory (the `s3_pacing.SharedLaneStore` protocol; SharedPacerFile on a real host)
# --------------------------------------------------------------------------------------------------------------------


class HostLaneStore:
    """What ``s3_node_sharing.SharedPacerFile`` keeps for one host, in memory: `processes` ranks share two lanes."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        fresh = s3_pacing.PacerLaneState(False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, ())
        self._states = [fresh, fresh]
        self._active = bytearray(2)

    def locked(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def load(self, lane: int) -> s3_pacing.PacerLaneState:
        return self._states[lane]  # (a dormant lane's rate is ignored by PacerLane._load)

    def store(self, lane: int, state: s3_pacing.PacerLaneState) -> None:
        self._states[lane] = state  # (its sends: a lane's newest 64 already)
        self._active[lane] = 1 if state.active else 0

    def active_flag(self, lane: int) -> tuple[Any, int]:
        return self._active, lane

    def last_success(self, lane: int) -> float:
        return self._states[lane].last_success


# --------------------------------------------------------------------------------------------------------------------
# The event loop and the cluster
# --------------------------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = T0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0

    def __call__(self) -> float:
        return self.now

    def at(self, when: float, callback: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (when, self._seq, callback, args))

    def run(self, until: float = math.inf) -> None:
        queue = self._queue
        while queue:
            when, _, callback, args = heapq.heappop(queue)
            if when > until:
                break
            self.now = when
            self.events += 1
            callback(*args)


@dataclass
class ClientParams:
    pacer: str = "pacer"  # "pacer" (the package's default), "budget" (plus max_requests_per_second), "none", "oracle"
    budget: tuple[float, float] | None = None  # (write, read) requests per second for the whole job, per prefix
    policy: s3_utils.RetryPolicy = field(default_factory=s3_utils.RetryPolicy)
    ranks_per_host: int = 8


class Request:
    __slots__ = ("direction", "key", "lane", "nbytes", "op", "queued", "rank", "retries", "sent")

    def __init__(self, op: Op, direction: str, key: str, nbytes: int, rank: int) -> None:
        self.op, self.direction, self.key, self.nbytes, self.rank = op, direction, key, nbytes, rank
        self.lane = (s3_dirpath_utils.spread_prefix(key), direction)  # its pacer ("": the bucket's) and lane
        self.retries: s3_pacing.CallRetries | None = None
        self.sent = 0.0
        self.queued = 0.0


class Op:
    """One rank's operation: phases of requests, each phase's requests `concurrency` at a time; `done(ok)` at the end."""

    def __init__(
        self, cluster: Cluster, rank: int, phases: list[list[tuple[str, str, int]]], concurrency: int,
        done: Callable[[Op], None] | None = None,
    ) -> None:
        self.cluster, self.rank, self.concurrency, self.done = cluster, rank, concurrency, done
        self.phases = deque(deque(phase) for phase in phases)
        self.in_flight = 0
        self.failed: str | None = None
        self.started = cluster.clock.now
        self.finished: float | None = None
        self.requests = 0
        self.alone = False  # sent while no other rank sends (a DCP commit): `s3_pacing.sending_alone`, as the package

    def start(self) -> None:
        self._fill()

    def _fill(self) -> None:
        if self.failed is not None:
            return
        while self.phases:
            phase = self.phases[0]
            while phase and self.in_flight < self.concurrency:
                direction, key, nbytes = phase.popleft()
                self.in_flight += 1
                self.cluster.submit(Request(self, direction, key, nbytes, self.rank))
            if phase or self.in_flight:
                return
            self.phases.popleft()
        if self.finished is None:
            self.finished = self.cluster.clock.now
            if self.done is not None:
                self.done(self)

    def request_done(self, ok: bool, why: str = "") -> None:
        self.in_flight -= 1
        if not ok and self.failed is None:
            self.failed = why
            self.finished = self.cluster.clock.now
            if self.done is not None:
                self.done(self)
            return
        self._fill()


class Cluster:
    """Hosts of ranks against one `S3Model`: per rank a `RequestPacer` for the bucket and one per spread prefix it
    sends to (as `s3_utils.request_pacer` makes them), a host's ranks sharing each one's lanes."""

    def __init__(
        self, ranks: int, s3: S3Model, client: ClientParams, clock: Clock, senders: set[int] | None = None,
        partitions: dict[int, set[str]] | None = None,
    ) -> None:
        """`senders`: the ranks that make requests (default: all); a host's shared pacer state counts those only,
        as a real host's file counts the processes that attached to it by sending. `partitions`: the spread prefixes
        each rank sends to (a host's state of one counts the host's ranks that send to it)."""
        self.ranks, self.s3, self.client, self.clock = ranks, s3, client, clock
        self.spread = max(1, len(set().union(*(partitions or {}).values())))  # the spread prefixes (1: none)
        per_host = client.ranks_per_host
        self.hosts = (ranks + per_host - 1) // per_host
        counts = [0] * self.hosts
        prefix_counts: dict[tuple[int, str], int] = collections.Counter()
        for rank in range(ranks) if senders is None else senders:
            counts[rank // per_host] += 1
            for partition in (partitions or {}).get(rank, ()):
                prefix_counts[rank // per_host, partition] += 1
        self.stores = {(host, ""): HostLaneStore(max(1, count)) for host, count in enumerate(counts)}
        self.stores.update({key: HostLaneStore(count) for key, count in prefix_counts.items() if key[1]})
        self.pacers: list[dict[str, s3_pacing.RequestPacer]] = [{} for _ in range(ranks)]
        for rank in range(ranks):
            self.pacer(rank, "")
        self.waiting: dict[tuple[int, str, str], deque[Request]] = collections.defaultdict(deque)  # (host, *lane)
        self.polling: dict[tuple[int, str, str], bool] = collections.defaultdict(bool)
        self.poll_due: dict[tuple[int, str, str], int] = collections.defaultdict(int)  # which scheduled poll is live
        self.queued = [collections.Counter() for _ in range(ranks)]  # each rank's requests per lane in the host's queue
        self.host_transfers = [0] * self.hosts
        draw = s3.params.latency_draw  # its own stream: the retry policy's draws stay as they were
        self.jitter = random.Random(f"latency {ranks}" + (f" draw {draw}" if draw else ""))
        self.failures = 0
        self.sent = {"write": 0, "read": 0}
        self.waited_s = 0.0

    def pacer(self, rank: int, partition: str) -> s3_pacing.RequestPacer:
        """`rank`'s pacer of the bucket (`partition` ``""``) or of a spread prefix, made on first use; with the
        budget client, limited from then on (as `S3Utils.with_retries` does)."""
        pacer = self.pacers[rank].get(partition)
        if pacer is None:
            store = self.stores.setdefault((rank // self.client.ranks_per_host, partition), HostLaneStore(1))
            pacer = s3_pacing.RequestPacer("http://sim", "bucket", store, clock=self.clock, world_size=s3_process.world_size)
            if partition:  # a spread prefix: as S3StorageWriter and S3StorageReader tell its pacer
                pacer.spread_over(self.spread)
            self.pacers[rank][partition] = pacer
            if self.client.pacer == "budget" and self.client.budget is not None:
                pacer.limit(s3_pacing.RequestRates(*self.client.budget))
        return pacer

    def lane(self, req: Request) -> s3_pacing.PacerLane:
        partition, direction = req.lane
        return self.pacer(req.rank, partition).lane("upload_part" if direction == "write" else "get_object")

    # ---- a request's life --------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        req.retries = s3_pacing.CallRetries(self.client.policy, self.clock.now)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        if self.client.pacer == "none":
            self._send(req)
            return
        if self.client.pacer == "oracle":
            self._oracle_enqueue(req)
            return
        queue = (req.rank // self.client.ranks_per_host, *req.lane)
        req.queued = self.clock.now
        self.waiting[queue].append(req)
        self.queued[req.rank][req.lane] += 1
        if not self.polling[queue]:
            self.polling[queue] = True
            self._poll(queue)

    def _poll(self, queue_key: tuple[int, str, str], due: int | None = None) -> None:
        """The first waiting request of the host asks its process's lane for a token (as `PacerLane.acquire`); `due`:
        a scheduled poll's number, ignored once a success that grew the lane has polled again (as `acquire`'s threads
        are woken early then)."""
        if due is not None and due != self.poll_due[queue_key]:
            return
        queue = self.waiting[queue_key]
        now = self.clock.now
        floor = 1.0 / self.client.policy.max_backoff_s
        while queue:
            req = queue[0]
            lane = self.lane(req)
            # a dormant lane: `acquire`'s own fast path (no wait, no lock); else the token bucket `acquire` loops on
            if not lane.active and lane.acquire() == now:
                wait = 0.0
            else:
                with s3_pacing.sending_alone() if req.op.alone else contextlib.nullcontext():
                    wait = lane.reserve(now, floor)
            if wait > 0.0:
                self.poll_due[queue_key] += 1
                self.clock.at(now + wait, self._poll, queue_key, self.poll_due[queue_key])
                return
            queue.popleft()
            self.queued[req.rank][req.lane] -= 1
            self.waited_s += now - req.queued
            self._send(req)
        self.polling[queue_key] = False

    def _oracle_enqueue(self, req: Request) -> None:
        """The oracle client (a measure, no client can be it): one job-wide queue per partition and direction, whose
        head is sent the moment the partition holds a token, so nothing is throttled and no token lies unused while a
        request waits: the least time any client takes in this model, latencies and phases included."""
        part = self.s3.partition_of(req.key)
        queue_key = (-1, part.low, req.direction)
        req.queued = self.clock.now
        self.waiting[queue_key].append(req)
        if not self.polling[queue_key]:
            self.polling[queue_key] = True
            self._oracle_poll(queue_key, part)

    def _oracle_poll(self, queue_key: tuple[int, str, str], part: Partition) -> None:
        queue, now, direction = self.waiting[queue_key], self.clock.now, queue_key[2]
        rate = part.rates[direction]
        while queue:
            tokens = min(rate * self.s3.params.burst_s, part.tokens[direction] + (now - part.refilled[direction]) * rate)
            if tokens < 1.0:
                self.clock.at(now + (1.0 - tokens) / rate + 1e-9, self._oracle_poll, queue_key, part)
                return
            req = queue.popleft()
            self.waited_s += now - req.queued
            self._send(req)
        self.polling[queue_key] = False

    def _send(self, req: Request) -> None:
        now = self.clock.now
        req.sent = now
        req.op.requests += 1
        self.sent[req.direction] += 1
        params = self.s3.params
        if self.s3.request(req.direction, req.key, now):
            host = req.rank // self.client.ranks_per_host
            self.host_transfers[host] += 1
            rate = min(params.conn_bytes_per_s, params.host_bytes_per_s / self.host_transfers[host])
            self.clock.at(now + self._latency(params.latency_s) + req.nbytes / rate, self._succeeded, req, host)
        else:
            self.clock.at(now + self._latency(params.slowdown_latency_s), self._throttled, req)

    def _latency(self, mean: float) -> float:
        spread = self.s3.params.latency_jitter
        return mean * self.jitter.uniform(1.0 - spread, 1.0 + spread) if spread else mean

    def _succeeded(self, req: Request, host: int) -> None:
        self.host_transfers[host] -= 1
        if self.client.pacer not in ("none", "oracle"):
            lane = self.lane(req)
            before = lane.rate
            lane.on_success(req.sent, self.clock.now)
            if self.queued[req.rank][req.lane] and lane.rate > before:  # wakes the process's waiting requests
                self._poll((host, *req.lane))
        req.op.request_done(True)

    def _throttled(self, req: Request) -> None:
        now = self.clock.now
        retries = req.retries
        assert retries is not None
        if self.client.pacer == "none":  # SlowDown as an ordinary retriable error: counted backoff (botocore standard)
            delay = retries.after_failure(req.sent, now, False, -math.inf)
        else:
            lane = self.lane(req)
            lane.on_throttle(req.sent, now)
            delay = retries.after_failure(req.sent, now, True, lane.last_success)
        if delay is None:
            self.failures += 1
            req.op.request_done(False, f"gave up after {retries.attempts} attempts")
        elif delay > 0.0:
            self.clock.at(now + delay, self._enqueue, req)
        else:
            self._enqueue(req)


# --------------------------------------------------------------------------------------------------------------------
# Workloads: what each rank sends (request counts as the package makes them on AWS, which keeps full-object checksums)
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Workload:
    kind: str = "single"  # "single" (one file per rank, S3CheckpointIO) or "dcp" (S3StorageWriter / Reader)
    direction: str = "save"  # "save" or "load"
    ranks: int = 2048
    mib_per_rank: float = 256.0  # each rank's file (save, DCP load); the checkpoint every rank loads (single load)
    part_mib: float = 16.0
    layout: str = "one-prefix"  # or "spread"
    prefixes: int = 1  # spread: how many prefixes the keys go over
    partitioned: bool = True  # spread: whether S3 has partitioned those prefixes already
    load_sharing: str = "node"  # single-file load: "node", "job" or "rank"
    step: int = 1000
    extra_writes_per_file: int = 0  # e.g. the checksum record on stores without full-object checksums
    extra_reads_per_download: int = 0
    concurrency: int | None = None  # parts / ranges in flight per rank (default: the package's)


def key_of(work: Workload, name: str, spread_index: int) -> str:
    """The key of `name` as the package lays it out: a spread save's shards (``*.distcp``, ``*.ckpt``) in
    ``run/s3ckpt-spread-XX/step-N/`` (`s3_prefix_spreading`, the rank's prefix), everything else in ``run/step-N/``."""
    if work.layout == "spread" and not name.startswith("."):
        spreading = s3_prefix_spreading.PrefixSpreading(work.prefixes)
        return f"run/{spreading.segment(spreading.index_of(spread_index))}/step-{work.step}/{name}"
    return f"run/step-{work.step}/{name}"


def spread_prefixes(work: Workload) -> list[str]:
    """The spread layout's prefixes (``run/s3ckpt-spread-XX/``), each assumed partitioned by S3 already."""
    if work.layout != "spread":
        return []
    spreading = s3_prefix_spreading.PrefixSpreading(work.prefixes)
    return [f"run/{spreading.segment(p)}/" for p in range(work.prefixes)]


def rank_phases(work: Workload, rank: int, node_keys: list[str]) -> list[list[tuple[str, str, int]]] | None:
    """The requests `rank` makes, in phases (a phase starts when the previous one is done); None: nothing."""
    part = int(work.part_mib * MiB)
    size = int(work.mib_per_rank * MiB)
    parts = max(1, math.ceil(size / part))
    sizes = [min(part, size - i * part) for i in range(parts)]
    if work.direction == "save":
        name = f"__{rank}_0.distcp" if work.kind == "dcp" else f"mp_rank_{rank:05d}.ckpt"
        key = key_of(work, name, rank)
        if parts == 1:
            return [[("write", key, size)] + [("write", key + ".rec", 256)] * work.extra_writes_per_file]
        return [
            [("write", key, 0)],  # CreateMultipartUpload
            [("write", key, n) for n in sizes],  # UploadPart
            [("write", key + ".rec", 256)] * work.extra_writes_per_file + [("write", key, 0)],  # (record,) Complete
        ]
    if work.kind == "dcp":  # every rank reads .metadata, then the item record (one GET each), then its file's ranges
        meta, items = key_of(work, ".metadata", 0), key_of(work, ".s3ckpt-items.json", 0)
        key = key_of(work, f"__{rank}_0.distcp", rank)
        return [[("read", meta, 64 * 1024)], [("read", items, 64 * 1024)], [("read", key, n) for n in sizes]]
    # single-file load: the ranks that download (the package's own decision), each HEAD (+1 when shared) + ranges
    if rank not in work_downloaders(work, node_keys):
        return None
    key = key_of(work, "last.ckpt", 0)
    heads = 1 if work.load_sharing == "rank" or len(set(node_keys)) == len(node_keys) else 2
    extra = [("read", key + ".rec", 256)] * work.extra_reads_per_download
    return [[("read", key, 0)] * heads + extra, [("read", key, n) for n in sizes]]


_downloaders_cache: dict[tuple[str, int, int], set[int]] = {}


def work_downloaders(work: Workload, node_keys: list[str]) -> set[int]:
    cache_key = (work.load_sharing, len(node_keys), len(set(node_keys)))
    if cache_key not in _downloaders_cache:
        _downloaders_cache[cache_key] = set(s3_node_sharing.downloading_ranks(node_keys, work.load_sharing))
    return _downloaders_cache[cache_key]


# --------------------------------------------------------------------------------------------------------------------
# One run and its measures
# --------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _world(ranks: int) -> Iterator[None]:
    """The job budget's share is budget / world size, read from WORLD_SIZE (no process group here)."""
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(ranks)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = old


def run(
    work: Workload, client: ClientParams | None = None, s3: S3Params | None = None, seed: int = 0,
    start_spread_s: float = 0.0, horizon_s: float = 7200.0, partitions: list[str] | None = None,
) -> dict[str, Any]:
    """Simulate `work` (all ranks start together, or over `start_spread_s`); the measures as a dict. `partitions`:
    lower bounds of partitions S3 has already (an earlier run's ``partition_lows``: its splits outlive it)."""
    client = client or ClientParams()
    s3 = s3 or S3Params()
    random.seed(seed)
    rng = random.Random(seed)
    clock = Clock()
    model = S3Model(s3, [*(spread_prefixes(work) if work.partitioned else []), *(partitions or [])])
    direction = "write" if work.direction == "save" else "read"
    per_host = client.ranks_per_host
    node_keys = [f"node{r // per_host}" for r in range(work.ranks)]
    concurrency = work.concurrency or (
        (s3_utils.DEFAULT_MAX_WRITE_CONCURRENCY if work.kind == "single" else 4)
        if work.direction == "save"
        else s3_utils.DEFAULT_MAX_READ_CONCURRENCY
    )
    with _world(work.ranks):
        plans = {rank: rank_phases(work, rank, node_keys) for rank in range(work.ranks)}
        plans = {rank: phases for rank, phases in plans.items() if phases is not None}
        partitions = {
            rank: {s3_dirpath_utils.spread_prefix(key) for phase in phases for _, key, _ in phase} - {""}
            for rank, phases in plans.items()
        }
        cluster = Cluster(work.ranks, model, client, clock, set(plans), partitions)
        ops: list[Op] = []
        for rank, phases in plans.items():
            op = Op(cluster, rank, phases, concurrency)
            ops.append(op)
            clock.at(T0 + (rng.uniform(0, start_spread_s) if start_spread_s else 0.0), op.start)
        if work.kind == "dcp" and work.direction == "save":  # the coordinator's commit: checksum record, .metadata
            pending = [len(ops)]

            def commit(_: Op) -> None:
                pending[0] -= 1
                if pending[0] == 0:
                    final = Op(cluster, 0, [[("write", key_of(work, ".checksums", 0), 4096)],
                                            [("write", key_of(work, ".metadata", 0), 1 << 20)]], 1)
                    final.alone = True
                    ops.append(final)
                    final.start()
            for op in ops:
                op.done = commit
        clock.run(T0 + horizon_s)
    admitted, throttled = model.totals(direction)
    finished = [o.finished for o in ops if o.finished is not None]
    failed = sum(1 for o in ops if o.failed is not None) + sum(1 for o in ops if o.finished is None)
    span_end = max(finished) if finished else clock.now
    elapsed = span_end - T0
    rate = s3.write_rate if direction == "write" else s3.read_rate
    per_partition = {}
    for part in model.partitions:
        if part.admitted[direction] + part.throttled[direction]:
            per_partition[part.low or "(bucket)"] = part
    hottest = max(  # of equally hot partitions, the one admitting last
        per_partition.values(), key=lambda p: (p.admitted[direction], p.last_admitted.get(direction, T0)), default=None
    )
    hot = hottest.admitted[direction] if hottest is not None else 0
    # the hottest partition's requests beyond its burst at its rate: in t seconds a partition admits at most its burst
    # plus t x its rate, so no client can take less
    capacity_bound = max(0.0, hot - rate * s3.burst_s) / rate if not s3.unlimited else 0.0
    # its last admission, not the bucket's: a spread DCP save's records go to another partition after the shards
    first = model.first_request.get(direction, T0)
    last = hottest.last_admitted.get(direction, T0) if hottest is not None else T0
    used = len(per_partition)
    # the emulation's goodput, of the partition that bounds the run (the hottest): its admitted requests beyond its
    # burst at its rate / the seconds from the first request to the last admitted one
    goodput = capacity_bound / (last - first) if last > first else None
    bandwidth_bound = bandwidth_bound_s(work, client, s3, concurrency)
    bound = max(capacity_bound, bandwidth_bound)
    if capacity_bound <= bandwidth_bound:
        goodput = None  # the partitions do not bound this run (or its burst alone serves it): goodput says nothing
    times = sorted(o.finished - o.started for o in ops if o.finished is not None)
    return {
        "work": asdict(work),
        "client": {"pacer": client.pacer, "budget": client.budget, "ranks_per_host": per_host},
        "s3": asdict(s3),
        "hosts": cluster.hosts,
        "ops": len(ops),
        "failed": failed,
        "elapsed_s": elapsed,
        "capacity_bound_s": capacity_bound,
        "bandwidth_bound_s": bandwidth_bound,
        "bound_s": bound,
        "time_over_bound": elapsed / bound if bound > 0 else None,
        "admitted": admitted,
        "throttled": throttled,
        "slowdown_per_admitted": throttled / max(1, admitted),
        "goodput": goodput,
        "requests": admitted,
        "requests_per_rank": admitted / work.ranks,
        "downloads": len(ops) if work.direction == "load" and work.kind == "single" else None,
        "partitions_used": used,
        "splits": len(model.splits),
        "partition_lows": list(model.lows),
        "p50_s": times[len(times) // 2] if times else None,
        "p99_s": times[min(len(times) - 1, int(0.99 * len(times)))] if times else None,
        "events": clock.events,
    }


def bandwidth_bound_s(work: Workload, client: ClientParams, s3: S3Params, concurrency: int) -> float:
    """The time without any request limit: a rank's bytes through `concurrency` connections (each at most the
    connection rate, a host's together at most the NIC), plus the latency of each round of requests."""
    part = work.part_mib * MiB
    size = work.mib_per_rank * MiB
    parts = max(1, math.ceil(size / part))
    rounds = math.ceil(parts / concurrency)
    per_host_streams = min(client.ranks_per_host, work.ranks) * min(concurrency, parts)
    if work.direction == "load" and work.kind == "single":
        per_host_streams = min(concurrency, parts)  # one downloader per host (node mode)
    stream_rate = min(s3.conn_bytes_per_s, s3.host_bytes_per_s / per_host_streams)
    transfer = rounds * (s3.latency_s + min(part, size) / stream_rate)
    fixed = 2 * s3.latency_s  # create + complete (save); two small reads first (load: .metadata and item record)
    if work.kind == "dcp" and work.direction == "save":
        fixed += 2 * s3.latency_s  # then the coordinator's checksum record and .metadata, one after the other
    return transfer + fixed

"""S3 throttling: the request pacer's arithmetic (a made-up clock), the job-wide budget, and real jobs through the fault
proxy's `RateLimit` (a token bucket per direction answering ``503 SlowDown`` beyond its rate, as S3 does per prefix).

The multi-rank test starts 8 gloo ranks as 2 "nodes" (tests/helpers/throttle_worker.py): every rank saves (sync and
async), loads, saves and loads a DCP checkpoint and takes part in a node-mode resume download, all at once under a
write and a read limit; then the CLI verifies every checkpoint under the read limit. Request-rate pressure needs many
requests, not bytes: small objects, low rates. Numbers (SlowDown per admitted request, goodput) are the benchmark's
(benchmarks/bench_throttle.py); here every save and load must succeed, every value must load equal, and nothing may
be left behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import stat
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import Fault, FaultProxy, FaultRule, RateLimit, TokenBucket
from s3_servers import S3Endpoint, rank_environment, skip_unless_multirank_backend

import s3_checkpoint_cli as cli
import s3_node_sharing
import s3_pacing
import s3_process
import s3_utils
from s3_utils import (
    PacerLane,
    RequestPacer,
    RequestRates,
    S3ClientSettings,
    S3Utils,
)

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "helpers" / "throttle_worker.py"
MiB = 1 << 20


# --------------------------------------------------------------------------------------------------------------------
# The pacer's arithmetic, on a made-up clock
# --------------------------------------------------------------------------------------------------------------------


def sends(lane: PacerLane, times: list[float]) -> None:
    for t in times:
        assert lane.reserve(t) == 0.0


class OneHostStore:
    """A host's shared lane state in memory (what ``s3_node_sharing.SharedPacerFile`` keeps in /dev/shm)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.states = [s3_pacing.PacerLaneState(False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, ())] * 2
        self.flags = bytearray(2)

    def locked(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def load(self, lane: int) -> s3_pacing.PacerLaneState:
        return self.states[lane]

    def store(self, lane: int, state: s3_pacing.PacerLaneState) -> None:
        self.states[lane] = state
        self.flags[lane] = state.active

    def active_flag(self, lane: int) -> tuple[Any, int]:
        return self.flags, lane

    def last_success(self, lane: int) -> float:
        return self.states[lane].last_success


class TestPacerLane:
    def test_a_dormant_lane_never_holds_a_request(self) -> None:
        lane = PacerLane("writes")
        for n in range(1000):
            assert lane.reserve(n * 1e-4) == 0.0
            lane.on_success(n * 1e-4, n * 1e-4 + 0.01)
        assert not lane.active and lane.rate == math.inf and lane.throttles == 0

    def test_the_first_throttle_paces_at_0_7x_the_rate_requests_were_sent_at(self) -> None:
        lane = PacerLane("writes")
        sends(lane, [10 + n * 0.1 for n in range(20)])  # 10 per second over the 2 s window
        lane.on_throttle(sent=11.9, now=12.0)
        assert lane.active and lane.rate == pytest.approx(0.7 * 10, rel=0.06)
        rate = lane.rate
        assert lane.reserve(12.0) == pytest.approx(1 / rate)  # no token yet: the next one in 1/rate seconds
        assert lane.reserve(12.0 + 1 / rate) == 0.0
        assert lane.reserve(12.0 + 1 / rate) == pytest.approx(1 / rate)  # evenly spaced: no burst

    def test_throttles_of_requests_sent_before_the_last_decrease_count_once(self) -> None:
        lane = PacerLane("writes")
        sends(lane, [n * 0.05 for n in range(40)])  # 20 per second
        lane.on_throttle(sent=1.9, now=2.0)
        first = lane.rate
        for _ in range(9):  # the rest of the burst sent at the old rate answers: already reacted to
            lane.on_throttle(sent=1.95, now=2.01)
        assert lane.rate == first and lane.throttles == 10
        lane.on_throttle(sent=2.5, now=2.6)  # a request sent after the decrease: the rate is still too high
        assert lane.rate == pytest.approx(0.7 * first)

    def test_the_rate_never_drops_under_the_floor(self) -> None:
        lane = PacerLane("writes")
        lane.on_throttle(sent=0.0, now=0.0)  # nothing measured: the floor
        assert lane.rate == PacerLane.MIN_RATE
        for n in range(1, 20):
            lane.on_throttle(sent=n, now=n + 0.01)
        assert lane.rate == PacerLane.MIN_RATE

    def test_a_jobs_floors_add_up_to_job_min_rate_at_most(self) -> None:
        """The floor is MIN_RATE per process, but a job's floors together stay at JOB_MIN_RATE: 2,048 hosts of 8
        processes would otherwise never go under 3,277 requests/s, 94 % of what one S3 prefix serves, and could not
        make room by slowing down. A job of 8 processes keeps MIN_RATE each."""
        for world, floor in ((8, PacerLane.MIN_RATE), (16_384, PacerLane.JOB_MIN_RATE / 16_384)):
            store = OneHostStore(processes=8)
            lane = PacerLane("writes", shared=store, world=lambda world=world: world)
            sends(lane, [1.0 + n / 20 for n in range(20)])  # 10 per second over the 2 s window, while dormant
            lane.on_throttle(sent=1.95, now=2.0)
            assert lane.rate == pytest.approx(0.7 * 10 * 8, rel=0.06)  # the host's 8 processes at that pace
            for n in range(3, 40):
                lane.on_throttle(sent=n, now=n + 0.01)
            assert lane.rate == pytest.approx(8 * floor), world
        assert 2_048 * 8 * PacerLane.JOB_MIN_RATE / 16_384 == PacerLane.JOB_MIN_RATE

    def test_successes_grow_the_rate_more_for_slow_lanes_and_long_runs(self) -> None:
        def grown(rate: float, run: int) -> float:
            lane = PacerLane("writes")
            sends(lane, [n / 100 for n in range(64)])  # plenty measured: the 2x cap stays out of the way
            lane.on_throttle(sent=0.63, now=0.64)
            lane._rate = rate
            for _ in range(run):
                lane.on_success(sent=0.64, now=0.64)  # no time passed: no catch-up term
            return lane.rate

        step = PacerLane.GROWTH * (1 + 1 / PacerLane.STREAK_SCALE)
        assert grown(1.0, 1) == pytest.approx(1.0 * (1 + step))
        assert grown(4.0, 1) == pytest.approx(4.0 * (1 + step / 2))  # 1/sqrt(rate): slow lanes catch up
        two = 1.0 * (1 + step)
        two *= 1 + PacerLane.GROWTH * (1 + 2 / PacerLane.STREAK_SCALE) / math.sqrt(two)
        assert grown(1.0, 2) == pytest.approx(two)  # the second success of a run grows it more

    def test_every_lane_gains_the_same_catch_up_per_second(self) -> None:
        def gain(rate: float) -> float:
            lane = PacerLane("writes")
            sends(lane, [n / 100 for n in range(64)])
            lane.on_throttle(sent=0.63, now=0.64)
            lane._rate = rate
            step = quiet * PacerLane.GROWTH * (1 + 1 / PacerLane.STREAK_SCALE) / math.sqrt(rate)
            for n in range(64):
                lane.record_send(4.0 + n / 100)  # still sending: the 2x cap stays out of the way
            lane.on_success(sent=4.6, now=4.64)  # 4 s after the throttle
            return lane.rate - rate * (1 + step)

        quiet = 1 + (4.0 - PacerLane.WINDOW_S) / PacerLane.QUIET_S  # 4 s since the last cut: growth quickened
        assert gain(0.25) == pytest.approx(quiet * 4 * PacerLane.CATCH_UP) == pytest.approx(gain(3.0))

    def test_growth_stops_at_twice_the_rate_actually_sent(self) -> None:
        lane = PacerLane("reads")
        sends(lane, [0.0, 0.5, 1.0, 1.5])  # 2 per second
        lane.on_throttle(sent=1.5, now=1.6)
        for _ in range(200):
            lane.on_success(sent=1.6, now=1.7)  # no more sends: the lane is not using what it has
        assert lane.rate == pytest.approx(2 * lane.measured_rate(1.7))

    def test_a_lane_whose_requests_wait_doubles_within_doubling_s_not_a_window_late(self) -> None:
        """A lane using every token it gets grows past twice the send rate its 2 s window measured (which lags a full
        window behind it), but beyond that never more than doubles per `DOUBLING_S`; the same lane sending nothing
        stays at twice its measured rate."""

        def run(busy: bool) -> PacerLane:
            lane = PacerLane("writes")
            sends(lane, [n * 0.2 for n in range(10)])  # 5 per second
            lane.on_throttle(sent=1.8, now=1.9)
            now, sent, history = 1.9, 1.9, []
            while now < 6.0:  # 4 s without a cut: quiet-time growth
                now = round(now + 0.01, 2)
                while busy and lane.reserve(now) == 0.0:  # a request always waits: each token is used at once
                    sent = now
                lane.on_success(sent=sent, now=now)
                history.append((now, lane.rate, 2 * lane.measured_rate(now)))
            for (t0, r0, _), (t1, r1, cap) in itertools.pairwise(history):
                assert r1 <= max(cap, r0 * 2.0 ** ((t1 - t0) / PacerLane.DOUBLING_S)) * (1 + 1e-9)
            return lane

        busy = run(busy=True)
        assert busy.rate > 8 * 0.7 * 5 and busy.rate > 2.5 * busy.measured_rate(6.0)  # past 2x what the window saw
        assert run(busy=False).rate <= 2 * 5  # sending nothing: twice what it sent, at most

    def test_a_waiting_lane_after_hours_without_a_success_grows_without_overflow(self) -> None:
        """A lane at a huge job's floor may go hours between successes with its next token still not there: its
        growth is bounded, not a float overflow."""
        lane = PacerLane("writes", world=lambda: 10_000_000)  # floor: 800 requests/s over 10 million processes
        lane.on_throttle(sent=0.0, now=0.0)
        assert lane.reserve(0.0) > 0.0
        lane.on_success(sent=0.0, now=3600.0)  # an hour at 8e-05 tokens per second: 0.29 of one, still waiting
        assert lane.rate < math.inf

    def test_a_budget_paces_from_the_first_request_and_caps_growth(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("WORLD_SIZE", "4")
        pacer = RequestPacer(None, "bucket", world_size=s3_process.world_size)  # as `request_pacer` makes it
        assert not pacer.writes.active and not pacer.reads.active
        pacer.limit(RequestRates(write=8, read=None))
        assert pacer.writes.active and pacer.writes.rate == 2.0  # 8 per second for the job, 4 processes
        assert not pacer.reads.active  # no read budget: adaptive only
        pacer.limit(RequestRates(write=20, read=40))  # the smaller budget of each direction wins
        assert pacer.writes.rate == 2.0 and pacer.reads.rate == 10.0
        now = time.monotonic()
        for n in range(100):
            pacer.writes.on_success(now, now + n * 0.01)
        assert pacer.writes.rate == 2.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3500, RequestRates(3500, 3500)),
        ("100", RequestRates(100, 100)),
        ("write=3000,read=5000", RequestRates(3000, 5000)),
        ({"read": 50}, RequestRates(None, 50)),
        (None, None),
        ({}, None),
    ],
)
def test_request_rates_from_configs_and_flags(value: Any, expected: RequestRates | None) -> None:
    assert RequestRates.from_value(value) == expected
    assert S3ClientSettings(max_requests_per_second=value).max_requests_per_second == expected


@pytest.mark.parametrize("value", ["fast", "write=x", {"writes": 1}, 0, -5, "write=1,sideways=2", float("inf")])
def test_bad_request_rates_are_refused_up_front(value: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="max_requests_per_second"):
        RequestRates.from_value(value)


def test_the_proxy_token_bucket_admits_its_rate_after_its_burst() -> None:
    now = [0.0]
    bucket = TokenBucket(rate=4, capacity=2, clock=lambda: now[0])
    assert [bucket.admit() for _ in range(3)] == [True, True, False]
    now[0] = 0.25
    assert [bucket.admit(), bucket.admit()] == [True, False]
    now[0] = 10.0
    assert sum(bucket.admit() for _ in range(10)) == 2  # the burst never exceeds the capacity


# --------------------------------------------------------------------------------------------------------------------
# One process, through the proxy
# --------------------------------------------------------------------------------------------------------------------


def test_the_pacer_adds_nothing_when_nothing_throttles(
    fault_proxy: FaultProxy, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{uuid.uuid4().hex}")  # inside a job: the host's shared pacer
    limit = fault_proxy.add_rule(RateLimit(writes_per_s=10_000, reads_per_s=10_000))  # counts, never throttles
    utils = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url))
    data = os.urandom(11 * MiB)
    with utils.open_writer(f"s3://{bucket}/a.bin", chunk_size_MB=5) as writer:
        writer.write(data)
    assert utils.download_s3_file_to_stream(f"s3://{bucket}/a.bin", chunk_size_MB=5).read() == data
    assert [o.key for o in utils.list_objects(f"s3://{bucket}")] == ["a.bin"]
    pacer = utils.pacer(f"s3://{bucket}")
    assert pacer.shared
    for lane in (pacer.writes, pacer.reads):
        assert (lane.active, lane.waits, lane.waited_s, lane.throttles) == (False, 0, 0.0, 0), lane
    assert utils.retries == 0 and sum(limit.throttled.values()) == 0
    requests = [(r.method, r.query.split("&")[0]) for r in fault_proxy.requests]
    # create + 3 parts + complete (+ the checksum record where the store keeps none); HEAD + 3 ranges (+ the record)
    assert requests.count(("PUT", "partNumber=1")) == 1 and sum(q.startswith("partNumber=") for _, q in requests) == 3
    assert sum(m == "POST" for m, _ in requests) == 2 and requests.count(("HEAD", "")) == 1
    # GETs: 3 or 4, plus a checksum record read where the store keeps no checksums
    assert sum(m == "GET" and q == "" for m, q in requests) in (3, 4, 5) and len(requests) <= 14


def test_a_budget_keeps_a_process_under_the_store_limit(fault_proxy: FaultProxy, bucket: str) -> None:
    """16 threads, 20 small saves against a store admitting 20 writes per second: with a budget under that limit,
    the store never has to say SlowDown (and without one, it does)."""
    limit = fault_proxy.add_rule(RateLimit(writes_per_s=20, burst_s=0.5))
    settings = S3ClientSettings(endpoint_url=fault_proxy.endpoint_url, max_requests_per_second={"write": 12})
    utils = S3Utils(settings)

    def save_all(utils: S3Utils, name: str) -> float:
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            for _ in pool.map(
                lambda n: utils.upload_file_stream_to_s3(io_of(b"x" * 100), f"s3://{bucket}/{name}{n}"), range(20)
            ):
                pass
        return time.monotonic() - started

    elapsed = save_all(utils, "budget")
    writes = limit.admitted["write"]
    assert writes >= 20 and limit.throttled["write"] == 0
    assert elapsed >= (writes - 1) / 12 * 0.9  # paced at 12 per second, the first one at once
    assert utils.pacer(f"s3://{bucket}").writes.waits > 0
    save_all(S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url + "/")), "free")  # another pacer
    assert limit.throttled["write"] > 0


def test_a_budget_is_per_prefix_and_a_process_alone_does_not_wait_for_its_share() -> None:
    """A budget is per prefix, as S3's rates are: each process takes it over the job's processes that send there, all
    of them for the bucket's pacer, 1/N of them for one of N spread prefixes (`spread_over`). Requests a process sends
    alone (`sending_alone`: a DCP save's commit) do not wait for that share, until S3 throttles the lane."""
    now = 100.0
    own, spread, alone = (s3_pacing.RequestPacer(None, "b", clock=lambda: now, world_size=lambda: 64) for _ in range(3))
    spread.spread_over(16)
    for pacer in (own, spread, alone):
        pacer.limit(RequestRates(write=64.0, read=64.0))
    assert own.writes.rate == pytest.approx(1.0) and spread.writes.rate == pytest.approx(16.0)  # 64 / 4 processes
    own.spread_over(8)  # told after its budget: its lanes take the new share at once
    assert own.writes.rate == pytest.approx(8.0) and own.reads.rate == pytest.approx(8.0)
    own.spread_over(1)
    assert own.writes.rate == pytest.approx(1.0)

    lane = alone.writes
    assert lane.reserve(now) == 0.0 and lane.reserve(now) == pytest.approx(1.0)  # one token, then 1 s for the next
    with s3_pacing.sending_alone():
        assert [lane.reserve(now) for _ in range(5)] == [0.0] * 5
        lane.on_throttle(now, now + 0.1)  # S3 throttled it: paced again
        assert lane.reserve(now + 0.1) > 0.0
    assert alone.reads.reserve(now) == 0.0 and alone.reads.reserve(now) > 0.0  # after it: the share again


def test_a_slowdown_on_one_spread_prefix_paces_that_prefix_alone(fault_proxy: FaultProxy, bucket: str) -> None:
    """S3 serves each spread prefix (``run/s3ckpt-spread-XX/``) from a partition of its own: a SlowDown on one of them
    slows the requests to that prefix, not those to the other prefixes nor to the checkpoint's own (``run/step-1/``,
    the bucket's pacer)."""
    fault_proxy.add_rule(FaultRule(Fault.slow_down(), method="PUT", path_regex=r"/run/s3ckpt-spread-01/", times=2))
    fast = s3_utils.RetryPolicy(max_attempts=3, max_elapsed_s=10, initial_backoff_s=0.01, max_backoff_s=0.05)
    utils = S3Utils(S3ClientSettings(endpoint_url=fault_proxy.endpoint_url), fast)  # a token every 0.05 s at least
    hot, cold, own = "run/s3ckpt-spread-01/step-1/", "run/s3ckpt-spread-02/step-1/", "run/step-1/"
    for n, prefix in itertools.product(range(3), (hot, cold, own)):
        utils.upload_file_stream_to_s3(io_of(b"x" * 100), f"s3://{bucket}/{prefix}__{n}_0.distcp")
    pacers = {prefix: utils.pacer(f"s3://{bucket}/{prefix}__0_0.distcp") for prefix in (hot, cold, own)}
    assert pacers[hot].writes.throttles == 2 and pacers[hot].writes.active
    assert utils.pacer(f"s3://{bucket}/run/s3ckpt-spread-01/") is pacers[hot]  # a batch's URL: its directory
    assert len({id(pacer) for pacer in pacers.values()}) == 3
    for name in ("run/s3ckpt-spread-01", "run/", "", "run/step-1/s3ckpt-spread-01"):  # not in a spread directory
        assert utils.pacer(f"s3://{bucket}/{name}") is pacers[own]
    for prefix in (cold, own):
        for lane in (pacers[prefix].writes, pacers[prefix].reads):
            assert (lane.active, lane.throttles, lane.waits) == (False, 0, 0), (prefix, lane)
    fault_proxy.add_rule(FaultRule(Fault.slow_down(), method="POST", query="delete", times=1))
    assert utils.remove_objects_with_prefix(f"s3://{bucket}/{hot}") >= 3  # DeleteObjects: paced by its directory
    assert [o.key for o in utils.list_objects(f"s3://{bucket}/{hot}")] == []
    assert (pacers[hot].writes.throttles, pacers[cold].writes.throttles, pacers[own].writes.throttles) == (3, 0, 0)


# --------------------------------------------------------------------------------------------------------------------
# The pacer shared by a job's processes on one host (/dev/shm)
# --------------------------------------------------------------------------------------------------------------------

PACER_PROCESS = r"""
import json, os, sys, time
import s3_node_sharing, s3_utils
pacer = s3_utils.request_pacer("http://pacer-test.invalid", "bucket", os.environ.get("PACER_PARTITION", ""))
lane = pacer.writes
shared = next(iter(s3_node_sharing._shared_pacer_files.values()), None)
print(json.dumps({"shared": pacer.shared, "path": shared and shared.path}), flush=True)
for line in sys.stdin:
    command, *args = line.split()
    started, waits = time.monotonic(), lane.waits
    if command == "send":  # n requests, as the retry loop makes them
        for _ in range(int(args[0])):
            lane.on_success(lane.acquire(), time.monotonic())
    elif command == "throttle":
        lane.on_throttle(time.monotonic(), time.monotonic())
    elif command == "budget":
        pacer.limit(s3_utils.RequestRates(write=float(args[0])))
    reply = {"active": lane.active, "rate": lane.rate, "processes": lane.processes, "waits": lane.waits - waits}
    print(json.dumps({**reply, "seconds": time.monotonic() - started}), flush=True)
"""


class PacerProcess:
    """A real process of a job (its environment says which) holding the pacer of one bucket (or of the spread prefix
    ``PACER_PARTITION`` names), driven line by line."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PACER_PROCESS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=REPO,
            text=True,
        )
        self.hello = self.read()

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the pacer process exited with {self.proc.wait()}"
        return json.loads(line)

    def __call__(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=30)


def test_a_jobs_processes_on_a_host_share_one_pacer() -> None:
    """Two processes of one job: dormant, neither waits; the first throttle one of them sees makes the other pace;
    the file is this user's, mode 0600, and goes away with its last user. A process of another job is not paced."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHELASTIC_RUN_ID": f"test-{uuid.uuid4().hex}", "WORLD_SIZE": "4"}
    env.pop("S3CKPT_PACER_SHARING", None)
    first, second = PacerProcess(env), PacerProcess(env)
    other_job = PacerProcess({**env, "TORCHELASTIC_RUN_ID": f"test-{uuid.uuid4().hex}"})
    try:
        assert first.hello["shared"] and first.hello["path"] == second.hello["path"] != other_job.hello["path"]
        found = os.stat(first.hello["path"], follow_symlinks=False)
        assert stat.S_ISREG(found.st_mode) and stat.S_IMODE(found.st_mode) == 0o600 and found.st_uid == os.geteuid()
        assert found.st_size == s3_node_sharing.SharedPacerFile.SIZE
        assert os.path.exists(first.hello["path"])  # another job's new file removed only unused ones

        dormant = second("send 200")  # nothing throttled yet: nothing waits, in either process
        assert (dormant["active"], dormant["waits"], dormant["processes"]) == (False, 0, 2)
        assert first("send 40")["waits"] == 0

        woken = first("throttle")  # 40 sent in the 2 s window: 20/s, x0.7, for 2 processes
        assert woken["active"] and woken["rate"] == pytest.approx(2 * 0.7 * 40 / 2, rel=0.2)
        paced = second("send 6")  # never throttled itself, yet paced by the host's token bucket
        assert paced["active"] and paced["waits"] >= 5
        assert paced["seconds"] >= 5 / paced["rate"] * 0.8
        assert not other_job("send 50")["active"] and other_job("send 1")["waits"] == 0  # another job: its own

        budget = second("budget 8")  # 8 writes/s for a job of 4 processes: this host's 2 take 2 shares
        assert budget["rate"] == pytest.approx(4.0)
    finally:
        codes = [process.close() for process in (first, second, other_job)]
    assert codes == [0, 0, 0]
    assert not os.path.exists(first.hello["path"]) and not os.path.exists(other_job.hello["path"])


def test_a_spread_prefixs_lane_is_shared_by_the_jobs_processes_on_the_host_apart_from_the_buckets() -> None:
    """Two processes of one job pacing the spread prefix ``run/s3ckpt-spread-01/`` share its lane (a file of its own):
    one's SlowDown paces the other; the same job's lanes of the bucket and of another spread prefix stay dormant."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHELASTIC_RUN_ID": f"test-{uuid.uuid4().hex}", "WORLD_SIZE": "4"}
    env.pop("S3CKPT_PACER_SHARING", None)
    hot = {**env, "PACER_PARTITION": "run/s3ckpt-spread-01/"}
    first, second = PacerProcess(hot), PacerProcess(hot)
    others = [PacerProcess(env), PacerProcess({**env, "PACER_PARTITION": "run/s3ckpt-spread-02/"})]
    try:
        paths = [process.hello["path"] for process in (first, second, *others)]
        assert all(process.hello["shared"] for process in (first, second, *others))
        assert paths[0] == paths[1] and len(set(paths)) == 3
        assert stat.S_IMODE(os.stat(paths[0]).st_mode) == 0o600
        first("send 40")
        assert first("throttle")["active"]
        paced = second("send 4")  # never throttled itself: paced by its prefix's host lane
        assert paced["active"] and paced["waits"] >= 3 and paced["processes"] == 2
        for other in others:  # the bucket's lane and another prefix's: dormant, never waiting
            assert (lambda reply: (reply["active"], reply["waits"]))(other("send 50")) == (False, 0)
    finally:
        codes = [process.close() for process in (first, second, *others)]
    assert codes == [0, 0, 0, 0]
    assert not any(os.path.exists(path) for path in paths)


@pytest.fixture
def pacer_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Shared pacer files in `tmp_path` (not /dev/shm), for a job of this process's own."""
    monkeypatch.setattr(s3_node_sharing, "PACER_SHARED_DIR", str(tmp_path))
    monkeypatch.setattr(s3_node_sharing, "_shared_pacer_files", {})
    monkeypatch.setattr(s3_node_sharing, "_shared_pacer_problems", set())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"test-{uuid.uuid4().hex}")
    monkeypatch.delenv("S3CKPT_PACER_SHARING", raising=False)
    return tmp_path


def pacer_path(bucket: str) -> str:
    key = s3_node_sharing._shared_pacer_key(None, bucket)
    assert key is not None
    return s3_node_sharing.SharedPacerFile.path_for(key)


def test_the_shared_pacer_file_is_created_exclusively_with_mode_0600(pacer_dir: Path) -> None:
    leftover = str(pacer_dir / "s3ckpt-pacer-0-left-by-a-killed-job")
    os.close(s3_node_sharing.create_shared_file(leftover))  # nobody holds it
    old = os.umask(0o277)  # a umask that takes even the owner's write bit: the file is still 0600
    try:
        shared = s3_node_sharing.shared_pacer_file(None, "bucket")
    finally:
        os.umask(old)
    assert shared is not None and shared.path == pacer_path("bucket")
    try:
        assert stat.S_IMODE(os.stat(shared.path).st_mode) == 0o600
        with pytest.raises(FileExistsError):
            s3_node_sharing.create_shared_file(shared.path)  # O_EXCL: nobody creates it twice
        assert RequestPacer(None, "bucket", shared).shared
        assert not os.path.exists(leftover)  # a new job's file: unused ones of finished jobs are removed
    finally:
        shared.close()
    assert not os.path.exists(shared.path)  # its only user left


def _refused(bucket: str, caplog: pytest.LogCaptureFixture) -> str:
    with caplog.at_level("WARNING", logger="s3_node_sharing"):
        assert s3_node_sharing.shared_pacer_file(None, bucket) is None
        assert s3_node_sharing.shared_pacer_file(None, bucket) is None  # asked again: one warning
    warnings = [r.getMessage() for r in caplog.records if "paces on its own" in r.getMessage()]
    assert len(warnings) == 1, warnings
    caplog.clear()
    return warnings[0]


def test_a_link_or_a_file_not_ours_is_refused_and_the_process_paces_alone(
    pacer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = pacer_dir / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, pacer_path("linked"))
    assert "symbolic links" in _refused("linked", caplog)  # O_NOFOLLOW
    assert target.read_bytes() == b""  # never written through the link

    readable = pacer_path("readable")
    Path(readable).write_bytes(bytes(s3_node_sharing.SharedPacerFile.SIZE))
    os.chmod(readable, 0o644)
    assert "mode 644" in _refused("readable", caplog)

    if os.geteuid() == 0:  # only root can make a file someone else owns
        foreign = pacer_path("foreign")
        fd = s3_node_sharing.create_shared_file(foreign)
        os.fchown(fd, 65534, 65534)
        os.close(fd)
        assert "owner 65534" in _refused("foreign", caplog)

    lane = RequestPacer(None, "linked", None).writes  # what request_pacer makes then: a pacer of its own
    lane.on_throttle(0.0, 0.0)
    assert lane.active and not lane.shared and lane.processes == 1


def test_without_dev_shm_or_a_job_each_process_paces_alone(
    pacer_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(s3_node_sharing, "PACER_SHARED_DIR", str(pacer_dir / "missing"))
    assert "not a directory" in _refused("bucket", caplog)
    monkeypatch.setattr(s3_node_sharing, "PACER_SHARED_DIR", str(pacer_dir))
    for name in s3_process.LAUNCHER_ENV_VARS["job"]:
        monkeypatch.delenv(name, raising=False)
    assert s3_node_sharing.shared_pacer_file(None, "no-job") is None  # no launcher: nothing to share, nothing said
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("S3CKPT_PACER_SHARING", "0")
    assert not s3_utils.request_pacer(None, "switched-off").shared  # S3CKPT_PACER_SHARING=0: never asks for a file
    assert list(pacer_dir.iterdir()) == []


def io_of(data: bytes) -> Any:
    import io

    return io.BytesIO(data)


# --------------------------------------------------------------------------------------------------------------------
# 8 ranks as 2 nodes, at once, under a write and a read limit
# --------------------------------------------------------------------------------------------------------------------

WORLD, PER_NODE = 8, 4


def run_job(server: S3Endpoint, endpoint_url: str, base: str, out: Path, timeout: float = 240) -> str:
    """Run the job (one process forking WORLD ranks); its output, after asserting it exited 0."""
    out.mkdir(parents=True, exist_ok=True)
    env = rank_environment(server, endpoint_url)
    command = [sys.executable, str(WORKER), "--world", str(WORLD), "--per-node", str(PER_NODE)]
    command += ["--base", base, "--out", str(out)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    output = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode == 0, output
    return output


def digest(s3_client: Any, bucket: str, key: str) -> str:
    return hashlib.sha256(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()).hexdigest()


@pytest.mark.slow
def test_eight_ranks_save_and_load_everything_under_request_limits(
    s3_server: S3Endpoint, s3_client: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    skip_unless_multirank_backend(s3_server)  # starting 8 ranks dominates its time; the store does not change pacing
    base = f"s3://{bucket}/run"
    previous = {f"run/rank{r}/previous.ckpt": os.urandom(1000 + r) for r in range(WORLD)}
    for key, data in previous.items():  # an older checkpoint beside each rank's new ones
        s3_client.put_object(Bucket=bucket, Key=key, Body=data)
    with FaultProxy(s3_server.endpoint_url) as proxy:
        limit = proxy.add_rule(RateLimit(writes_per_s=30, reads_per_s=60, burst_s=0.1, path_regex=f"^/{bucket}/"))
        run_job(s3_server, proxy.endpoint_url, base, tmp_path)
        reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
        for report in reports:
            assert "error" not in report, report["error"]
            failed = {name: step for name, step in report["steps"].items() if not step["ok"]}
            assert not failed, f"rank {report['rank']}: {failed}"
            assert set(report["steps"]) >= {"sync_save", "async_save", "sync_load", "async_load", "dcp_save"}
            assert {"dcp_load", "node_load"} <= set(report["steps"])
        # The limits bit, in both directions, and the pacers reacted (a store that never throttled proves nothing).
        assert limit.throttled["write"] > 0 and limit.throttled["read"] > 0, (limit.admitted, limit.throttled)
        assert any(r["pacer"]["writes"]["activations"] for r in reports)
        assert any(r["pacer"]["reads"]["activations"] for r in reports)
        # Paced, not hammered: without a pacer, immediate retries would be many times the admitted requests.
        for direction in ("write", "read"):
            assert limit.throttled[direction] <= 3 * limit.admitted[direction], (limit.admitted, limit.throttled)

        # The CLI verifies every checkpoint (16 single files, 8 older ones, the DCP one) under the read limit.
        before = dict(limit.throttled)
        code = cli.main(["verify", base, "-r", "--allow-unverified", "--endpoint-url", proxy.endpoint_url])
        out = capsys.readouterr().out
        assert code == 0, out
        assert len(re.findall(r"^OK +s3://\S+\.ckpt ", out, flags=re.MULTILINE)) >= 2 * WORLD + WORLD + 1, out
        assert limit.admitted["read"] > 0 and limit.throttled["read"] >= before["read"]

    uploads = s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert uploads == []
    for key, data in previous.items():
        assert hashlib.sha256(data).hexdigest() == digest(s3_client, bucket, key)

"""The S3-at-scale simulation (benchmarks/s3_sim.py, benchmarks/bench_scale_sim.py): the model's invariants and its
agreement with the 8- and 32-writer emulation bench_throttle measured. Small rank counts: seconds, no server."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

import s3_node_sharing

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_scale_sim  # noqa: E402
import s3_sim  # noqa: E402

SMALL_S3 = s3_sim.S3Params(write_rate=350.0, read_rate=550.0)
"""A tenth of S3's per-partition rates, so that a few hundred ranks meet the limit as thousands meet S3's."""


def test_no_request_beyond_a_partitions_capacity_is_admitted() -> None:
    """A flood at ten times the rate: over any stretch, admitted <= rate x seconds + burst; the rest is SlowDown."""
    params = s3_sim.S3Params(write_rate=100.0, burst_s=1.0, split_after_s=math.inf)
    model = s3_sim.S3Model(params)
    admitted_at = []
    for n in range(10_000):  # 1,000 requests/s for 10 s
        now = s3_sim.T0 + n / 1000.0
        if model.request("write", f"run/step-1/k{n}", now):
            admitted_at.append(now)
    admitted, throttled = model.totals("write")
    assert admitted + throttled == 10_000 and admitted == len(admitted_at)
    for i, start in enumerate(admitted_at[::50]):
        for end in admitted_at[i * 50 :: 97]:
            inside = sum(1 for t in admitted_at if start <= t <= end)
            assert inside <= params.write_rate * (end - start) + params.write_rate * params.burst_s + 1
    assert admitted <= 100 * 10 + 100 + 1 and throttled >= 8_800


def test_a_simulated_save_admits_no_more_than_the_partition_allows() -> None:
    result = s3_sim.run(s3_sim.Workload(ranks=256, mib_per_rank=64), s3=SMALL_S3)
    span = result["elapsed_s"]
    assert result["failed"] == 0 and result["throttled"] > 0
    assert result["admitted"] <= SMALL_S3.write_rate * (span + SMALL_S3.burst_s) + 1
    assert result["admitted"] == 256 * 6  # create, 4 parts, complete: every request admitted once


def test_a_partition_under_sustained_slowdown_splits_and_keys_map_by_range() -> None:
    params = s3_sim.S3Params(write_rate=10.0, split_after_s=5.0, quiet_s=1.0)
    model = s3_sim.S3Model(params)
    for n in range(2_000):  # 100/s for 20 s on keys a..z
        model.request("write", f"run/step-1/{chr(97 + n % 26)}", s3_sim.T0 + n / 100.0)
    assert model.splits and len(model.partitions) == len(model.splits) + 1
    assert model.partition_of("run/step-1/a") is not model.partition_of("run/step-1/z")
    assert model.partition_of("") is model.partitions[0]


def test_a_run_without_throttling_reaches_the_bandwidth_bound() -> None:
    for kind in ("single", "dcp"):
        work = s3_sim.Workload(kind=kind, ranks=64, mib_per_rank=256)
        result = s3_sim.run(work, s3=s3_sim.S3Params(unlimited=True))
        assert result["throttled"] == 0
        assert result["bandwidth_bound_s"] * 0.9 <= result["elapsed_s"] <= result["bandwidth_bound_s"] * 1.1, result


def test_the_pacer_takes_slowdowns_down_against_no_pacer() -> None:
    work = s3_sim.Workload(ranks=512, mib_per_rank=64)
    paced = s3_sim.run(work, s3_sim.ClientParams(), SMALL_S3)
    unpaced = s3_sim.run(work, s3_sim.ClientParams(pacer="none"), SMALL_S3)
    budget = s3_sim.run(work, s3_sim.ClientParams(pacer="budget", budget=(350.0, 550.0)), SMALL_S3)
    assert paced["failed"] == budget["failed"] == 0
    assert paced["slowdown_per_admitted"] < unpaced["slowdown_per_admitted"] / 2
    assert paced["elapsed_s"] < unpaced["elapsed_s"]
    assert budget["slowdown_per_admitted"] < 0.05  # the budget starts at a pace the partition serves


def test_resume_requests_are_proportional_to_nodes() -> None:
    """The package's own decision (`s3_node_sharing.downloading_ranks`): one download per node, or one per job."""
    counts = {}
    for ranks in (64, 128):
        for sharing in ("node", "job"):
            work = s3_sim.Workload(kind="single", direction="load", ranks=ranks, mib_per_rank=64, load_sharing=sharing)
            result = s3_sim.run(work, s3=SMALL_S3)
            assert result["failed"] == 0
            counts[ranks, sharing] = (result["downloads"], result["admitted"])
    assert counts[64, "node"][0] == 8 and counts[128, "node"][0] == 16
    assert counts[128, "node"][1] == 2 * counts[64, "node"][1]
    assert counts[64, "job"] == counts[128, "job"] and counts[64, "job"][0] == 1


def test_spreading_over_partitioned_prefixes_lifts_the_request_bound() -> None:
    one = s3_sim.run(s3_sim.Workload(kind="dcp", ranks=512, mib_per_rank=64), s3=SMALL_S3)
    spread = s3_sim.run(
        s3_sim.Workload(kind="dcp", ranks=512, mib_per_rank=64, layout="spread", prefixes=8), s3=SMALL_S3
    )
    assert spread["partitions_used"] >= 8 and one["partitions_used"] == 1
    assert spread["elapsed_s"] < one["elapsed_s"] / 3 and spread["throttled"] < one["throttled"]


def test_the_simulation_is_deterministic() -> None:
    work = s3_sim.Workload(ranks=256, mib_per_rank=64)
    first, second = (s3_sim.run(work, s3_sim.ClientParams(pacer="none"), SMALL_S3, seed=3) for _ in range(2))
    assert first == second


def test_a_latency_draw_is_its_own_deterministic_stream_and_draw_0_is_the_published_one() -> None:
    work = s3_sim.Workload(ranks=256, mib_per_rank=64)
    published = s3_sim.run(work, s3_sim.ClientParams(), SMALL_S3)
    draws = [s3_sim.run(work, s3_sim.ClientParams(), dataclasses.replace(SMALL_S3, latency_draw=d)) for d in (0, 1, 1)]
    assert draws[0] == published
    assert draws[1] == draws[2]
    assert draws[1]["elapsed_s"] != published["elapsed_s"]
    rows = [bench_scale_sim.row_of("pacer", result, draw) for draw, result in enumerate((published, draws[1]))]
    doc = {"rows": rows, "args": {"mib": 64.0, "draws": 2}}
    (line,) = [line for line in bench_scale_sim.draws_table(doc) if line.startswith("| save single")]
    low, high = sorted(row["elapsed_s"] for row in rows)
    met = sum(row["meets"] for row in rows)
    assert line.split(" | ")[4] == f"{low:.2f}-{high:.2f}" and line.endswith(f"| {met} of 2 |")
    assert bench_scale_sim.first_draw(rows) == rows[:1]
    assert bench_scale_sim.draws_table({"rows": rows[:1], "args": doc["args"]}) == []


def test_the_simulation_agrees_with_the_emulation_bench_throttle_measured() -> None:
    """bench_throttle's measured `ours` rows (8 and 32 writers, saves and loads) against the same setup simulated."""
    rows = bench_scale_sim.emulation_check()
    assert len(rows) == 6 and {(r["direction"], r["writers"]) for r in rows} == {
        ("save", 8), ("load", 8), ("save", 32), ("load", 32)
    }
    assert [r for r in rows if not r["agree"]] == []


def test_who_downloads_is_the_packages_decision() -> None:
    node_keys = ["a", "a", "b", "b", "c"]
    assert s3_node_sharing.downloading_ranks(node_keys, "node") == [0, 2, 4]
    assert s3_node_sharing.downloading_ranks(node_keys, "job") == [0]
    assert s3_node_sharing.downloading_ranks(node_keys, "rank") == [0, 1, 2, 3, 4]
    assert s3_node_sharing.downloading_ranks(["a", "a"], "job") == [0]  # one node: its lowest rank


def test_lanes_left_with_work_refill_the_partition_once_others_finish() -> None:
    """The tail: after some hosts finish, the others' lanes grow back faster the longer S3 has not throttled
    (`PacerLane.QUIET_S`), and a lane whose requests wait for its tokens doubles every `PacerLane.DOUBLING_S` rather
    than a measuring window late, so a save and a DCP load of 512 ranks against a tenth of S3's rates (as 4,096-5,120
    ranks against S3's) take at most 1.3x and 1.45x the partition-capacity bound, its requests beyond its burst at its
    rate (1.24x and 1.34x; 1.34x and 1.54x when growth stopped at twice the measured send rate; 1.58x and 2.17x with
    growth that ignored quiet time too)."""
    for work, most in (
        (s3_sim.Workload(kind="single", ranks=512, mib_per_rank=64), 1.3),
        (s3_sim.Workload(kind="dcp", direction="load", ranks=512, mib_per_rank=64), 1.45),
    ):
        result = s3_sim.run(work, s3=SMALL_S3)
        assert result["failed"] == 0 and result["throttled"] > 0
        assert result["time_over_bound"] <= most, (work, result["time_over_bound"])


def test_no_run_beats_the_partition_capacity_bound() -> None:
    """The bound is a partition's burst plus its rate: in t seconds it admits at most its burst and t x its rate, so
    a run whose burst serves much of it (spread over partitioned prefixes) still takes no less than the bound, and
    one that the burst serves entirely has only its bandwidth bound."""
    for work in (
        s3_sim.Workload(kind="dcp", ranks=512, mib_per_rank=64, layout="spread", prefixes=8),
        s3_sim.Workload(kind="dcp", ranks=512, mib_per_rank=64),
        s3_sim.Workload(kind="single", ranks=32, mib_per_rank=64),
    ):
        result = s3_sim.run(work, s3=SMALL_S3)
        assert result["failed"] == 0
        assert result["elapsed_s"] >= result["capacity_bound_s"]
        assert result["time_over_bound"] >= 0.95, (work, result["time_over_bound"])


def test_a_grown_lane_wakes_the_hosts_waiting_requests() -> None:
    """`PacerLane.acquire` waits on a condition that a success growing the rate notifies: a host cut to the floor
    (one token per 5 s) sends again as soon as it grows, not when its old wait ends. A node-mode resume of 1,024
    ranks against a tenth of S3's rates (as 10,240 against S3's) then ends within 1.3x its bound (1.15x; 1.37x when
    the waiting requests slept through the growth)."""
    work = s3_sim.Workload(kind="single", direction="load", ranks=1024, mib_per_rank=1024)
    result = s3_sim.run(work, s3=SMALL_S3)
    assert result["failed"] == 0 and result["throttled"] > 0
    assert result["time_over_bound"] <= 1.3, result["time_over_bound"]


def test_a_ranks_requests_to_a_spread_prefix_go_through_that_prefixs_pacer_shared_by_its_hosts_ranks() -> None:
    """As `s3_utils.request_pacer` paces them: a rank's request to ``run/s3ckpt-spread-XX/`` goes through that
    prefix's pacer, whose lanes the host's ranks sending there share (and only they count); a SlowDown there slows
    neither the bucket's lanes nor another prefix's."""
    spread = [f"run/s3ckpt-spread-0{n}/" for n in range(2)]
    cluster = s3_sim.Cluster(
        16, s3_sim.S3Model(SMALL_S3), s3_sim.ClientParams(), s3_sim.Clock(),
        partitions={rank: {spread[rank % 2]} for rank in range(16)},
    )

    def lane(rank: int, key: str) -> s3_sim.s3_pacing.PacerLane:
        return cluster.lane(s3_sim.Request(None, "read", key, 0, rank))  # type: ignore[arg-type]

    shard = lane(0, f"{spread[0]}step-1/__0_0.distcp")
    assert shard is lane(0, f"{spread[0]}step-2/__0_0.distcp") is cluster.pacer(0, spread[0]).reads
    assert lane(0, "run/step-1/.metadata") is cluster.pacer(0, "").reads is not shard
    shard.on_throttle(s3_sim.T0, s3_sim.T0)
    assert shard.active and shard.processes == 4  # ranks 0, 2, 4, 6 of host 0
    assert lane(2, f"{spread[0]}step-1/__2_0.distcp").active  # the host's lane of that prefix
    for other in (lane(0, "run/step-1/.metadata"), lane(1, f"{spread[1]}step-1/__1_0.distcp"),
                  lane(8, f"{spread[0]}step-1/__8_0.distcp")):  # the bucket's, another prefix's, another host's
        assert not other.active
    assert cluster.stores[0, ""].processes == 8 and cluster.stores[0, spread[1]].processes == 4


def test_the_budget_client_takes_a_budget_per_prefix_as_the_package_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is per prefix: a spread prefix's pacer is told it is one of the spread prefixes
    (`RequestPacer.spread_over`, as `S3StorageWriter` and `S3StorageReader` tell it), so its processes take the budget
    over the ranks that send there (1/2 of the job here), the bucket's pacer over all of them."""
    spread = [f"run/s3ckpt-spread-0{n}/" for n in range(2)]
    monkeypatch.setenv("WORLD_SIZE", "16")  # as s3_sim.run sets it
    cluster = s3_sim.Cluster(
        16, s3_sim.S3Model(SMALL_S3), s3_sim.ClientParams(pacer="budget", budget=(160.0, 320.0)), s3_sim.Clock(),
        partitions={rank: {spread[rank % 2]} for rank in range(16)},
    )
    assert cluster.pacer(0, spread[0]).writes.rate == pytest.approx(4 * 160.0 / 8)  # host 0's 4 ranks sending there
    assert cluster.pacer(0, spread[0]).reads.rate == pytest.approx(4 * 320.0 / 8)
    assert cluster.pacer(0, "").writes.rate == pytest.approx(8 * 160.0 / 16)  # the bucket's: all 8, over all 16


def test_the_oracle_client_is_never_throttled_and_takes_no_longer_than_any_client() -> None:
    """The oracle (one job-wide queue per partition, sent the moment the partition holds a token) is the measure of
    the least time any client takes: no SlowDown, no slower than the pacer, the budget or no pacer, no faster than the
    partition-capacity bound; and its goodput, of the hottest partition up to that partition's last admission (not
    the bucket's: here a spread DCP save's records go to a partition of their own after the shards), is whole."""
    work = s3_sim.Workload(kind="dcp", ranks=1024, mib_per_rank=64, layout="spread", prefixes=2)
    records_apart = ["run/step-"]  # .metadata and the checksum record in their own partition
    oracle = s3_sim.run(work, s3_sim.ClientParams(pacer="oracle"), SMALL_S3, partitions=records_apart)
    assert oracle["failed"] == 0 and oracle["throttled"] == 0
    assert oracle["capacity_bound_s"] <= oracle["elapsed_s"] <= 1.1 * oracle["bound_s"]
    assert oracle["goodput"] is not None and oracle["goodput"] >= 0.99, oracle["goodput"]
    budget = s3_sim.ClientParams(pacer="budget", budget=(2 * 350.0, 2 * 550.0))
    for client in (s3_sim.ClientParams(), budget, s3_sim.ClientParams(pacer="none")):
        other = s3_sim.run(work, client, SMALL_S3, partitions=records_apart)
        assert other["elapsed_s"] >= oracle["elapsed_s"] - 0.05, (client.pacer, other["elapsed_s"])

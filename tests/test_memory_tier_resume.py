"""The memory tier on two simulated nodes: resume from the fastest tier (one collective decision on the newest
step every rank can load from its node's memory, a peer's replica or S3, then each rank reads its part from there),
and a node's bound of ``keep`` own copies while replication to its peer lags.

Each node is a gloo rank of its own (``GROUP_RANK``) with its own tier under tmp_path; a node loss is its tier
directory removed between the kill and the relaunch (tests/helpers/tier_resume_worker.py).
"""

from __future__ import annotations

import io
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_servers import rank_environment, wait_for_ranks

import s3_tier_replication
from s3_memory_tier import decide

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "helpers" / "tier_resume_worker.py"
NEMO_WORKER = REPO / "tests" / "helpers" / "nemo_tier_resume_worker.py"


def run_job(s3_server: Any, bucket: str, out: Path, *args: str) -> list[dict[str, Any]]:
    """Both ranks of one launch of the job; the resume's results of each rank (none for a save)."""
    env = rank_environment(s3_server, s3_server.endpoint_url, WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), bucket, str(out), *args],
            env={**env, "RANK": str(rank), "GROUP_RANK": str(rank), "LOCAL_RANK": "0"},
            cwd=REPO,
        )
        for rank in range(2)
    ]
    assert wait_for_ranks(procs, 300) == [0, 0]
    if args[0] != "resume":
        return []
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def url(bucket: str, rank: int, step: int) -> str:
    return f"s3://{bucket}/run/rank{rank}/step={step}.ckpt"


def skip_unless_moto(s3_server: Any, covered_on_seaweedfs_by: str) -> None:
    """Skip a scenario on any store but moto (CI time): its S3 requests (a drain's PUTs, rank 0's LIST) are a subset
    of what `covered_on_seaweedfs_by`, which runs on SeaweedFS too, makes there in the same kind of scenario."""
    if s3_server.name != "moto":
        pytest.skip(f"the same store requests as {covered_on_seaweedfs_by} on this store: moto is enough (CI time)")


def held_replica(out: Path, holder: int, step: int) -> Path:
    """The file of the replica of the other node's `step` that node `holder` holds."""
    found = [p for p in (out / f"node{holder}").rglob(f"step={step}.ckpt") if "replicas" in p.parts]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_a_restart_on_the_same_nodes_reads_every_part_from_memory(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    """Moto only: SeaweedFS sees the same requests in test_soak.py's tier soak (relaunches that resume from memory)."""
    skip_unless_moto(s3_server, "test_soak.py's tier soak")
    run_job(s3_server, bucket, tmp_path, "save", "10", "1", "2", "3")  # step 1 on S3, 2 and 3 in memory only
    ranks = run_job(s3_server, bucket, tmp_path, "resume")
    for rank, found in enumerate(ranks):
        assert (found["step"], found["url"], found["tier"], found["equal"]) == (3, url(bucket, rank, 3), "memory", True)


@pytest.mark.slow
def test_a_replaced_node_fetches_its_part_from_its_peers_replica(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    """Moto only: SeaweedFS sees the same requests on node losses in test_both_nodes_lost_resume_the_newest_step_on_s3
    and test_soak.py's tier soak (a lost node fetches its peer's replica there)."""
    skip_unless_moto(s3_server, "test_both_nodes_lost_resume_the_newest_step_on_s3")
    run_job(s3_server, bucket, tmp_path, "save", "10", "1", "2", "3")
    shutil.rmtree(tmp_path / "node1")  # node 1 lost: a new node with an empty tier takes its place
    node0, node1 = run_job(s3_server, bucket, tmp_path, "resume")
    assert (node0["step"], node0["tier"], node0["equal"]) == (3, "memory", True)
    assert (node1["step"], node1["tier"], node1["equal"]) == (3, "replica", True)
    assert url(bucket, 1, 3) in node1["own"]  # the fetched replica is the new node's memory copy now


@pytest.mark.slow
def test_both_nodes_lost_resume_the_newest_step_on_s3(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    run_job(s3_server, bucket, tmp_path, "save", "2", "1", "2", "3", "4")  # steps 1 and 3 on S3
    shutil.rmtree(tmp_path / "node0")
    shutil.rmtree(tmp_path / "node1")
    for rank, found in enumerate(run_job(s3_server, bucket, tmp_path, "resume")):
        assert (found["step"], found["url"], found["tier"], found["equal"]) == (3, url(bucket, rank, 3), "s3", True)


@pytest.mark.slow
def test_a_corrupt_replica_is_skipped_for_s3_at_the_same_step(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    run_job(s3_server, bucket, tmp_path, "save", "1", "1", "2")  # every step on S3 too
    shutil.rmtree(tmp_path / "node1")
    replica = held_replica(tmp_path, 0, 2)  # node 0's copy of node 1's step 2
    data = bytearray(replica.read_bytes())
    data[len(data) // 2] ^= 0xFF
    replica.write_bytes(bytes(data))
    node0, node1 = run_job(s3_server, bucket, tmp_path, "resume")
    assert node0["step"] == node1["step"] == 2
    assert (node0["tier"], node0["equal"]) == ("memory", True)
    assert (node1["tier"], node1["equal"]) == ("s3", True)


@pytest.mark.slow
def test_a_step_only_one_node_holds_is_not_chosen(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    """Moto only: SeaweedFS sees the same requests (S3 older than one node's memory) in
    test_nemo_resume_if_exists_resumes_the_newest_step_every_node_can_load."""
    skip_unless_moto(s3_server, "test_nemo_resume_if_exists_resumes_the_newest_step_every_node_can_load")
    run_job(s3_server, bucket, tmp_path, "save", "10", "1", "2", "3")
    for holder in (0, 1):  # node 1 was killed before its step 3, node 0's step 3 never reached node 1: only node
        replica = held_replica(tmp_path, holder, 3)  # 0's memory holds a step 3 (not replicated, not on S3)
        replica.parent.with_name(replica.parent.name + s3_tier_replication.MANIFEST_SUFFIX).unlink()
        shutil.rmtree(replica.parent)
    for path in (tmp_path / "node1").rglob("step=3.ckpt*"):
        path.unlink()
    node0, node1 = run_job(s3_server, bucket, tmp_path, "resume")
    assert node0["step"] == node1["step"] == 2  # not 3 (node 1 cannot load it), and newer than S3's step 1
    assert (node0["tier"], node1["tier"], node0["equal"], node1["equal"]) == ("memory", "memory", True, True)
    assert node0["steps"] == [2, 1]
    assert node0["discovered"] == [url(bucket, 0, 1), url(bucket, 0, 2)]  # discovery leaves out what rank 1 lacks


@pytest.mark.slow
@pytest.mark.lightning
def test_nemo_resume_if_exists_resumes_the_newest_step_every_node_can_load(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """``check_resume`` (NeMo's exp_manager, before the process group) sees node 0's memory, which holds a newer
    checkpoint than S3 that node 1 cannot load (not replicated). Once the process group is up the ranks agree, and
    every rank resumes the newest one every rank can load, at once: strict (no fallback), nothing fails to load."""
    pytest.importorskip("lightning")
    dirpath = f"s3://{bucket}/run"
    env = rank_environment(s3_server, s3_server.endpoint_url, LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")

    def launch(phase: str, ranks: int) -> None:
        procs = []
        for rank in range(ranks):
            log = tmp_path / f"{phase}{rank}.log"
            with log.open("wb") as stream:
                procs.append(subprocess.Popen(
                    [sys.executable, str(NEMO_WORKER), dirpath, str(tmp_path), phase], stdout=stream,
                    env={**env, "WORLD_SIZE": str(ranks), "RANK": str(rank), "GROUP_RANK": str(rank)},
                    stderr=subprocess.STDOUT, cwd=REPO,
                ))  # fmt: skip
        codes = wait_for_ranks(procs, 300)
        assert codes == [0] * ranks, "\n".join((tmp_path / f"{phase}{r}.log").read_text()[-3000:] for r in range(ranks))

    launch("save", 1)  # node 0 alone: in DDP only rank 0 saves
    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket, Prefix="run/").get("Contents", []))
    assert [key for key in keys if key.endswith(".ckpt")] == ["run/tiny-step=2-last.ckpt"]  # step 4: node 0's memory
    assert list((tmp_path / "node0").rglob("tiny-step=4-last.ckpt")) and not list((tmp_path / "node1").rglob("*.ckpt"))
    launch("resume", 2)
    body = s3_client.get_object(Bucket=bucket, Key="run/tiny-step=2-last.ckpt")["Body"].read()
    expected = torch.load(io.BytesIO(body), weights_only=False)["state_dict"]
    agreed = f"{dirpath}/tiny-step=2-last.ckpt"
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (report["ckpt_path"], report["global_step"], report["end"]) == (agreed, 2, 6), rank
        assert report["loads"] == [[agreed, "s3"]], rank  # one load, of the agreed step, from the tier it is on
        for name, tensor in expected.items():
            assert torch.equal(torch.tensor(report["weights"][name]), tensor), (rank, name)
    assert json.loads((tmp_path / "rank0.json").read_text())["check_resume"] == f"{dirpath}/tiny-step=4-last.ckpt"


def test_the_decision_is_the_newest_step_every_rank_can_load_from_some_tier() -> None:
    def rank(node: str, own: dict, held: list, s3: dict, address: list | None = None) -> dict[str, Any]:
        return {"node": node, "address": address, "directory": "s3://b/run", "own": own, "held": held, "s3": s3}

    a, b, c = (f"s3://b/run/step={step}.ckpt" for step in (1, 2, 3))
    gathered = [
        rank("n0", {b: [2, 0.0], c: [3, 0.0]}, [], {a: 1}),  # rank 0 listed S3: step 1 only
        rank("n1", {}, [[b, 2, 0.0, "n0", "x"]], {}),  # node 1 holds node 0's step 2: no step 3 anywhere for it
    ]
    steps, options = decide(gathered, 1)
    assert steps == [2, 1]  # not 3 (rank 1 cannot load it), not older than S3's newest
    assert options[2] == [(1, b, "replica")] and options[1] == [(3, a, "s3")]
    assert decide(gathered, 0)[1][2] == [(0, b, "memory")]
    gathered[1]["held"] = []  # only a replica on another node with a server would do: none here
    gathered[0]["held"] = [[b, 2, 0.0, "n0", "x"]]
    assert decide(gathered, 1)[0] == [1]
    gathered[0]["address"] = ["127.0.0.1", 1]
    assert decide(gathered, 1) == ([2, 1], {2: [(2, b, "replica")], 1: [(3, a, "s3")]})



@pytest.mark.slow
def test_a_stalled_peer_does_not_let_the_tier_grow_past_keep(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    """At most ``keep`` own copies while each replica takes long and saves come fast (benchmarks/bench_memory_tier.py
    once saw 6 with keep=2: each replica took 3 s, a save came every 0.5 s)."""
    env = rank_environment(s3_server, s3_server.endpoint_url, WORLD_SIZE="2")
    worker = REPO / "tests" / "helpers" / "tier_backlog_worker.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), bucket, str(tmp_path), "6"],
            env={**env, "RANK": str(rank), "GROUP_RANK": str(rank), "LOCAL_RANK": "0"}, cwd=REPO,
        )
        for rank in range(2)
    ]
    try:
        assert procs[0].wait(timeout=300) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=60)
    held = json.loads((tmp_path / "rank0.json").read_text())["held"]
    # keep=2, plus the first checkpoint while its drain to S3 may still run
    assert max(held) <= 3, held

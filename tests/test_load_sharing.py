"""Load sharing on a collective resume: one download per node (or per job) instead of one per rank.

Real processes: 4 ranks as 2 "nodes" x 2 local ranks on this machine (the torchrun environment, GROUP_RANK being
the node), gloo, against the local S3 server through the fault proxy, which counts every request and tells ranks
apart by the ``rank/<N>`` tag in their User-Agent. The ranks are started by load_sharing_worker.py.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from fault_proxy import Fault, FaultProxy, FaultRule
from s3_servers import S3Endpoint, free_port, rank_environment, skip_unless_multirank_backend

import s3_checkpoint_io
import s3_node_sharing
from s3_checkpoint_io import S3CheckpointIO

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "helpers" / "load_sharing_worker.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
CHUNK_MIB = 16
JOB_TIMEOUT_S = 240


def shared_files() -> set[str]:
    return set(glob.glob(os.path.join(s3_node_sharing.SHARED_FILE_DIR, "s3ckpt-load-*")))


def start_ranks(
    server: S3Endpoint, endpoint_url: str, mode: str, url: str, out: Path, *args: str, world: int = WORLD
) -> list[subprocess.Popen[bytes]]:
    """Start `world` ranks as nodes of PER_NODE local ranks (torchrun's environment), each logging to out/."""
    out.mkdir(parents=True, exist_ok=True)
    base = rank_environment(server, endpoint_url, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(min(PER_NODE, world)))
    procs = []
    for rank in range(world):
        node, local = divmod(rank, PER_NODE)
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node)}
        command = [sys.executable, str(WORKER), "--mode", mode, "--url", url, "--out", str(out), *args]
        with open(out / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    return procs


def wait_ranks(procs: list[subprocess.Popen[bytes]], timeout: float = JOB_TIMEOUT_S) -> list[int | None]:
    """Exit codes (None: killed here after `timeout`, or a few seconds after another rank crashed)."""
    deadline = time.monotonic() + timeout
    try:
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            if any(proc.poll() not in (None, 0) for proc in procs):  # a crash: the others would wait for it
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [proc.returncode if proc.returncode >= 0 else None for proc in procs]


def run_ranks(
    server: S3Endpoint, endpoint_url: str, mode: str, url: str, out: Path, *args: str, world: int = WORLD
) -> list[int | None]:
    """`start_ranks` then `wait_ranks`; once more if the rendezvous port was taken meanwhile (shared machine)."""
    for attempt in range(2):
        codes = wait_ranks(start_ranks(server, endpoint_url, mode, url, out, *args, world=world))
        if codes == [0] * world or attempt or "EADDRINUSE" not in (out / "rank0.log").read_text():
            return codes
        for stale in out.glob("rank*.json"):
            stale.unlink()
    raise AssertionError("unreachable")


def logs(out: Path, ranks: range | list[int] = range(WORLD)) -> str:
    return "\n".join(f"--- rank {r} ---\n" + (out / f"rank{r}.log").read_text()[-3000:] for r in ranks)


def run_job(server: S3Endpoint, endpoint_url: str, mode: str, url: str, out: Path, *args: str) -> list[dict]:
    codes = run_ranks(server, endpoint_url, mode, url, out, *args)
    if any(code != 0 for code in codes):
        pytest.fail(f"{mode} {args} exited {codes}:\n{logs(out)}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def gets_by_rank(proxy: FaultProxy, key: str) -> Counter[int]:
    """GETs of the object `key` itself (not its checksum sidecar, not listings) per rank."""
    counts: Counter[int] = Counter()
    for request in proxy.requests:
        if request.method == "GET" and request.path.endswith("/" + key) and "list-type" not in request.query:
            match = re.search(r"\brank/(\d+)\b", request.user_agent)
            assert match, request.user_agent
            counts[int(match.group(1))] += 1
    return counts


# --------------------------------------------------------------------------------------------------------------------
# The Trainer's resume, per mode: GETs, what every rank holds, node memory
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.lightning
@pytest.mark.slow
def test_trainer_resume_downloads_once_per_node_or_job(
    s3_server: S3Endpoint, s3_client, bucket: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """One job of 4 ranks resumes a Trainer once per load-sharing mode, each from its own copy of one checkpoint (so
    the proxy tells the modes' GETs apart), in a new Trainer each: one launch, so each rank imports Lightning once."""
    skip_unless_multirank_backend(s3_server)
    modes = {"node": {0, 2}, "job": {0}, "rank": {0, 1, 2, 3}}
    url = f"s3://{bucket}/run/big-last-{{sharing}}.ckpt"
    save_args = ("--sharing", ",".join(modes), "--max-steps", "2")
    save = run_ranks(s3_server, s3_server.endpoint_url, "save", url, tmp_path / "save", *save_args, world=1)
    assert save == [0], logs(tmp_path / "save", [0])
    sizes = {s3_client.head_object(Bucket=bucket, Key=f"run/big-last-{mode}.ckpt")["ContentLength"] for mode in modes}
    assert len(sizes) == 1, sizes
    size = sizes.pop()
    saved = S3CheckpointIO().load_checkpoint(url.format(sharing="node"), weights_only=False)  # verified
    assert size >= 64 * 2**20 and saved["global_step"] == 2
    ranges_per_download = math.ceil(size / (CHUNK_MIB * 2**20))
    before = shared_files()

    args = ("--sharing", ",".join(modes), "--chunk", str(CHUNK_MIB), "--max-steps", "3")
    reports = run_job(s3_server, fault_proxy.endpoint_url, "trainer", url, tmp_path / "trainer", *args)
    assert shared_files() <= before, f"left {shared_files() - before}"
    measured = {}
    for mode, downloaders in modes.items():
        gets = gets_by_rank(fault_proxy, f"run/big-last-{mode}.ckpt")
        assert set(gets) == downloaders, f"{mode}: GETs per rank {dict(gets)}"
        assert all(count == ranges_per_download for count in gets.values()), f"{mode}: {dict(gets)}"
        resumes = [report["resumes"][mode] for report in reports]
        for rank, resume in enumerate(resumes):  # every rank holds exactly what was saved
            start = resume["start"]
            assert resume["node_rank"] == rank // PER_NODE
            assert start["global_step"] == 2 and start["ckpt_path"] == url.format(sharing=mode), (mode, rank, start)
            for name, tensor in saved["state_dict"].items():
                assert torch.equal(torch.tensor(start["weights"][name]), tensor), (mode, rank, name)
            for index, state in saved["optimizer_states"][0]["state"].items():
                assert torch.equal(torch.tensor(start["exp_avg"][str(index)]), state["exp_avg"]), (mode, rank)
            assert resume["payload_sha256"] == hashlib.sha256(saved["payload"].numpy()).hexdigest(), (mode, rank)
        grown = [(r["node"], m["pss_during"] - m["pss_before"]) for r, m in zip(reports, resumes, strict=True)]
        node_ram = [sum(bytes_ for n, bytes_ in grown if n == node) / size for node in range(NODES)]
        measured[mode] = (sum(gets.values()) / ranges_per_download, node_ram)
    print(
        f"\n{size / 2**20:.0f} MiB checkpoint, {WORLD} ranks as {NODES} nodes x {PER_NODE}: "
        + "; ".join(
            f"{mode}: {downloads:g} downloads, node RAM {'/'.join(f'{x:.2f}' for x in ram)}x the checkpoint"
            for mode, (downloads, ram) in measured.items()
        )
    )
    assert measured["node"][0] == 2 and measured["job"][0] == 1 and measured["rank"][0] == 4
    assert max(measured["node"][1]) <= 1.3, measured
    assert max(measured["job"][1]) <= 1.3, measured
    assert min(measured["rank"][1]) >= 1.7, measured


# --------------------------------------------------------------------------------------------------------------------
# The explicit collective call: faults on the downloading rank, a load on one rank alone
# --------------------------------------------------------------------------------------------------------------------

SMALL_KEY = "faults/ckpt.ckpt"
RETRY_S = 3.0
FAULT_BOUND_S = 20.0
"""How much longer than the retry budget a rank may take to raise: process group set-up, polling."""


@pytest.fixture
def small_checkpoint(s3_server: S3Endpoint, bucket: str) -> tuple[str, dict]:
    """A 16 MiB checkpoint (4 ranges of 5 MiB) and what it holds."""
    state = {"w": torch.randn(2**22, generator=torch.Generator().manual_seed(3)), "step": 7}
    url = f"s3://{bucket}/{SMALL_KEY}"
    S3CheckpointIO(chunk_size_MB=5).save_checkpoint(state, url)
    return url, state


def load_args(scenarios: list[dict]) -> tuple[str, ...]:
    return ("--chunk", "5", "--retry-s", str(RETRY_S), "--attempts", "4", "--scenarios", json.dumps(scenarios))


def scenario_reports(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text())["scenarios"][name] for r in range(WORLD)]


def save_copy(state: dict, bucket: str, name: str) -> str:
    """The small checkpoint saved again under `name`, so each scenario has its own key (a server-side copy would
    not match the checksum record of the original)."""
    url = f"s3://{bucket}/faults/{name}.ckpt"
    S3CheckpointIO(chunk_size_MB=5).save_checkpoint(state, url)
    return url


def test_explicit_collective_loads_and_downloader_failures(
    s3_server: S3Endpoint,
    bucket: str,
    small_checkpoint: tuple[str, dict],
    fault_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """One job of 4 ranks (2 nodes x 2) makes these loads in turn:

    * a persistent 403 on the object, node and job mode, and a dead server (node mode): every rank raises within
      the retry budget plus a bound, naming the URL and the cause; only the downloaders asked S3;
    * a load on one rank alone (outside a collective call): it downloads on that rank, nobody waits;
    * good node and job mode loads: every rank holds the checkpoint, downloaded by ranks 0 and 2 (node) or 0 (job);
    * node mode without a usable shared directory: every rank downloads its own copy (with a warning), no error.

    Nothing is left in /dev/shm, and a stale file of a dead job is removed by the first node-mode load.
    """
    skip_unless_multirank_backend(s3_server)
    url, state = small_checkpoint
    urls = {name: save_copy(state, bucket, name) for name in ("denied", "solo", "node", "job", "no-shm")}
    fault_proxy.add_rule(FaultRule(Fault.status(403), path_regex=r"/faults/denied\.ckpt$"))
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    scenarios = [
        {"name": "403-node", "sharing": "node", "url": urls["denied"]},
        {"name": "403-job", "sharing": "job", "url": urls["denied"]},
        {"name": "dead-server-node", "sharing": "node", "endpoint": dead},
        {"name": "solo", "sharing": "node", "url": urls["solo"], "solo_rank": 3},
        {"name": "node", "sharing": "node", "url": urls["node"]},
        {"name": "job", "sharing": "job", "url": urls["job"]},
        {"name": "no-shm", "sharing": "node", "url": urls["no-shm"], "shared_dir": str(tmp_path / "missing")},
    ]
    stale = os.path.join(s3_node_sharing.SHARED_FILE_DIR, f"s3ckpt-load-deadjob-{os.getpid()}-node0-x.data")
    os.close(os.open(stale, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    before = shared_files()
    try:
        codes = run_ranks(s3_server, fault_proxy.endpoint_url, "load", url, tmp_path, *load_args(scenarios))
        assert codes == [0] * WORLD, logs(tmp_path)
        assert not os.path.exists(stale), "the stale file of a dead job was not removed"
    finally:
        if os.path.exists(stale):
            os.unlink(stale)
    assert shared_files() <= before, shared_files() - before

    for name, failing_url, cause, downloaders in (
        ("403-node", urls["denied"], "(403)", {0, 2}),
        ("403-job", urls["denied"], "(403)", {0}),
        ("dead-server-node", url, "Could not connect", {0, 2}),
    ):
        reports = scenario_reports(tmp_path, name)
        print(f"\n{name}: " + "; ".join(f"rank {r}: {o['load_s']:.2f} s" for r, o in enumerate(reports)))
        print(f"  a waiting rank's error: {reports[1]['error']['message']}")
        for rank, outcome in enumerate(reports):
            error = outcome.get("error")
            assert error, f"{name}: rank {rank} loaded despite the fault"
            assert failing_url in error["message"] and cause in error["trace"], (name, rank, error)
            assert outcome["load_s"] < RETRY_S + FAULT_BOUND_S, (name, rank, outcome["load_s"])
            if rank not in downloaders:
                assert error["type"] == "SharedLoadError", (name, rank, error)
    denied = [r for r in fault_proxy.requests if "/faults/denied.ckpt" in r.path]
    assert denied and {re.search(r"rank/(\d+)", r.user_agent).group(1) for r in denied} == {"0", "2"}

    solo = scenario_reports(tmp_path, "solo")
    assert solo[3]["fingerprint"]["/step"] == 7.0 and "error" not in solo[3]
    assert all("fingerprint" not in solo[r] for r in range(3))
    assert dict(gets_by_rank(fault_proxy, "faults/solo.ckpt")) == {3: 4}

    expected = {"/w": float(state["w"].double().sum()), "/step": 7.0}
    every_rank = {rank: 4 for rank in range(WORLD)}  # no usable shared directory: each rank downloads, no error
    for name, downloaders in (("node", {0: 4, 2: 4}), ("job", {0: 4}), ("no-shm", every_rank)):
        for rank, outcome in enumerate(scenario_reports(tmp_path, name)):
            assert "error" not in outcome, (name, rank, outcome["error"])
            assert outcome["fingerprint"]["/step"] == 7.0
            assert outcome["fingerprint"]["/w"] == pytest.approx(expected["/w"], rel=1e-9)
        assert dict(gets_by_rank(fault_proxy, f"faults/{name}.ckpt")) == downloaders


def test_killed_downloader_fails_its_node_cleanly(
    s3_server: S3Endpoint, small_checkpoint: tuple[str, dict], fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Node 0's downloader is killed mid-download (its GETs stall): its node's other rank raises within seconds, the
    other node loads normally, and nothing is left in /dev/shm."""
    skip_unless_multirank_backend(s3_server)
    url, state = small_checkpoint
    stall = FaultRule(Fault.stall(60), method="GET", path_regex=re.escape(SMALL_KEY) + "$", user_agent="rank/0")
    fault_proxy.add_rule(stall)
    before = shared_files()
    args = load_args([{"name": "node", "sharing": "node"}])
    procs = start_ranks(s3_server, fault_proxy.endpoint_url, "load", url, tmp_path, *args)
    try:
        deadline = time.monotonic() + 120
        while not gets_by_rank(fault_proxy, SMALL_KEY)[0]:
            assert time.monotonic() < deadline and procs[0].poll() is None, logs(tmp_path)
            time.sleep(0.05)
        procs[0].kill()
        killed = time.monotonic()
        for rank in (1, 2, 3):
            deadline = time.monotonic() + 60
            while not (tmp_path / f"rank{rank}.json").exists():
                assert time.monotonic() < deadline, logs(tmp_path, [rank])
                time.sleep(0.05)
            if rank == 1:
                waited_s = time.monotonic() - killed
    finally:
        wait_ranks(procs, 0.1)  # the survivors wait for the dead rank in the job's next barrier: stop them
    waiter = json.loads((tmp_path / "rank1.json").read_text())["scenarios"]["node"]
    assert waiter["error"]["type"] == "SharedLoadError" and "exited before finishing" in waiter["error"]["message"]
    assert url in waiter["error"]["message"]
    assert waited_s < 10, waited_s
    for rank in (2, 3):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())["scenarios"]["node"]
        assert "error" not in outcome, outcome
        assert outcome["fingerprint"]["/w"] == pytest.approx(float(state["w"].double().sum()), rel=1e-9)
    print(f"\nkilled downloader: its node's other rank raised {waited_s:.2f} s later: {waiter['error']['message']}")
    assert shared_files() <= before, shared_files() - before


# --------------------------------------------------------------------------------------------------------------------
# Units: arguments, config key, arming, stale files, the Lightning surface relied on
# --------------------------------------------------------------------------------------------------------------------


def test_load_sharing_argument_and_config_key() -> None:
    import connector

    assert S3CheckpointIO().load_sharing == "node"
    with pytest.raises(ValueError, match="load_sharing must be one of"):
        S3CheckpointIO(load_sharing="host")
    cfg = {
        "s3_checkpointing": {"load_sharing": "job"},
        "exp_manager": {"checkpoint_callback_params": {"dirpath": "s3://bucket/ckpt"}},
    }
    assert connector.build_s3_checkpointing(cfg).checkpoint_io.load_sharing == "job"


def test_collective_load_arms_one_load_on_its_thread() -> None:
    import threading

    plugin = S3CheckpointIO()
    with plugin.collective_load(node_rank=3):
        seen_elsewhere = []
        thread = threading.Thread(target=lambda: seen_elsewhere.append(s3_checkpoint_io._take_collective(plugin)))
        thread.start()
        thread.join()
        assert seen_elsewhere == [None]  # another thread's load is its own
        armed = s3_checkpoint_io._take_collective(plugin)
        assert armed is not None and armed.node_rank == 3
        assert s3_checkpoint_io._take_collective(plugin) is None  # one load per arming
    assert s3_checkpoint_io._take_collective(plugin) is None


def test_stale_shared_files_removed_only_when_dead(tmp_path: Path) -> None:
    old = time.time() - 3600

    def make(name: str, age: float = old) -> Path:
        path = tmp_path / name
        path.write_bytes(b"x")
        os.utime(path, (age, age))
        return path

    dead = make("s3ckpt-load-job-1-node0-a.data")
    young = make("s3ckpt-load-job-2-node0-a.data", time.time())
    held = make("s3ckpt-load-job-3-node0-a.status")
    other = make("unrelated-file")
    link = tmp_path / "s3ckpt-load-job-4-node0-a.data"
    link.symlink_to(other)
    holder = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)  # a live load holds its files
        removed = s3_node_sharing._remove_stale_shared_files(str(tmp_path))
    finally:
        os.close(holder)
    assert removed == [str(dead)]
    assert young.exists() and held.exists() and other.exists() and link.is_symlink()


def test_lightning_surface_for_collective_resume() -> None:
    """`collective_resume` shares only where Lightning's own Strategy.load_checkpoint runs (every rank calls it with
    one path); strategies that load their own way are left alone."""
    strategies = pytest.importorskip("lightning.pytorch.strategies")
    assert strategies.DDPStrategy.load_checkpoint.__qualname__ == "Strategy.load_checkpoint"
    for own_loading in ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"):
        assert getattr(strategies, own_loading).load_checkpoint.__qualname__ != "Strategy.load_checkpoint"
    assert strategies.DDPStrategy.node_rank.fget is not None  # from the cluster environment

"""Load sharing on a collective resume: one download per node (or per job) instead of one per rank.

Real processes: 4 ranks as 2 "nodes" x 2 local ranks on this machine (the torchrun environment, GROUP_RANK being
the node), gloo, against the local S3 server through the fault proxy, which counts every request and tells ranks
apart by the ``rank/<N>`` tag in their User-Agent. The ranks are started by load_sharing_worker.py.
"""

from __future__ import annotations

import fcntl
import glob
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from fault_proxy import Fault, FaultProxy, FaultRule
from s3_servers import S3Endpoint, free_port

import s3_checkpoint_io
from s3_checkpoint_io import S3CheckpointIO

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "load_sharing_worker.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
CHUNK_MIB = 16
JOB_TIMEOUT_S = 240
_LAUNCHER_VARIABLES = re.compile(
    r"^(SLURM_|OMPI_|PMI_|PMIX_|MV2_|TORCHELASTIC_|LOCAL_RANK$|NODE_RANK$|GROUP_RANK$|RANK$|LOCAL_WORLD_SIZE$)"
)


def shared_files() -> set[str]:
    return set(glob.glob(os.path.join(s3_checkpoint_io.SHARED_FILE_DIR, "s3ckpt-load-*")))


def start_ranks(
    server: S3Endpoint, endpoint_url: str, mode: str, url: str, out: Path, *args: str, world: int = WORLD
) -> list[subprocess.Popen[bytes]]:
    """Start `world` ranks as nodes of PER_NODE local ranks (torchrun's environment), each logging to out/."""
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARIABLES.match(k)}
    base.update(server.env())
    base.update(
        AWS_ENDPOINT_URL_S3=endpoint_url,
        PYTHONPATH=os.pathsep.join([str(REPO), base.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(min(PER_NODE, world)),
        OMP_NUM_THREADS="1",
    )
    procs = []
    for rank in range(world):
        node, local = divmod(rank, PER_NODE)
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(node)}
        command = [sys.executable, str(WORKER), "--mode", mode, "--url", url, "--out", str(out), *args]
        with open(out / f"rank{rank}.log", "wb") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    return procs


def wait_ranks(procs: list[subprocess.Popen[bytes]], timeout: float = JOB_TIMEOUT_S) -> list[int | None]:
    """Exit codes (None: killed here after `timeout`)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    try:
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes


def logs(out: Path, ranks: range | list[int] = range(WORLD)) -> str:
    return "\n".join(f"--- rank {r} ---\n" + (out / f"rank{r}.log").read_text()[-3000:] for r in ranks)


def run_job(server: S3Endpoint, endpoint_url: str, mode: str, url: str, out: Path, *args: str) -> list[dict]:
    codes = wait_ranks(start_ranks(server, endpoint_url, mode, url, out, *args))
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
    url = f"s3://{bucket}/run/big-last.ckpt"
    save = start_ranks(s3_server, s3_server.endpoint_url, "save", url, tmp_path / "save", "--max-steps", "2", world=1)
    assert wait_ranks(save) == [0], logs(tmp_path / "save", [0])
    body = s3_client.get_object(Bucket=bucket, Key="run/big-last.ckpt")["Body"].read()
    size = len(body)
    saved = torch.load(io.BytesIO(body), weights_only=False)
    assert size >= 64 * 2**20 and saved["global_step"] == 2
    ranges_per_download = math.ceil(size / (CHUNK_MIB * 2**20))
    before = shared_files()

    measured = {}
    for mode, downloaders in (("node", {0, 2}), ("job", {0}), ("rank", {0, 1, 2, 3})):
        fault_proxy.clear()
        args = ("--sharing", mode, "--chunk", str(CHUNK_MIB), "--max-steps", "3")
        reports = run_job(s3_server, fault_proxy.endpoint_url, "trainer", url, tmp_path / mode, *args)
        gets = gets_by_rank(fault_proxy, "run/big-last.ckpt")
        assert set(gets) == downloaders, f"{mode}: GETs per rank {dict(gets)}"
        assert all(count == ranges_per_download for count in gets.values()), f"{mode}: {dict(gets)}"
        for report in reports:  # every rank holds exactly what was saved
            rank, start = report["rank"], report["start"]
            assert report["node_rank"] == rank // PER_NODE
            assert start["global_step"] == 2 and start["ckpt_path"] == url, (mode, rank, start)
            for name, tensor in saved["state_dict"].items():
                assert torch.equal(torch.tensor(start["weights"][name]), tensor), (mode, rank, name)
            for index, state in saved["optimizer_states"][0]["state"].items():
                assert torch.equal(torch.tensor(start["exp_avg"][str(index)]), state["exp_avg"]), (mode, rank)
            assert report["payload_sum"] == float(saved["payload"].double().sum())
        node_ram = [
            sum(r["pss_during"] - r["pss_before"] for r in reports if r["node"] == node) / size for node in range(NODES)
        ]
        measured[mode] = (sum(gets.values()) / ranges_per_download, node_ram)
        assert shared_files() <= before, f"{mode}: left {shared_files() - before}"
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

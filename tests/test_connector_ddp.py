"""Real multi-process DDP (CPU, gloo) against the local S3 server: train, stop, resume in a fresh job.

Every rank must resume from the same checkpoint (same global_step, weights and optimizer state), and during the
resumed job LIST requests must come from global rank 0 only, in the same number for 2 and 4 ranks. Requests are
counted by the fault proxy, which records every request's User-Agent; each worker tags its requests with its rank
(see ddp_worker.py). A control job with Lightning's own connector and ModelCheckpoint shows that the measurement does
see other ranks' LISTs when they happen (every rank lists there; and ``"last"`` resumes from nothing, #18261).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fault_proxy import FaultProxy, RecordedRequest
from s3_servers import S3Endpoint, free_port, skip_unless_multirank_backend

pytestmark = [pytest.mark.lightning, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
HELPERS = Path(__file__).resolve().parent / "helpers"  # ddp_worker and the tiny model it trains
JOB_TIMEOUT_S = 300
# Variables that would make Lightning or the rank detection believe in another launcher.
_LAUNCHER_VARIABLES = re.compile(
    r"^(SLURM_|OMPI_|PMI_|PMIX_|MV2_|TORCHELASTIC_|LOCAL_RANK$|NODE_RANK$|GROUP_RANK$|RANK$)"
)


@dataclass
class Job:
    reports: list[dict]
    requests: list[RecordedRequest]

    def lists_by_rank(self) -> Counter[int]:
        """ListObjectsV2 requests per rank."""
        return Counter(rank_of(r) for r in self.requests if r.method == "GET" and "list-type=2" in r.query)


def rank_of(request: RecordedRequest) -> int:
    match = re.search(r"\brank[/-](\d+)\b", request.user_agent)
    assert match, f"request {request.method} {request.path}?{request.query} carries no rank: {request.user_agent}"
    return int(match.group(1))


def run_job(
    server: S3Endpoint, proxy: FaultProxy, mode: str, dirpath: str, world_size: int, max_steps: int, out: Path
) -> Job:
    """Start `world_size` worker processes (one per rank) and wait for all of them; once more if the rendezvous port
    was taken between `free_port` and rank 0's bind (EADDRINUSE: another process's connection, on a busy machine)."""
    out.mkdir(parents=True)
    for attempt in range(2):
        failed = _run_ranks(server, proxy, mode, dirpath, world_size, max_steps, out)
        clash = any("EADDRINUSE" in (out / f"rank{r}.log").read_text() for r in failed)
        if not failed or attempt or not clash:
            break
        for stale in out.glob("rank*"):
            stale.unlink()
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n" + (out / f"rank{r}.log").read_text()[-4000:] for r in failed)
        pytest.fail(f"{mode} job with {world_size} ranks failed on ranks {failed}:\n{logs}")
    return Job([json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)], proxy.requests)


def _run_ranks(
    server: S3Endpoint, proxy: FaultProxy, mode: str, dirpath: str, world_size: int, max_steps: int, out: Path
) -> list[int]:
    """One start of the job's ranks: the ranks that failed."""
    proxy.clear()
    base = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARIABLES.match(k)}
    base.update(server.env())
    base.update(
        AWS_ENDPOINT_URL_S3=proxy.endpoint_url,
        PYTHONPATH=os.pathsep.join([str(REPO), str(HELPERS), base.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        OMP_NUM_THREADS="1",
    )
    procs = []
    for rank in range(world_size):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "AWS_SDK_UA_APP_ID": f"rank-{rank}"}
        command = [sys.executable, "-m", "ddp_worker", "--mode", mode, "--dirpath", dirpath]
        command += ["--max-steps", str(max_steps), "--out", str(out)]
        log = open(out / f"rank{rank}.log", "wb")  # closed in the finally below
        procs.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
    failed = []
    try:
        for rank, (proc, _) in enumerate(procs):
            try:
                if proc.wait(timeout=JOB_TIMEOUT_S) != 0:
                    failed.append(rank)
            except subprocess.TimeoutExpired:
                failed.append(rank)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return failed


def load_checkpoint(s3_client, bucket: str, key: str) -> dict:
    body = s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return torch.load(io.BytesIO(body), weights_only=False)


def ckpt_keys(s3_client, bucket: str, prefix: str) -> list[str]:
    listing = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return sorted(o["Key"] for o in listing if o["Key"].endswith(".ckpt"))


def reset_prefix(s3_client, bucket: str, prefix: str, snapshot: str) -> None:
    """Make ``prefix/`` hold exactly what ``snapshot/`` holds (server-side copies)."""
    for item in s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        s3_client.delete_object(Bucket=bucket, Key=item["Key"])
    for item in s3_client.list_objects_v2(Bucket=bucket, Prefix=snapshot + "/").get("Contents", []):
        key = prefix + item["Key"][len(snapshot) :]
        s3_client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": item["Key"]})


def assert_every_rank_resumed_from(job: Job, checkpoint: dict, url: str) -> None:
    expected_weights = checkpoint["state_dict"]
    expected_exp_avg = {str(k): s["exp_avg"] for k, s in checkpoint["optimizer_states"][0]["state"].items()}
    for rank, report in enumerate(job.reports):
        start = report["start"]
        assert start["global_step"] == checkpoint["global_step"], f"rank {rank} started at {start['global_step']}"
        assert start["ckpt_path"] == url, f"rank {rank} resumed from {start['ckpt_path']}"
        for name, tensor in expected_weights.items():
            assert torch.equal(torch.tensor(start["weights"][name]), tensor), f"rank {rank}: {name}"
        assert expected_exp_avg, "the checkpoint has optimizer state"
        for index, tensor in expected_exp_avg.items():  # DDP syncs weights, not optimizer state: each rank loaded
            assert torch.equal(torch.tensor(start["exp_avg"][index]), tensor), f"rank {rank}: exp_avg {index}"
        assert report["end"]["global_step"] == 6
        assert report["connector"] == "NeMoCheckpointConnector"


def test_ddp_resume_discovery_lists_on_rank_zero_only(
    s3_server: S3Endpoint, s3_client, bucket: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    skip_unless_multirank_backend(s3_server)
    dirpath = f"s3://{bucket}/run"
    last_url = f"{dirpath}/tiny--step=4-last.ckpt"
    # 1. Train 4 steps with 2 ranks (checkpoints at steps 2 and 4), stop, and keep a copy of what it wrote.
    train = run_job(s3_server, fault_proxy, "train", dirpath, 2, 4, tmp_path / "train")
    # Started without a launcher's run id, the ranks are still one run: rank 0's, adopted by every rank in setup.
    assert len({report["run"] for report in train.reports}) == 1, [report["run"] for report in train.reports]
    assert ckpt_keys(s3_client, bucket, "run") == [
        "run/tiny--step=2.ckpt",
        "run/tiny--step=4-last.ckpt",
        "run/tiny--step=4.ckpt",
    ]
    checkpoint = load_checkpoint(s3_client, bucket, "run/tiny--step=4-last.ckpt")
    assert checkpoint["global_step"] == 4
    reset_prefix(s3_client, bucket, "snapshot", "run")

    # 2. Fresh jobs resume from that state (restored before each: every resumed job writes new checkpoints).
    jobs: dict[tuple[str, int], Job] = {}
    for mode, world_size in (("check_resume", 2), ("check_resume", 4), ("last", 4)):
        reset_prefix(s3_client, bucket, "run", "snapshot")
        job = run_job(s3_server, fault_proxy, mode, dirpath, world_size, 6, tmp_path / f"{mode}-{world_size}")
        assert_every_rank_resumed_from(job, checkpoint, last_url)
        lists = job.lists_by_rank()
        assert set(lists) == {0}, f"{mode} with {world_size} ranks: LIST requests per rank {dict(lists)}"
        # One node: its lowest rank downloads the checkpoint, the others map its pages (load_sharing="node").
        loads = {
            rank_of(r) for r in job.requests if r.method == "GET" and r.path.endswith("/run/tiny--step=4-last.ckpt")
        }
        assert loads == {0}, f"{mode} with {world_size} ranks: the checkpoint was downloaded by ranks {loads}"
        jobs[mode, world_size] = job
        # Top-k bookkeeping survived the resume: step 2 was evicted through S3 (not orphaned) when step 6 arrived;
        # the checkpoint the job resumed from is kept (the "last" clean-up would have removed it: Lightning #21813).
        assert ckpt_keys(s3_client, bucket, "run") == [
            "run/tiny--step=4-last.ckpt",
            "run/tiny--step=4.ckpt",
            "run/tiny--step=6-last.ckpt",
            "run/tiny--step=6.ckpt",
        ]

    list_counts = {f"{mode} x{world_size}": job.lists_by_rank()[0] for (mode, world_size), job in jobs.items()}
    print(f"\nLIST requests from rank 0 per resumed job (none from other ranks): {list_counts}")
    for (mode, world_size), job in jobs.items():
        per_rank = Counter(f"rank {rank_of(r)} {r.method}" for r in job.requests)
        print(f"  all requests of {mode} x{world_size}: {dict(sorted(per_rank.items()))}")
    for request in jobs["check_resume", 4].requests:
        if request.method == "GET" and "list-type=2" in request.query:
            client = "s3fs" if "aiobotocore" in request.user_agent else "boto3"
            print(f"  check_resume x4, rank {rank_of(request)}, {client}: GET {request.path}?{request.query}")
    assert list_counts["check_resume x2"] == list_counts["check_resume x4"], "LIST count grew with world size"

    # 3. Control: Lightning's own connector and ModelCheckpoint resolving ckpt_path="last" in the same state.
    reset_prefix(s3_client, bucket, "run", "snapshot")
    s3_client.copy_object(
        Bucket=bucket, Key="run/last.ckpt", CopySource={"Bucket": bucket, "Key": "run/tiny--step=4-last.ckpt"}
    )
    stock = run_job(s3_server, fault_proxy, "stock_last", dirpath, 2, 6, tmp_path / "stock")
    started = [report["start"]["global_step"] for report in stock.reports]
    print(
        f"stock Lightning ckpt_path='last', 2 ranks: LIST requests per rank {dict(stock.lists_by_rank())}, "
        f"training started at steps {started} (0: Lightning #18261 dropped the s3:// prefix, nothing was loaded)"
    )
    assert set(stock.lists_by_rank()) == {0, 1}, "the measurement sees LISTs from other ranks when they happen"

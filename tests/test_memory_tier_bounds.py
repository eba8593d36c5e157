"""The memory tier's bound on a node's memory (at most ``keep`` own copies) when replication lags (found by
benchmarks/bench_memory_tier.py: own copies reached 6 with keep=2 while each replica took 3 s and a save came every
0.5 s). Two gloo ranks, each a node with its own tier; real processes, moto."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from s3_servers import rank_environment

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_stalled_peer_does_not_let_the_tier_grow_past_keep(s3_server: Any, bucket: str, tmp_path: Path) -> None:
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

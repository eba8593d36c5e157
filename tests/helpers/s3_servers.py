"""The test suite's glue around `s3_local_servers`: fixed test keys, the test names for its records, and clean-up
hooks that stop every weed this interpreter started, even when pytest is killed.

The servers themselves (start, readiness, ports, lock, stop rule, the kill/restart handle) live in
`s3_local_servers`; to start one by hand run ``python -m s3_local_servers seaweedfs``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import s3_local_servers
from s3_local_servers import (
    LocalS3,
    LocalServerError,
    ServerNotInstalledError,
    WeedProcess,
    free_port,
    moto_server,
    seaweedfs_server,
    weed_command,
    weed_process,
)

__all__ = [
    "DEFAULT_ACCESS_KEY",
    "DEFAULT_SECRET_KEY",
    "S3Endpoint",
    "S3ServerUnavailableError",
    "SeaweedFSProcess",
    "ServerNotInstalledError",
    "MULTIRANK_BACKENDS",
    "free_port",
    "rank_environment",
    "wait_for_ranks",
    "seaweedfs_command",
    "seaweedfs_process",
    "skip_unless_multirank_backend",
    "start_moto",
    "start_seaweedfs",
]

DEFAULT_ACCESS_KEY = "s3ckpt-test-access"
DEFAULT_SECRET_KEY = "s3ckpt-test-secret-key"

# The names the tests were written with (other branches' test files import them too).
S3Endpoint = LocalS3
S3ServerUnavailableError = LocalServerError
"""A server cannot run here (ports taken, failed start); the fixtures turn it, and ServerNotInstalledError, into a
skip (or a failure with S3CKPT_TEST_REQUIRE_BACKENDS=1)."""
SeaweedFSProcess = WeedProcess
seaweedfs_process = weed_process
seaweedfs_command = weed_command

MULTIRANK_BACKENDS = os.environ.get("S3CKPT_MULTIRANK_BACKENDS", "moto").split(",")
"""Backends the multi-process tests run on (DCP at 2-4 ranks, DDP and load-sharing Trainer jobs, ranks under request
limits). Their processes dominate the suite's time, and what they test is the ranks' coordination, not the store:
the single-process tests cover every backend. ``S3CKPT_MULTIRANK_BACKENDS=moto,seaweedfs`` runs them on both."""


def skip_unless_multirank_backend(s3_server: Any) -> None:
    """Skip a multi-process test on a backend outside `MULTIRANK_BACKENDS`."""
    if s3_server.name not in MULTIRANK_BACKENDS:
        import pytest  # here: benchmarks/bench_resume.py imports this module without pytest

        pytest.skip(f"multi-rank tests run on {MULTIRANK_BACKENDS} (S3CKPT_MULTIRANK_BACKENDS)")


def parallel_group(nodeid: str) -> str:
    """The group a test runs in under ``pytest -n N`` (pytest-xdist; conftest's ``pytest_xdist_make_scheduler``):
    every test with ``seaweedfs`` in its id (its name or its parameters, e.g. the ``s3_server`` backend) in one group,
    since SeaweedFS listens on fixed ports and only one instance runs per machine; any other test in its module's
    group, so that a module-scoped fixture is set up once. (xdist's own ``xdist_group`` mark is not used: the group
    suffix it appends to node ids is lost on pytest 9.2.)"""
    return "seaweedfs" if "seaweedfs" in nodeid else nodeid.split("::", 1)[0]


def weed_unavailable(reason: str) -> NoReturn:
    """A ``weed`` test cannot get its SeaweedFS (not installed, ports or lock held by another weed): skip, or fail
    with ``S3CKPT_TEST_REQUIRE_BACKENDS=1`` (CI, where the suite orders these tests before its own weed starts)."""
    import pytest

    if os.environ.get("S3CKPT_TEST_REQUIRE_BACKENDS") == "1":
        pytest.fail(f"{reason} (S3CKPT_TEST_REQUIRE_BACKENDS=1)", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def start_moto(
    access_key: str = DEFAULT_ACCESS_KEY, secret_key: str = DEFAULT_SECRET_KEY, *, port: int = 0
) -> Iterator[LocalS3]:
    """`s3_local_servers.moto_server` with the suite's fixed keys."""
    with moto_server(access_key, secret_key, port=port) as endpoint:
        yield endpoint


@contextlib.contextmanager
def start_seaweedfs(
    data_dir: str | os.PathLike[str],
    *,
    port: int | None = None,
    access_key: str = DEFAULT_ACCESS_KEY,
    secret_key: str = DEFAULT_SECRET_KEY,
    startup_timeout: float = 60.0,
    lock: bool = True,
) -> Iterator[LocalS3]:
    """`s3_local_servers.seaweedfs_server` with the suite's fixed keys, waiting for the machine-wide weed lock (pass
    ``lock=False`` if the caller holds it), and with the clean-up hooks installed (the `seaweedfs_process` handle
    can kill and restart it)."""
    _hook_termination_signals()
    with seaweedfs_server(
        data_dir,
        lock="wait" if lock else "held",
        port=port,
        access_key=access_key,
        secret_key=secret_key,
        startup_timeout_s=startup_timeout,
    ) as endpoint:
        yield endpoint


@atexit.register
def _kill_leftover_weeds() -> None:
    """Last resort at interpreter exit (e.g. after Ctrl-C): SIGKILL any weed still running."""
    for weed in s3_local_servers.running_weeds():
        weed.kill()


_SIGNALS_HOOKED = False


def _hook_termination_signals() -> None:
    """On SIGTERM/SIGHUP (e.g. `timeout pytest ...`) kill our weeds first, since atexit does not run then.

    Only replaces the default handler, only from the main thread; afterwards the signal is raised again with the
    default action, so the process still dies the same way.
    """
    global _SIGNALS_HOOKED
    if _SIGNALS_HOOKED or threading.current_thread() is not threading.main_thread():
        return
    _SIGNALS_HOOKED = True

    def handler(signum: int, _frame: object) -> None:
        _kill_leftover_weeds()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, handler)


def empty_and_delete_bucket(client: Any, bucket: str) -> None:
    """Abort open multipart uploads, delete all objects, delete the bucket."""
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    client.delete_bucket(Bucket=bucket)


_LAUNCHER_VARIABLES = re.compile(
    r"^(SLURM_|OMPI_|PMI_|PMIX_|MV2_|TORCHELASTIC_|LOCAL_RANK$|NODE_RANK$|GROUP_RANK$|RANK$|LOCAL_WORLD_SIZE$)"
)
_REPO = Path(__file__).resolve().parents[2]


def rank_environment(server: LocalS3, endpoint_url: str, **extra: str) -> dict[str, str]:
    """The environment for the processes of a multi-rank test job: this one's without any launcher's variables (so
    the test decides the ranks), `server`'s keys, S3 at `endpoint_url` (a proxy in front of it), the repository on
    PYTHONPATH, a free rendezvous port on 127.0.0.1, one OpenMP thread; `extra` on top."""
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARIABLES.match(k)}
    env.update(server.env())
    env.update(
        AWS_ENDPOINT_URL_S3=endpoint_url,
        PYTHONPATH=os.pathsep.join([str(_REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


def wait_for_ranks(procs: Sequence[subprocess.Popen[Any]], timeout_s: float) -> list[int]:
    """The exit codes of a test job's rank processes, each waited for up to `timeout_s` (TimeoutExpired past it);
    whatever is still running then is killed, never left behind (a rank whose peer failed, or lost its free port to
    another test, waits in the rendezvous for good)."""
    try:
        return [proc.wait(timeout=timeout_s) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

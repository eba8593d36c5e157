"""The test suite's glue around `s3_local_servers`: fixed test keys, the test names for its records, and clean-up
hooks that stop every weed this interpreter started, even when pytest is killed.

The servers themselves (start, readiness, ports, lock, stop rule, the kill/restart handle) live in
`s3_local_servers`; to start one by hand run ``python -m s3_local_servers seaweedfs``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

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
    "free_port",
    "seaweedfs_command",
    "seaweedfs_process",
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

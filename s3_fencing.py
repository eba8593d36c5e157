"""Which run this process is, and fencing: only the newest run commits or removes checkpoints in a directory.

A core file beside s3_utils (which it uses to talk to S3); s3_checkpoint_io and the siblings build on it. In parts:

1. Launch identity: `launch_identity`, the launch this process belongs to, from SLURM's and torchrun's variables.
2. Runs: `CheckpointRun`, `current_run`, `adopt_run` (docs/runs.md).
3. Fencing: `DirectoryFence` (an `s3_utils.Fence`: the ``fence=`` of the writer and the removals), `FenceToken`,
   `CheckpointDirectoryTakenError`, and the owner record (`OWNER_RECORD_NAME`) (docs/fencing.md).
4. Stale objects: `directory_owner`, `stale_objects`: what a run older than the directory's owner committed after
   the owner took over; readers leave such objects out, and the owner's next save removes them (docs/fencing.md).
5. Expiring requests: where the store honours them, every fenced commit and removal is signed at the check that
   allowed it and expires `FENCED_REQUEST_LIFETIME_S` later, and a takeover waits that long: nothing a stale run
   checked before a takeover lands after the newer run starts writing (`probe_expiring_requests`).
6. Host locks: `takeover_lock`, the short lock on a node's tmpfs (memory tier, replica root) that a process stopped
   inside it cannot hold for longer than a few seconds.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import email.utils
import functools
import json
import logging
import os
import secrets
import socket
import stat
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

try:
    import fcntl
except ImportError:  # not on POSIX: host locks are no-ops there
    fcntl = None  # type: ignore[assignment]

if __package__:
    from . import s3_dirpath_utils as _urls
    from . import s3_pacing as _pacing
    from . import s3_utils as _s3
else:  # installed (or copied) as a top-level module
    import s3_dirpath_utils as _urls
    import s3_pacing as _pacing
    import s3_utils as _s3

__all__ = [
    "FENCED_REQUEST_LIFETIME_S", "OWNER_RECORD_NAME", "CheckpointDirectoryTakenError", "CheckpointRun",
    "DirectoryFence", "LaunchIdentity", "adopt_run", "current_run", "launch_identity",
]

logger = logging.getLogger(__name__)
__version__ = _urls.__version__

OWNER_RECORD_NAME = _s3.OWNER_RECORD_NAME  # a checkpoint directory's owner record (listings leave it out)
RUN_METADATA_KEY = "s3ckpt-run"  # user metadata of every fenced commit: the run that wrote the object


# --------------------------------------------------------------------------------------------------------------------
# Launch identity: the launch this process belongs to, as its launcher's environment says
# --------------------------------------------------------------------------------------------------------------------
#
# The ranks of one job are one run; a relaunch (torchrun's restart, a SLURM requeue) is a newer one. The launcher's
# environment names what a relaunch keeps (`job`) and which launch this is (`attempt`). See docs/runs.md.


@dataclass(frozen=True)
class LaunchIdentity:
    """The launch this process belongs to, as its launcher's environment says (`launch_identity`)."""

    launcher: str  # ``"torchrun"``, ``"slurm"`` or ``"slurm+torchrun"``
    job: str  # what a relaunch keeps: ``slurm:<job id>`` and/or ``torchrun:<run id>`` (docs/runs.md)
    attempt: tuple[int, ...]  # which launch of `job` (higher is later): SLURM's restarts and step, torchrun's
    started: float | None = None  # when the launch started (``SLURM_JOB_START_TIME``), if known

    @property
    def run_id(self) -> str:
        return f"{self.job}#{'.'.join(str(n) for n in self.attempt)}"


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "").strip())
    except ValueError:
        return default


def _torchrun_agent() -> str:
    """This host and the parent torchrun agent (pid and start time, so that a reused pid is another agent)."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat", encoding="ascii", errors="replace") as stat_file:
            started = stat_file.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{socket.gethostname()}:{parent}:{started}"


def launch_identity() -> LaunchIdentity | None:
    """The launch this process belongs to, from SLURM's and torchrun's variables; None outside any launcher. torchrun's
    default run id ``none`` names no job: then the torchrun agent on this host is (one run per node: `adopt_run`)."""
    slurm_job = os.environ.get("SLURM_JOB_ID", "").strip()
    torch_run = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    in_torchrun = bool(torch_run) or "TORCHELASTIC_RESTART_COUNT" in os.environ
    jobs: list[str] = []
    attempt: list[int] = []
    started: float | None = None
    if slurm_job:
        jobs.append(f"slurm:{slurm_job}")
        attempt += [_env_int("SLURM_RESTART_COUNT", 0), _env_int("SLURM_STEP_ID", -1)]
        start = _env_int("SLURM_JOB_START_TIME", 0)
        started = float(start) if start > 0 else None
    if in_torchrun:
        if torch_run and torch_run != "none":
            jobs.append(f"torchrun:{torch_run}")
        elif not slurm_job:
            jobs.append(f"torchrun:none@{_torchrun_agent()}")
        attempt.append(_env_int("TORCHELASTIC_RESTART_COUNT", 0))
    if not jobs:
        return None
    launcher = "+".join(name for name, present in (("slurm", slurm_job), ("torchrun", in_torchrun)) if present)
    return LaunchIdentity(launcher, "/".join(jobs), tuple(attempt), started)


# --------------------------------------------------------------------------------------------------------------------
# Runs: who writes checkpoints (one launch of a job, all its ranks; else one process)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointRun:
    """Who writes checkpoints (`current_run`): one launch of a job, all its ranks; else one process."""

    run_id: str  # ``<job>#<attempt>`` for a launch (``slurm:4242#0.0``); 16 random hex digits outside any launcher
    host: str
    pid: int  # of the process (any rank) that made this run's record
    started: float  # epoch seconds: SLURM's job start time, else this module's import
    job: str = ""  # `LaunchIdentity.job`; empty outside any launcher
    attempt: tuple[int, ...] = ()  # `LaunchIdentity.attempt`: higher is later

    def is_newer_than(self, other: CheckpointRun) -> bool:
        """Whether this run is a later launch: the higher `attempt` within one job, else the later `started`."""
        if self.job and self.job == other.job:
            return self.attempt > other.attempt
        return self.started > other.started

    def __str__(self) -> str:
        started = datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc)
        return f"run {self.run_id} (host {self.host}, pid {self.pid}, started {started:%Y-%m-%d %H:%M:%S.%f} UTC)"


_PROCESS_STARTED = time.time()
_process_run: CheckpointRun | None = None
_process_run_lock = threading.Lock()


def current_run() -> CheckpointRun:
    """This process's run (`CheckpointRun`), made at the first call and kept (also by a forked child)."""
    global _process_run
    with _process_run_lock:
        if _process_run is None:
            launch = launch_identity()
            host, pid = socket.gethostname(), os.getpid()
            if launch is None:
                _process_run = CheckpointRun(secrets.token_hex(8), host, pid, _PROCESS_STARTED)
            else:
                started = launch.started if launch.started is not None else _PROCESS_STARTED
                _process_run = CheckpointRun(launch.run_id, host, pid, started, launch.job, launch.attempt)
        return _process_run


def adopt_run(run: CheckpointRun) -> None:
    """Make `run` this process's run (`current_run`): a job's ranks adopt rank 0's (`S3ModelCheckpoint.setup`)."""
    global _process_run
    if not isinstance(run, CheckpointRun):  # it is written into owner records: a stand-in would break every save
        raise TypeError(f"adopt_run expects a CheckpointRun, got {type(run).__name__}")
    with _process_run_lock:
        if _process_run != run:
            logger.debug("This process is now %s (was %s)", run, _process_run)
        _process_run = run


# --------------------------------------------------------------------------------------------------------------------
# Directory ownership: only the newest run commits or removes checkpoints in a directory (fencing)
# --------------------------------------------------------------------------------------------------------------------
#
# A requeued or restarted job can leave two runs writing one directory; the stale one's saves and clean-up would then
# overwrite and delete the new run's checkpoints. The protocol (docs/fencing.md, docs/runs.md):
# * a run (`CheckpointRun`) takes a directory over at its first save there, writing the owner record one generation
#   up with a conditional PUT (``If-None-Match: *``, or ``If-Match`` on the ETag just read). An earlier run is stale.
# * before every commit and removal, one HEAD of the record: another ETag means another run took over, and the
#   operation raises `CheckpointDirectoryTakenError` with nothing changed. Once refused, always refused.
# * every commit carries an ETag condition (``If-Match`` on a key this run committed, else ``If-None-Match: *``), so a
#   stale run stopped between its HEAD and its commit cannot overwrite the newer run's object; the owner finds itself
#   in the record and sends again. Left open: new keys of a stale run, and removals (no condition).
# * other ranks of a sharded save check against the coordinator's `FenceToken`; stores that refuse or ignore
#   conditional headers are found once per bucket (one warning): the record is then written without conditions.
# * where the store honours expiring requests, each commit and removal expires a lifetime after its check, and a run
#   taking the directory over from another waits that lifetime (and a second) before it writes anything: part 5.

_T = TypeVar("_T")
_OWNER_RECORD_VERSION = 1
_TAKE_OVER_ATTEMPTS = 5
_REMEMBERED_KEYS = 10_000  # keys per directory whose last state (ETag, or removed) a run remembers
_EARLIER_OWNERS = 8  # the owners before the current one that its record names, each with when it took over


class CheckpointDirectoryTakenError(RuntimeError):
    """A newer `owner` (None: unknown) holds this checkpoint `directory`: this `run`'s save or removal was refused."""

    def __init__(
        self, message: str, directory: str = "", run: CheckpointRun | None = None, owner: CheckpointRun | None = None
    ) -> None:
        super().__init__(message)
        self.directory = directory
        self.run = run
        self.owner = owner


@dataclass(frozen=True)
class FenceToken:
    """What the other ranks of a sharded save check against: the directory, the owner record's ETag and run, and
    whether the store honours ETag conditions. Package-internal (docs/api.md)."""

    directory: str
    etag: str
    run: CheckpointRun
    conditional: bool = False
    expiring: bool = False  # the store refuses a fenced request once expired (`probe_expiring_requests`)


class _Hold:
    """One run's hold on one directory, shared by every fence of that run in this process."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.etag: str | None = None  # the owner record's ETag while this run holds the directory
        self.refusal: tuple[CheckpointRun | None, int, bool] | None = None  # (owner, generation, newer) once refused
        self.objects: dict[str, str | None] = {}  # key -> ETag this run committed, or None: this run removed it
        self.record_seen: tuple[str, Any] | None = None  # the record's ETag and modification time at the last HEAD
        self.not_stale: dict[str, str] = {}  # key -> ETag of objects `remove_stale_objects` found not a stale run's
        self.earlier: tuple[tuple[CheckpointRun, datetime.datetime], ...] = ()  # the record's earlier owners
        self.checked: tuple[datetime.datetime, float] | None = None  # the last read of the record: store, local time
        self.quiet = datetime.timedelta(0)  # how long after its record's write this run's takeover began writing


_holds: dict[tuple[str | None, str, str, str], _Hold] = {}
_fence_registry_lock = threading.Lock()
_UNKNOWN = object()


def _raise_if_no_bucket(exc: FileNotFoundError) -> None:
    """A missing record is a fact to act on; a missing bucket is the caller's error (raised with one request)."""
    if exc.__cause__ is not None and _pacing.error_code(exc.__cause__) == "NoSuchBucket":
        raise exc


def _refuses_conditions(exc: BaseException) -> bool:
    return _pacing.error_code(exc) in ("NotImplemented", "501")


class DirectoryFence:
    """One run's hold on one checkpoint directory (the ``fence=`` of `S3Utils.open_writer` and the removals)."""

    def __init__(
        self, utils: _s3.S3Utils, directory: str | os.PathLike[str], run: CheckpointRun | None = None, *,
        follows: str | None = None, conditional: bool = False, expiring: bool = False,
    ) -> None:
        """`follows`, `conditional`, `expiring`: see `following`."""
        self._follows = follows
        self._follows_conditionally = conditional
        self._follows_expiring = expiring
        self.directory = _urls.normalize_s3_url(directory).rstrip("/")
        self.bucket, prefix = _urls.s3_dir_prefix(self.directory)
        self._prefix = prefix
        self.record_key = prefix + OWNER_RECORD_NAME
        self.record_url = f"{_urls.S3_PATH_PREFIX}{self.bucket}/{self.record_key}"
        self.run = run or current_run()
        self._utils = utils
        self._store = (utils.settings.endpoint_url, self.bucket)
        with _fence_registry_lock:
            self._hold = _holds.setdefault((*self._store, self.record_key, self.run.run_id), _Hold())

    @property
    def capabilities(self) -> _s3.StoreCapabilities:
        """What the store and bucket honour (`s3_utils.store_capabilities`), as far as known."""
        return _s3.store_capabilities(self._utils, self.bucket)

    def __repr__(self) -> str:
        return f"<DirectoryFence {self.directory} for {self.run}>"

    @classmethod
    def following(cls, utils: _s3.S3Utils, token: FenceToken) -> DirectoryFence:
        """The fence of a rank that commits files for the run that holds `token`: it checks, never takes over."""
        return cls(
            utils, token.directory, token.run, follows=token.etag, conditional=token.conditional,
            expiring=token.expiring,
        )

    def once(self) -> _CheckedOnce:
        """This fence, checked at most once: one HEAD for operations within moments of each other (one rank's save)."""
        return _CheckedOnce(self)

    # ---- what the writer and the removals call --------------------------------------------------------------------
    def token(self, url: str) -> FenceToken:
        """For the other ranks of the save of `url`: take the directory over if need be, and say what they check."""
        with self._hold.lock, self._noted(url, "save"):
            self._raise_if_refused(url, "save")
            if self._hold.etag is None:
                self._take_over(url, "save")
            assert self._hold.etag is not None
            return FenceToken(self.directory, self._hold.etag, self.run, self._conditional(), self._expiring())

    def before_mutation(self, url: str, action: str) -> None:
        """Before a ``"save"`` or ``"removal"`` of `url`: take the directory over, or check (one HEAD) it is held."""
        hold = self._hold
        with hold.lock, self._noted(url, action):
            self._raise_if_refused(url, action)
            expected = self._follows or hold.etag
            if expected is None:  # this run has not saved here yet
                if action != "removal":
                    self._take_over(url, action)
                else:  # a removal before this run's first save: refused if a later run holds it; no take-over
                    self._adopted_or_refused(url, action, *self._read_record())
                return
            if self._head_record() == expected:
                return
            record, etag = self._read_record()
            if _is_run_of(record, self.run):  # rewritten by this run from another process (a pickled plugin...)
                if not self._follows:
                    hold.etag, hold.earlier, hold.quiet = etag, _record_earlier(record), _quiet(record)
                return
            if record is None and not self._follows:
                logger.warning("%s is gone (removed by hand?): %s writes it again", self.record_url, self.run)
                self._take_over(url, action)
                return
            self._refuse(url, action, record or {})

    def conditions(self, key: str) -> dict[str, str]:
        """The ETag condition for a commit of `key` (none on stores without conditional writes)."""
        if not self._conditional():
            return {}
        with self._hold.lock:
            state = self._hold.objects.get(key)
        return {"IfMatch": state} if isinstance(state, str) else {"IfNoneMatch": "*"}

    def _conditional(self) -> bool:
        if self._follows:
            return self._follows_conditionally
        return self.capabilities.conditional_put is True

    def _expiring(self) -> bool:
        return self._follows_expiring if self._follows else self.capabilities.expiring_requests is True

    def sent(self, url: str, action: str, request: Callable[[], _T]) -> _T:
        """`request()`, a commit or removal of `url` that the last check allowed: where the store honours expiring
        requests, signed at that check's time (the store's) to expire `FENCED_REQUEST_LIFETIME_S` after it, so a
        stale run's request that arrives after a newer run's takeover is refused by the store. A check older than
        half that is made again first; a request the store refused as expired is checked again and sent once more."""
        if not self._expiring():
            return request()
        lifetime = _request_lifetime_s()
        for attempt in (1, 2):
            with self._hold.lock:
                checked = self._hold.checked
            if checked is None or time.monotonic() - checked[1] > lifetime / 2:
                self.before_mutation(url, action)
                with self._hold.lock:
                    checked = self._hold.checked
            if checked is None:  # the store's answers carry no Date: nothing to sign at
                return request()
            _install_expiring_signer(self._utils.client)
            try:
                with _signed_at(checked[0], lifetime):
                    return request()
            except Exception as exc:
                if attempt == 2 or not _is_expired(exc):
                    raise
                logger.debug("The %s of %s expired before the store took it: checking %s again", action, url,
                             self.record_url)
                self.before_mutation(url, action)  # a refusal here names the store's answer as its context
        raise AssertionError("unreachable")

    def metadata(self) -> dict[str, str]:
        """The user metadata every commit of this run carries: which run it is (`stale_objects` reads it)."""
        return {RUN_METADATA_KEY: _run_metadata(self.run)}

    def committed(self, key: str, etag: str) -> None:
        self._remember({key: etag or _UNKNOWN})  # no ETag in the answer: nothing to condition the next commit on

    def removed(self, keys: Iterable[str]) -> None:
        self._remember(dict.fromkeys(keys))

    def conditional_removals(self) -> bool:
        """Whether this fence's removals carry the ETag they checked: the store honours conditional deletes (probed
        once per store and bucket); else one warning naming the store, and removals are checked, not conditioned."""
        record = _s3.store_capabilities(self._utils, self.bucket, ("conditional_delete",), self._prefix)
        if record.conditional_delete:
            return True
        _s3.warn_missing(
            record, "conditional_delete",
            "If-Match on DeleteObject / a per-object ETag in DeleteObjects: a fenced removal there is checked against "
            f"the owner record ({OWNER_RECORD_NAME}) right before it is sent but carries no condition, so a stale run "
            "paused between that check and its DeleteObjects can still remove a newer run's objects (docs/fencing.md)",
        )
        return False

    def remove_stale_objects(self) -> int:
        """Remove what other runs committed in this directory after this run took it over (`stale_objects`): the
        owner's saves call this after each commit. One listing of the directory (and a HEAD of the owner record
        unless the commit's check just read it), plus a HEAD per object committed since by a writer this process does
        not know; each removal is fenced and
        conditioned on the listed ETag. How many objects it removed; a failure only warns (the next save tries
        again), a refusal is raised."""
        if self._follows:
            return 0
        try:
            seen = self._hold.record_seen
            if seen is None or seen[0] != self._hold.etag or seen[1] is None:  # not since this run's last commit
                self._head_record()
                seen = self._hold.record_seen
            if self._hold.etag is None or seen is None or seen[0] != self._hold.etag or seen[1] is None:
                return 0  # not (or no longer) this run's: its own check refuses what comes next
            hold = self._hold
            owner = DirectoryOwner(self.directory, self.run, seen[1] + hold.quiet, hold.earlier)
            with hold.lock:
                known = {**hold.not_stale, **{key: etag for key, etag in hold.objects.items() if isinstance(etag, str)}}
            listed = self._utils.list_objects(self.directory)
            stale = stale_objects(self._utils, self.directory, listed, owner=owner, known=known)
            with hold.lock:  # what was found not stale is not asked again (bounded like `objects`)
                hold.not_stale.update((key, etag) for key, etag in known.items() if key not in hold.objects)
                while len(hold.not_stale) > _REMEMBERED_KEYS:
                    del hold.not_stale[next(iter(hold.not_stale))]
            if stale:
                self._utils.remove_listed(stale, fence=self)
                logger.warning(
                    "Removed %d object(s) a stale run committed in %s after %s took it over: %s", len(stale),
                    self.directory, self.run, ", ".join(info.url for info in stale[:5]),
                )
            return len(stale)
        except CheckpointDirectoryTakenError:
            raise
        except Exception as exc:
            logger.warning("Could not look for a stale run's objects in %s: %s (the next save looks again)",
                           self.directory, exc)
            return 0

    def committed_etag(self, key: str) -> str | None:
        with self._hold.lock:
            state = self._hold.objects.get(key)
        return state if isinstance(state, str) else None

    def precondition_failed(self, url: str, key: str, exc: BaseException, action: str = "save") -> dict[str, str]:
        """A commit's or removal's ETag condition failed: refuse if another run owns the directory, else the
        conditions to retry with (``IfMatch`` on the object there now; ``IfNoneMatch``: there is none)."""
        with self._hold.lock:
            committed_here = isinstance(self._hold.objects.pop(key, None), str)
            try:
                now: str | None = self._utils.call("head_object", url, Bucket=self.bucket, Key=key).get("ETag")
            except FileNotFoundError as missing:
                _raise_if_no_bucket(missing)
                now = None
            record, etag = self._read_record()
            if record is not None and not _is_run_of(record, self.run):
                try:
                    self._refuse(url, action, record)
                except CheckpointDirectoryTakenError as refusal:
                    raise refusal from exc
            if record is not None and not self._follows:
                self._hold.etag = etag
        if action == "removal":
            logger.debug(
                "%s changed since this run read its ETag (S3 answered %s), but %s still owns %s: removing it",
                url, _pacing.error_code(exc), self.run, self.directory,
            )
            return {"IfMatch": now} if now else {"IfNoneMatch": "*"}
        logger.log(
            logging.WARNING if committed_here else logging.DEBUG,
            "%s is not what this run last left there (S3 answered %s to its ETag condition), but %s still owns %s: "
            "overwriting it (%s)",
            url,
            _pacing.error_code(exc),
            self.run,
            self.directory,
            "a writer outside this run changed it, or an earlier attempt of this request went through"
            if committed_here
            else "an object an earlier run left there",
        )
        return {"IfMatch": now} if now else {"IfNoneMatch": "*"}

    # ---- the owner record -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _noted(self, url: str, action: str) -> Iterator[None]:
        """Name the checkpoint in errors of the owner record's requests."""
        try:
            yield
        except CheckpointDirectoryTakenError:
            raise
        except Exception as exc:
            exc.add_note(f"while checking that {self.run} owns {self.directory}, before the {action} of {url}")
            raise

    def _remember(self, states: dict[str, Any]) -> None:
        """Keep what this run last left at each key (an ETag, or None: removed) for its next commit's condition."""
        with self._hold.lock:
            objects = self._hold.objects
            for key, state in states.items():
                objects.pop(key, None)
                if state is not _UNKNOWN:
                    objects[key] = state
            while len(objects) > _REMEMBERED_KEYS:
                del objects[next(iter(objects))]

    def _head_record(self) -> str | None:
        try:
            response = self._utils.call("head_object", self.record_url, Bucket=self.bucket, Key=self.record_key)
        except FileNotFoundError as exc:
            _raise_if_no_bucket(exc)
            return None
        self._note_checked(response)
        self._hold.record_seen = (response["ETag"], response.get("LastModified"))
        return str(response["ETag"])

    def _note_checked(self, response: Mapping[str, Any]) -> None:
        """A read of the record answered: when, by the store's clock (its Date, to the second) and this process's."""
        moment = _store_time(response)
        if moment is not None:
            with self._hold.lock:
                self._hold.checked = (moment, time.monotonic())

    def _read_record(self) -> tuple[dict[str, Any] | None, str | None]:
        """The owner record (a dict; ``{}`` if unreadable) and its ETag, or ``(None, None)`` if there is none."""
        return self._read_dated_record()[:2]

    def _read_dated_record(self) -> tuple[dict[str, Any] | None, str | None, datetime.datetime | None]:
        """`_read_record`, and the record's modification time (the store's clock: when its owner took over)."""
        found = _get_record(self._utils, self.bucket, self.record_key)
        if found is None:
            return None, None, None
        record, response = found
        self._note_checked(response)
        return record, response.get("ETag", ""), response.get("LastModified")

    def _put_record(self, generation: int, conditions: Mapping[str, str], earlier: list[dict[str, Any]]) -> str:
        quiet = self._hold.quiet.total_seconds()
        body = {
            "version": _OWNER_RECORD_VERSION, **_run_fields(self.run), "generation": generation, "taken": time.time(),
            "earlier": earlier, **({"quiet_s": quiet} if quiet else {}),
        }
        response = self._utils.call(
            "put_object", self.record_url, Bucket=self.bucket, Key=self.record_key,
            Body=json.dumps(body, sort_keys=True).encode(), ContentType="application/json", **conditions,
        )
        self._note_checked(response)
        return str(response.get("ETag", ""))

    def _take_over(self, url: str, action: str) -> None:
        """Make this run the directory's owner (lock held), as the comment above says."""
        hold = self._hold
        for _ in range(_TAKE_OVER_ATTEMPTS):
            record, etag, taken = self._read_dated_record()
            owner = _record_run(record)
            if self._adopted_or_refused(url, action, record, etag):
                return
            generation = _record_generation(record) + 1
            earlier = _earlier_entries(record, taken)
            support = self.capabilities.conditional_put
            if support is not False and probe_expiring_requests(self._utils, self.bucket, self._prefix):
                hold.quiet = datetime.timedelta(seconds=_request_lifetime_s() + 1)  # readers: `quiet_s`
            conditions: dict[str, str] = {}
            if support is not False:
                conditions = {"IfMatch": str(etag)} if record is not None else {"IfNoneMatch": "*"}
            try:
                hold.etag = self._put_record(generation, conditions, earlier)
                written = time.monotonic()
            except Exception as exc:
                if conditions and _s3.is_precondition_failed(exc, conditions):
                    continue  # another run wrote the record since it was read: read it again
                if conditions and _refuses_conditions(exc):
                    self._conditional_writes_unsupported(f"it answers {_pacing.error_code(exc)} to them")
                    continue
                raise
            hold.earlier = _record_earlier({"earlier": earlier})
            if support is None:
                self._probe(generation, earlier)
            if hold.quiet and owner is not None and not _is_run_of(record, self.run):
                self._wait_for_the_last_owners_requests(hold.quiet, written)
                if self._head_record() != hold.etag:  # taken over again meanwhile: look again
                    hold.etag = None
                    continue
            previous = f", from {owner}" if owner is not None else ""
            logger.info("%s took %s over (generation %d%s)", self.run, self.directory, generation, previous)
            return
        raise OSError(
            f"Could not take the checkpoint directory {self.directory} over: its owner record {self.record_url} "
            f"changed {_TAKE_OVER_ATTEMPTS} times while {self.run} tried. Another run is starting to save there at "
            "the same moment; run one job per checkpoint directory."
        )

    def _wait_for_the_last_owners_requests(self, quiet: datetime.timedelta, written: float) -> None:
        """Sleep until every commit or removal the replaced owner's checks allowed has expired (their lifetime and a
        second after the record's write, by the store's clock): what lands meanwhile counts as before the takeover
        (`stale_objects` reads ``quiet_s``), and this run writes nothing in that time, so nothing it writes can meet
        one. Once per run and directory taken from another run."""
        logger.info("%s waits %.0f s for requests %s's earlier owner checked before the takeover to expire",
                    self.run, quiet.total_seconds(), self.directory)
        time.sleep(max(0.0, quiet.total_seconds() - (time.monotonic() - written)))

    def _adopted_or_refused(self, url: str, action: str, record: dict[str, Any] | None, etag: str | None) -> bool:
        """True if `record` is this run's (adopted); refuse if it is a later run's; else False (free to take)."""
        if _is_run_of(record, self.run):
            self._hold.etag, self._hold.earlier, self._hold.quiet = etag, _record_earlier(record), _quiet(record)
            return True
        owner = _record_run(record)
        if record is not None and owner is not None and owner.is_newer_than(self.run):
            self._refuse(url, action, record, newer=True)
        return False

    def _probe(self, generation: int, earlier: list[dict[str, Any]]) -> None:
        """Once per store and bucket: a PUT that must fail (If-None-Match: * on the record just written)."""
        try:
            self._hold.etag = self._put_record(generation, {"IfNoneMatch": "*"}, earlier)
        except Exception as exc:
            if _s3.is_precondition_failed(exc, {}):
                _s3.note_capability(self.capabilities, "conditional_put", True)
                return
            if _refuses_conditions(exc):
                self._conditional_writes_unsupported(f"it answers {_pacing.error_code(exc)} to them")
                return
            raise
        self._conditional_writes_unsupported("it ignores them (a PUT with If-None-Match: * replaced an object)")

    def _conditional_writes_unsupported(self, how: str) -> None:
        _s3.note_capability(self.capabilities, "conditional_put", False)
        _s3.warn_missing(
            self.capabilities, "conditional_put",
            f"conditional writes (If-Match / If-None-Match): {how}. Checkpoint directories there are still owned by "
            f"one run (their {OWNER_RECORD_NAME} is checked before every save and removal), but not protected: two "
            "runs taking a directory over at the same moment, and a stale run's save or removal sent in the moment "
            "between that check and its request.",
        )

    def _raise_if_refused(self, url: str, action: str) -> None:
        if self._hold.refusal is not None:
            raise self._refusal(url, action, *self._hold.refusal)

    def _refuse(self, url: str, action: str, record: dict[str, Any], newer: bool = False) -> None:
        self._hold.refusal = (_record_run(record), _record_generation(record), newer)  # refused once, refused always
        raise self._refusal(url, action, *self._hold.refusal)

    def _refusal(
        self, url: str, action: str, owner: CheckpointRun | None, generation: int, newer: bool = False
    ) -> CheckpointDirectoryTakenError:
        holder = f"{owner}" if owner is not None else "another run (its owner record is unreadable)"
        if newer:
            why = f"belongs to {holder}, a later launch than this run, {self.run}"
        else:
            why = f"was taken over (generation {generation}) by {holder}; this is {self.run}"
        return CheckpointDirectoryTakenError(
            f"Refused the {action} of {url}: the checkpoint directory {self.directory} {why}. Nothing was changed: "
            "the newer run's checkpoints are intact. This run is stale (requeued, replaced or restarted elsewhere): "
            "stop it. If the other run is gone and this one must go on, restart it (a new run takes the directory "
            f"over at its first save) or delete {self.record_url}; fencing=False (s3_checkpointing.fencing: false) "
            "turns the check off.",
            self.directory, self.run, owner,
        )


def _is_run_of(record: Mapping[str, Any] | None, run: CheckpointRun) -> bool:
    return isinstance(record, Mapping) and record.get("run") == run.run_id


def _run_fields(run: CheckpointRun) -> dict[str, Any]:
    """How an owner record spells a run (its owner's, and each of its earlier owners'); `_record_run` reads it."""
    return {
        "run": run.run_id, "host": run.host, "pid": run.pid, "started": run.started, "job": run.job,
        "attempt": list(run.attempt),
    }


def _record_run(record: Mapping[str, Any] | None) -> CheckpointRun | None:
    if not isinstance(record, Mapping):
        return None
    try:
        job, attempt = str(record.get("job") or ""), tuple(int(n) for n in record.get("attempt") or ())
        run, host, pid, started = str(record["run"]), str(record["host"]), int(record["pid"]), float(record["started"])
        return CheckpointRun(run, host, pid, started, job, attempt)
    except (KeyError, TypeError, ValueError):
        return None


def _record_generation(record: Mapping[str, Any] | None) -> int:
    generation = record.get("generation") if isinstance(record, Mapping) else None
    return generation if isinstance(generation, int) else 0


def _earlier_entries(record: Mapping[str, Any] | None, taken: datetime.datetime | None) -> list[dict[str, Any]]:
    """The ``earlier`` list of a record that takes over from `record` (modified at `taken`): its owner first, with
    when it took over, then the owners its record names, `_EARLIER_OWNERS` at most."""
    owner = _record_run(record)
    if owner is None or taken is None:
        return []
    entry = _run_fields(owner) | {"taken_at": (taken + _quiet(record)).timestamp()}
    earlier = record.get("earlier")
    return [entry, *(earlier if isinstance(earlier, list) else [])][:_EARLIER_OWNERS]


def _quiet(record: Mapping[str, Any] | None) -> datetime.timedelta:
    """How long after its record's write the owner's takeover began writing (``quiet_s``; 0 where not recorded)."""
    quiet = record.get("quiet_s") if isinstance(record, Mapping) else None
    ok = isinstance(quiet, (int, float)) and not isinstance(quiet, bool) and 0 < quiet < 3600
    return datetime.timedelta(seconds=quiet if ok else 0)


def _store_time(response: Mapping[str, Any]) -> datetime.datetime | None:
    """When the store answered (its Date header, to the second), or None without one."""
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    try:
        return email.utils.parsedate_to_datetime(headers["date"]).astimezone(datetime.timezone.utc)
    except (KeyError, TypeError, ValueError):
        return None


def _record_earlier(record: Mapping[str, Any] | None) -> tuple[tuple[CheckpointRun, datetime.datetime], ...]:
    """The earlier owners a record names, newest first, each with when it took over (the store's clock)."""
    entries = record.get("earlier") if isinstance(record, Mapping) else None
    found = []
    for entry in entries if isinstance(entries, list) else []:
        run = _record_run(entry)
        taken = entry.get("taken_at") if isinstance(entry, Mapping) else None
        if run is not None and isinstance(taken, (int, float)) and not isinstance(taken, bool):
            found.append((run, datetime.datetime.fromtimestamp(taken, datetime.timezone.utc)))
    return tuple(found)


class _CheckedOnce:
    """A fence whose check runs once: later operations reuse its outcome (see `DirectoryFence.once`)."""

    def __init__(self, fence: DirectoryFence) -> None:
        self._fence = fence
        self._lock = threading.Lock()
        self._checked = False
        self._error: BaseException | None = None

    def before_mutation(self, url: str, action: str) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            if not self._checked:
                try:
                    self._fence.before_mutation(url, action)
                except BaseException as exc:
                    self._error = exc
                    raise
                self._checked = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fence, name)


# --------------------------------------------------------------------------------------------------------------------
# Stale objects: what a run older than the owner committed after the owner took over
# --------------------------------------------------------------------------------------------------------------------
#
# A stale run paused between its check of the owner record and the commit of a key that holds no object (a new top-k
# name, a file or the `.metadata` of its DCP save) creates that key when it continues: no condition on that request
# can refuse it. So every fenced commit names its run (`RUN_METADATA_KEY`), and the owner record's modification time
# (the store's clock) says when its owner took over. An object another run committed after that is a stale run's:
# resume discovery, `ls`, `verify` and `convert` leave it out, and the owner's next save (`DirectoryFence.
# remove_stale_objects`) and `gc` remove it, each removal conditioned on the ETag that was listed (docs/fencing.md).

_COMMIT_MARKER = ".metadata"  # a DCP checkpoint's commit: the run that wrote it decides for the files beside it
_HEAD_WORKERS = 16


@dataclass(frozen=True)
class DirectoryOwner:
    """A checkpoint directory's owner as its record says (`directory_owner`)."""

    directory: str
    run: CheckpointRun
    taken: datetime.datetime  # when the owner took over: its record's modification time by the store's clock, and
    # its quiet time (``quiet_s``: a stale request that lands within it was sent before the takeover, part 5)
    earlier: tuple[tuple[CheckpointRun, datetime.datetime], ...] = ()  # the owners before it, newest first, each
    # with when it took over: an older run's commit after any of those takeovers is a stale run's too (a straggler
    # that committed after a launch took over, which was killed before its next save removed it)


def directory_owner(utils: _s3.S3Utils, directory: str | os.PathLike[str]) -> DirectoryOwner | None:
    """The owner of the checkpoint `directory` (one GET of its record), or None where it has none (fencing off, no
    fenced save yet) or the record is unreadable. Package-internal (docs/api.md)."""
    url = _urls.normalize_s3_url(directory).rstrip("/")
    bucket, prefix = _urls.s3_dir_prefix(url)
    found = _get_record(utils, bucket, prefix + OWNER_RECORD_NAME)
    run = _record_run(found[0]) if found is not None else None
    if found is None or run is None or found[1].get("LastModified") is None:
        return None
    record, response = found
    return DirectoryOwner(url, run, response["LastModified"] + _quiet(record), _record_earlier(record))


def _get_record(utils: _s3.S3Utils, bucket: str, key: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """One GET of an owner record: its JSON (``{}`` if unreadable) and the response, or None where there is none."""
    try:
        response = utils.call("get_object", _urls.build_s3_url(bucket, key), Bucket=bucket, Key=key)
    except FileNotFoundError as exc:
        _raise_if_no_bucket(exc)
        return None
    with response["Body"] as body:
        raw = body.read()
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    return (record if isinstance(record, dict) else {}), response


def stale_objects(
    utils: _s3.S3Utils, directory: str | os.PathLike[str], objects: Iterable[_s3.S3ObjectInfo], *,
    owner: DirectoryOwner | object | None = _UNKNOWN, known: Mapping[str, str] | None = None,
) -> list[_s3.S3ObjectInfo]:
    """The objects among `objects` (listed under the checkpoint `directory`) that a run older than its `owner` (read
    with `directory_owner` if not given) committed after the owner, or an earlier owner newer than that run, took
    over: a stale run's. Never an object that names no run (written with fencing off, by hand, by another tool), one
    of a run newer than the owner (so a stale run that believes it still owns the directory never counts the newer
    run's objects as stale), or one committed before every takeover by a run newer than its writer (an older run's
    checkpoint from before it was superseded). Package-internal (docs/api.md).

    Times are the store's, to the second: what an older run commits in the second of the takeover counts as after it
    (that run was still writing while the newer one saved: a straggler's, not a checkpoint to resume). One HEAD per
    object committed after that whose listed ETag is not `known` (key -> ETag: the caller's own commits), run at most
    16 at a time; where a folder's ``.metadata`` (a DCP checkpoint's commit) is among them, it decides for the whole
    folder, so a DCP checkpoint costs one HEAD. A `known` dict gains the objects found not stale."""
    if owner is _UNKNOWN:
        owner = directory_owner(utils, directory)
    if not isinstance(owner, DirectoryOwner):
        return []
    _, prefix = _urls.s3_dir_prefix(owner.directory)
    takeovers = [(run, taken.replace(microsecond=0)) for run, taken in ((owner.run, owner.taken), *owner.earlier)]
    after = min(taken for _, taken in takeovers)  # the store dates to the second: a takeover's second counts
    groups: dict[str, list[_s3.S3ObjectInfo]] = {}  # name directly in the directory -> its objects since the takeover
    for info in objects:
        relative = info.key[len(prefix) :] if info.key.startswith(prefix) else ""
        if relative and not relative.endswith("/") and info.last_modified is not None and info.last_modified >= after:
            groups.setdefault(relative.split("/", 1)[0], []).append(info)
    decisions: list[tuple[_s3.S3ObjectInfo, list[_s3.S3ObjectInfo]]] = []  # (the object whose run decides, for whom)
    for name, members in groups.items():
        marker = next((info for info in members if info.key == f"{prefix}{name}/{_COMMIT_MARKER}"), None)
        decisions += [(marker, members)] if marker is not None else [(info, [info]) for info in members]
    known = known if known is not None else {}
    decisions = [(info, members) for info, members in decisions if not info.etag or known.get(info.key) != info.etag]
    if not decisions:
        return []

    def writer_run(info: _s3.S3ObjectInfo) -> CheckpointRun | None:
        try:
            return _run_from_metadata(utils.head_object(info.url).metadata.get(RUN_METADATA_KEY))
        except FileNotFoundError:
            return None  # gone since the listing

    from concurrent.futures import ThreadPoolExecutor  # only where there is something to ask

    with ThreadPoolExecutor(min(_HEAD_WORKERS, len(decisions)), thread_name_prefix="s3ckpt-stale") as pool:
        runs = list(pool.map(writer_run, [info for info, _ in decisions]))
    def superseded(run: CheckpointRun, committed: datetime.datetime) -> bool:  # after a newer run took over
        return any(
            newer.run_id != run.run_id and newer.is_newer_than(run) and committed >= taken for newer, taken in takeovers
        )

    stale = []
    for (info, members), run in zip(decisions, runs, strict=True):
        if (
            run is not None and run.run_id != owner.run.run_id and owner.run.is_newer_than(run)
            and info.last_modified is not None and superseded(run, info.last_modified)
        ):
            stale += members
        elif isinstance(known, dict) and info.etag:
            known[info.key] = info.etag  # decided: not a stale run's (the caller may keep it)
    return stale


def _run_metadata(run: CheckpointRun) -> str:
    """`run` as the value of `RUN_METADATA_KEY`: what `CheckpointRun.is_newer_than` compares, ASCII."""
    attempt = ".".join(str(n) for n in run.attempt) or "-"
    return urllib.parse.quote(f"{run.started!r} {attempt} {run.job or '-'} {run.run_id}", safe=" :@#/.-_")


def _run_from_metadata(value: str | None) -> CheckpointRun | None:
    try:
        started, attempt, job, run_id = urllib.parse.unquote(value or "").split(" ", 3)
        numbers = tuple(int(n) for n in attempt.split(".")) if attempt != "-" else ()
        return CheckpointRun(run_id, "", 0, float(started), "" if job == "-" else job, numbers)
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------------------------------
# Expiring requests: a stale run's commit or removal that the store refuses once its check is old
# --------------------------------------------------------------------------------------------------------------------
#
# ETag conditions keep a stale run, stopped between its check and its request, off every object the newer run wrote,
# but not off what the newer run has not written yet (its own last commit, an older checkpoint, a new key). Where the
# store refuses a request signed to expire (SigV4 in the query, as a presigned URL: ``X-Amz-Date`` and
# ``X-Amz-Expires``), each fenced commit and removal is signed at the store's time of the check that allowed it (the
# Date of that answer, so no clock of this host counts) and lives `FENCED_REQUEST_LIFETIME_S`. A run taking the
# directory over from another waits that long and a second before it writes: nothing checked before the takeover
# lands after the newer run starts writing, and what lands before counts as before the takeover (``quiet_s``).

FENCED_REQUEST_LIFETIME_S = 15
"""Seconds a fenced commit or removal stays valid after its check, and a takeover from another run waits (plus one);
the ``S3CKPT_FENCED_REQUEST_LIFETIME_S`` environment variable sets it (docs/fencing.md)."""
_LIFETIME_ENV = "S3CKPT_FENCED_REQUEST_LIFETIME_S"
_EXPIRING_SIGNER = "s3v4-s3ckpt-expiring"  # its name among botocore's signers
_GUARDED_OPERATIONS = ("PutObject", "CompleteMultipartUpload", "DeleteObject", "DeleteObjects", "CopyObject")
_signature: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("s3ckpt_signed_at", default=None)
_clients_with_signer: weakref.WeakSet[Any] = weakref.WeakSet()
_signer_lock = threading.Lock()


def _request_lifetime_s() -> int:
    """`FENCED_REQUEST_LIFETIME_S`, or the environment's ``S3CKPT_FENCED_REQUEST_LIFETIME_S`` (a whole number >= 1)."""
    try:
        return max(1, int(os.environ.get(_LIFETIME_ENV, "") or FENCED_REQUEST_LIFETIME_S))
    except ValueError:
        return FENCED_REQUEST_LIFETIME_S


@contextlib.contextmanager
def _signed_at(moment: datetime.datetime, lifetime: int) -> Iterator[None]:
    """Within the block, this thread's guarded requests are signed at `moment` and expire `lifetime` s after it."""
    token = _signature.set((moment.astimezone(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ"), lifetime))
    try:
        yield
    finally:
        _signature.reset(token)


def _install_expiring_signer(client: Any) -> None:
    """Let `client` sign its guarded operations inside `_signed_at` (once per client; other requests as before)."""
    with _signer_lock:
        if client in _clients_with_signer:
            return
        import botocore.auth

        botocore.auth.AUTH_TYPE_MAPS.setdefault(_EXPIRING_SIGNER, _expiring_auth())
        for operation in _GUARDED_OPERATIONS:
            client.meta.events.register_first(
                f"choose-signer.s3.{operation}", _choose_signer, unique_id=f"s3ckpt-expiring-{operation}"
            )
        _clients_with_signer.add(client)


def _choose_signer(signature_version: str = "", **_: Any) -> str | None:
    """botocore's ``choose-signer`` event: inside `_signed_at`, a SigV4 request gets the expiring signer."""
    return _EXPIRING_SIGNER if _signature.get() is not None and signature_version in ("s3v4", "v4") else None


@functools.cache
def _expiring_auth() -> type:
    """botocore's S3 query signer, dated at the check (`_signed_at`) and expiring after its lifetime. It keeps the
    body where it is (the query signer would move a form body into the URL) and signs every header sent."""
    from botocore.auth import S3SigV4QueryAuth

    class ExpiringS3QueryAuth(S3SigV4QueryAuth):  # type: ignore[misc]
        def __init__(self, credentials: Any, service_name: str, region_name: str, **_: Any) -> None:
            timestamp, lifetime = _signature.get() or ("", 1)
            super().__init__(credentials, service_name, region_name, expires=lifetime)
            self._timestamp = timestamp

        def _modify_request_before_signing(self, request: Any) -> None:
            if self._timestamp:
                request.context["timestamp"] = self._timestamp  # add_auth set it to this host's clock
            data, request.data = request.data, b""
            try:
                super()._modify_request_before_signing(request)
            finally:
                request.data = data

    return ExpiringS3QueryAuth


def _is_expired(exc: BaseException) -> bool:
    """Whether `exc` is the store refusing a request whose signature expired."""
    response = getattr(exc, "response", None)
    message = str(response.get("Error", {}).get("Message", "")) if isinstance(response, dict) else ""
    return _pacing.error_code(exc) in ("AccessDenied", "403") and "expired" in message.lower()


def probe_expiring_requests(utils: _s3.S3Utils, bucket: str, prefix: str = "") -> bool | None:
    """Whether the store refuses a fenced request once expired (`StoreCapabilities.expiring_requests`): probed once
    per store and bucket on a temporary key under `prefix`. A PUT signed now must be taken, and one signed ten minutes
    ago with a one-second lifetime refused as expired: moto takes it (it checks no signature), SeaweedFS and S3 refuse
    it. None if the probe failed (access denied, say).
    Package-internal (docs/api.md)."""
    record = _s3.store_capabilities(utils, bucket)
    if record.expiring_requests is not None:
        return record.expiring_requests
    key = f"{prefix}{_s3.PROBE_KEY_PREFIX}{secrets.token_hex(8)}"
    url = _urls.build_s3_url(bucket, key)

    def answer(moment: datetime.datetime, lifetime: int) -> str:
        try:
            with _signed_at(moment, lifetime):
                utils.call("put_object", url, Bucket=bucket, Key=key, Body=b"probe", Metadata={"s3ckpt-probe": "1"})
        except Exception as exc:
            return "expired" if _is_expired(exc) else repr(exc)
        return "taken"

    try:
        now = _store_time(utils.call("put_object", url, Bucket=bucket, Key=key, Body=b"probe"))
        _install_expiring_signer(utils.client)
        fresh = answer(now, 60) if now is not None else "no Date header"
        late = answer(now - datetime.timedelta(minutes=10), 1) if now is not None else ""
        honoured = fresh == "taken" and late == "expired"
        _s3.note_capability(record, "expiring_requests", honoured)
        logger.debug("%s (bucket %s): a fresh signed request: %s; an expired one: %s", record.store, bucket, fresh,
                     late)
    except Exception as exc:
        logger.debug("%s (bucket %s): could not probe expiring requests: %r", record.store, bucket, exc)
    finally:
        with contextlib.suppress(Exception):
            utils.call("delete_object", url, Bucket=bucket, Key=key)
    if record.expiring_requests is False:
        _s3.warn_missing(
            record, "expiring_requests",
            "requests signed to expire (SigV4 X-Amz-Expires): a stale run paused between its check of the owner "
            f"record ({OWNER_RECORD_NAME}) and its commit or removal can still, once it goes on, replace or remove "
            "what the newer run has not written yet there (never what it wrote: the ETag conditions refuse that); "
            "docs/fencing.md",
        )
    return record.expiring_requests


# --------------------------------------------------------------------------------------------------------------------
# Host locks: a short lock on a node's tmpfs that a stopped straggler cannot hold
# --------------------------------------------------------------------------------------------------------------------

TAKEOVER_LOCK_WAIT_S = 10.0  # Package-internal (docs/api.md)
"""How long a `takeover_lock` waits: its holders keep it for a few renames, so 10 s held means a stopped or hung one."""


@contextlib.contextmanager
def takeover_lock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive flock on the private lock file `path` (created 0600, never through a link) around a few
    renames of `what` (a memory tier's launch record and commits, a replica root's). A holder that keeps it
    `TAKEOVER_LOCK_WAIT_S` is stopped or hung: typically a straggler of an earlier launch, SIGSTOPped by its
    scheduler inside a commit. This process then renames a fresh, locked lock file over that one, says so, and goes
    on under it; the stopped holder, once it continues, finishes at most the one commit it was inside, and its next
    check of the launch record refuses it (docs/fencing.md). Never a relaunch that waits forever, or gives up, on a
    process it cannot see.
    Package-internal (docs/api.md)."""
    if fcntl is None:
        yield
        return
    path = Path(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        wait_s = TAKEOVER_LOCK_WAIT_S
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                if _same_file(fd, path):
                    break
                fcntl.flock(fd, fcntl.LOCK_UN)  # a lock file replaced meanwhile: take the one in place
            if not _same_file(fd, path):
                os.close(fd)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            elif time.monotonic() > deadline:
                os.close(fd)
                fd = _replace_lock_file(path, what, wait_s)
                break
            else:
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether `fd` is still the file at `path` (one `_replace_lock_file` replaced is not)."""
    try:
        found = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)


def _replace_lock_file(path: Path, what: str, wait_s: float) -> int:
    """A fresh lock file, locked, renamed over the one a stopped process holds: its fd."""
    fresh = path.with_name(f".tmp-{path.name}-{secrets.token_hex(4)}")
    fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)  # 0600 whatever the umask
        fcntl.flock(fd, fcntl.LOCK_EX)  # new and unseen: free
        os.rename(fresh, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(fresh)
        raise
    logger.warning(
        "%s: %s stayed locked for %g s: a process holding it is stopped or hung (a straggler of an earlier launch?); "
        "this process goes on under a fresh lock. The stopped one can finish at most the one commit it was inside "
        "once it continues; end it (docs/fencing.md)", what, path, wait_s,
    )  # fmt: skip
    return fd

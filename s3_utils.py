"""Everything that talks to S3: one core file, in parts that build on each other (read it top to bottom).

1. Retries: `RetryPolicy`, the single retry layer of every request; throttling answers, and `request_pacer`, which
wires the pacer (s3_pacing) to this process's job and host. 2. Request options: `S3RequestOptions`. 3. Client:
`S3ClientSettings` and `get_s3_client`. 4. Checksums: S3's CRCs and the records a load is verified against.
5. Objects: `S3ObjectInfo`, `DownloadedObject`. 6. Errors: S3's answers as Python's exceptions, annotated. 7. `S3Utils`:
the facade with NeMo's names; `Fence`, what its writer and removals ask of a directory's owner. 8. The ranged reader.
9. Fast paths. 10. The streaming writer (`S3MultipartWriter`). 11. Store capabilities: what a store honours
(`store_capabilities`). 12. s3fs caches. Before this file: s3_process (the optional packages and sibling files this
process has, and which rank of which job on which node it is) and s3_pacing (the request pacer); after it,
s3_fencing (run identity and the fences, `DirectoryFence`).
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import datetime
import email.utils
import enum
import functools
import http.client
import io
import itertools
import json
import logging
import math
import mmap
import os
import queue
import random
import re
import secrets
import sys
import tempfile
import threading
import time
import types
import urllib.parse
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields, replace
from typing import IO, Any, BinaryIO, NoReturn, Protocol, TypeVar

if __package__:
    from . import s3_dirpath_utils as _urls
    from . import s3_pacing as _pacing
    from . import s3_process as _process
else:  # installed (or copied) as a top-level module
    import s3_dirpath_utils as _urls
    import s3_pacing as _pacing
    import s3_process as _process

__all__ = [
    "DEFAULT_CHUNK_SIZE_MB", "DEFAULT_MAX_READ_CONCURRENCY", "DEFAULT_MAX_WRITE_CONCURRENCY", "GB", "MB",
    "ChecksumMismatchError", "DownloadedObject", "Fence", "MissingOptionalDependencyError", "MultipartUploadInfo",
    "PacerLane", "RecordedChecksum", "RequestPacer", "RequestRates", "RetryPolicy", "S3ClientSettings",
    "S3MultipartWriter", "S3ObjectInfo", "S3RequestOptions", "S3Utils", "SharedLoadError", "StoreCapabilities",
    "CAPABILITIES", "store_capabilities", "checksum_of", "forget_s3fs_instances", "fresh_s3fs_instances",
    "invalidate_fsspec_cache", "is_throttling_error", "release_part_buffers", "validate_checksum_algorithm",
]

logger = logging.getLogger(__name__)
__version__ = _urls.__version__
MissingOptionalDependencyError = _process.MissingOptionalDependencyError  # re-exported: a feature's missing package

MB = 1024**2
GB = 1024**3
DEFAULT_CHUNK_SIZE_MB = 16  # part size of uploads, range size of downloads (NeMo: 64; benchmarks/README.md)
DEFAULT_MAX_READ_CONCURRENCY = 15
DEFAULT_MAX_WRITE_CONCURRENCY = 10
MIN_PART_SIZE = 5 * MB  # S3's minimum for every part but the last; package-internal (docs/api.md)
MAX_PARTS = 10_000  # S3's maximum number of parts in one multipart upload
CHECKSUM_SIDECAR_SUFFIX = ".s3ckpt-checksum.json"  # a checksum record beside an object; package-internal (docs/api.md)
# package-internal (docs/api.md)
OWNER_RECORD_NAME = ".s3ckpt-owner.json"  # a checkpoint directory's owner record (s3_fencing.DirectoryFence)
PROBE_KEY_PREFIX = ".s3ckpt-probe-"  # a capability probe's temporary object (`store_capabilities`). Package-internal


def check_transfer_sizes(chunk_size_MB: float, **concurrency: int) -> None:
    """Refuse a part and range size under S3's minimum part size, and a concurrency (named by its argument:
    ``max_read_concurrency=...``) under 1 (ValueError), or either of the wrong type (TypeError, as Python's own
    functions do): the one check of every class that takes them. Package-internal (docs/api.md)."""
    minimum = f"chunk_size_MB must be a number >= {MIN_PART_SIZE // MB} (S3's minimum part size), got {chunk_size_MB!r}"
    if not isinstance(chunk_size_MB, (int, float)) or isinstance(chunk_size_MB, bool):
        raise TypeError(minimum)
    if not (math.isfinite(chunk_size_MB) and chunk_size_MB * MB >= MIN_PART_SIZE):
        raise ValueError(minimum)
    for name, value in concurrency.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int >= 1, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _is_package_record(key: str) -> bool:
    """Whether `key` is a checksum sidecar, an owner record or a capability probe's (listings leave them out)."""
    name = key.rpartition("/")[2]
    return key.endswith(CHECKSUM_SIDECAR_SUFFIX) or name == OWNER_RECORD_NAME or name.startswith(PROBE_KEY_PREFIX)


_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------------------------------
# Retries: the policy and the decision after each failure are s3_pacing's; here, the pacer of this process
# --------------------------------------------------------------------------------------------------------------------

RetryPolicy = _pacing.RetryPolicy  # re-exported: how every S3 request is retried

# ---- throttling and the request pacer (s3_pacing: the pacer itself) ----------------------------------------------

RequestRates, RequestPacer, PacerLane = _pacing.RequestRates, _pacing.RequestPacer, _pacing.PacerLane  # re-exported
is_throttling_error = _pacing.is_throttling_error  # re-exported: S3's "slow down" answers (code, or HTTP 429 / 503)


# ---- the host's shared pacer state (optional: s3_node_sharing) -----------------------------------------------------
#
# Inside a job, the pacer's state is shared by the job's processes on this host (a small file in /dev/shm, from
# s3_node_sharing), so that a process learns from its neighbours' SlowDowns too. Without that module (or with
# ``S3CKPT_PACER_SHARING=0``) each process paces on its own.

PACER_SHARING_ENV = "S3CKPT_PACER_SHARING"  # set to ``0`` (or ``off``) to keep one pacer per process even inside a job


def _shared_pacer_state(endpoint_url: str | None, bucket: str, partition: str) -> _pacing.SharedLaneStore | None:
    """The host's shared state for this job's pacer of `bucket` (and `partition`); None outside a job, or where
    sharing is off/absent."""
    sharing_off = os.environ.get(PACER_SHARING_ENV, "").strip().lower() in ("0", "off", "false", "no")
    if sharing_off or _process.job_key() is None:
        return None
    sharing = _process.node_sharing()
    return None if sharing is None else sharing.shared_pacer_file(endpoint_url, bucket, partition)


_pacers: dict[tuple[int, str | None, str, str], RequestPacer] = {}
_pacers_lock = threading.Lock()


def request_pacer(endpoint_url: str | None, bucket: str, partition: str = "") -> RequestPacer:
    """The process's `RequestPacer` for `bucket` at `endpoint_url` (None: AWS), made on first use (also in a fork);
    `partition`: a spread directory's prefix (`_urls.spread_prefix`), paced apart from the bucket's other keys."""
    key = (os.getpid(), endpoint_url, bucket, partition)
    pacer = _pacers.get(key)
    if pacer is None:
        with _pacers_lock:
            pacer = _pacers.get(key)
            if pacer is None:
                shared = _shared_pacer_state(endpoint_url, bucket, partition)
                pacer = _pacers[key] = RequestPacer(endpoint_url, bucket, shared, world_size=_process.world_size)
    return pacer


# --------------------------------------------------------------------------------------------------------------------
# Request options: encryption, storage class, tags, bucket owner, requester pays
# --------------------------------------------------------------------------------------------------------------------

SERVER_SIDE_ENCRYPTIONS = ("AES256", "aws:kms", "aws:kms:dsse")  # package-internal (docs/api.md)
STORAGE_CLASSES = (
    *("STANDARD", "REDUCED_REDUNDANCY", "STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR"),
    *("EXPRESS_ONEZONE", "OUTPOSTS", "SNOW"),
)
"""Storage classes a checkpoint can be written in (not GLACIER, DEEP_ARCHIVE: a load would need a restore first)."""
_UPLOAD_OPERATIONS = frozenset({"PutObject", "CreateMultipartUpload"})


@dataclass(frozen=True)
class S3RequestOptions:
    """S3 parameters added to uploads (`ExpectedBucketOwner`, `RequestPayer`: to all requests), if not set by a call."""

    ServerSideEncryption: str | None = None  # ``AES256``, ``aws:kms`` or ``aws:kms:dsse``
    SSEKMSKeyId: str | None = None  # KMS key id or ARN for ``aws:kms*``; else the account's ``aws/s3`` key
    BucketKeyEnabled: bool | None = None  # S3 Bucket Key for ``aws:kms`` (fewer KMS requests)
    StorageClass: str | None = None  # one of `STORAGE_CLASSES`
    Tagging: str | None = None  # URL-encoded tags (``project=gpt&team=nlp``); a mapping is encoded
    ExpectedBucketOwner: str | None = None  # the 12-digit account id that must own the bucket (else 403)
    RequestPayer: str | None = None  # ``requester`` to read and write a Requester Pays bucket

    def __post_init__(self) -> None:
        if isinstance(self.Tagging, Mapping):
            encoded = urllib.parse.urlencode({str(key): str(value) for key, value in self.Tagging.items()})
            object.__setattr__(self, "Tagging", encoded)
        problems = []
        sse = self.ServerSideEncryption
        if sse is not None and sse not in SERVER_SIDE_ENCRYPTIONS:
            problems.append(f"ServerSideEncryption must be one of {list(SERVER_SIDE_ENCRYPTIONS)}, got {sse!r}")
        kms = sse in ("aws:kms", "aws:kms:dsse")
        if self.SSEKMSKeyId is not None and not kms:
            problems.append("SSEKMSKeyId needs ServerSideEncryption 'aws:kms' or 'aws:kms:dsse'")
        if self.BucketKeyEnabled is not None:
            if not isinstance(self.BucketKeyEnabled, bool):
                problems.append(f"BucketKeyEnabled must be true or false, got {self.BucketKeyEnabled!r}")
            elif sse != "aws:kms":
                problems.append("BucketKeyEnabled needs ServerSideEncryption 'aws:kms'")
        if self.StorageClass is not None and self.StorageClass not in STORAGE_CLASSES:
            archived = self.StorageClass in ("GLACIER", "DEEP_ARCHIVE")
            extra = " (objects there need a restore before a load)" if archived else ""
            problems.append(f"StorageClass must be one of {list(STORAGE_CLASSES)}, got {self.StorageClass!r}{extra}")
        if self.Tagging is not None:
            pairs = urllib.parse.parse_qsl(self.Tagging, keep_blank_values=True)
            if not isinstance(self.Tagging, str) or not pairs or any(not key for key, _ in pairs):
                problems.append(f"Tagging must be key=value pairs joined by '&' (or a mapping), got {self.Tagging!r}")
        owner = self.ExpectedBucketOwner
        if isinstance(owner, int) and not isinstance(owner, bool) and len(str(owner)) == 12:  # unquoted in YAML
            owner = str(owner)
            object.__setattr__(self, "ExpectedBucketOwner", owner)
        if owner is not None and not (isinstance(owner, str) and re.fullmatch(r"[0-9]{12}", owner)):
            problems.append(f"ExpectedBucketOwner must be a 12-digit AWS account id (quoted in YAML), got {owner!r}")
        if self.RequestPayer is not None and self.RequestPayer != "requester":
            problems.append(f"RequestPayer must be 'requester', got {self.RequestPayer!r}")
        for name in ("ServerSideEncryption", "SSEKMSKeyId", "StorageClass"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                problems.append(f"{name} must be a non-empty string, got {value!r}")
        if problems:
            raise ValueError("Invalid S3 request options: " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | S3RequestOptions | None) -> S3RequestOptions | None:
        """Options from a mapping of S3 parameter names (None or empty: None); ValueError naming any unknown key."""
        if options is None or isinstance(options, S3RequestOptions):
            return options
        if not isinstance(options, Mapping):
            raise TypeError(f"S3 request options must be a mapping or S3RequestOptions, got {type(options).__name__}")
        allowed = [f.name for f in fields(cls)]
        by_folded = {name.lower(): name for name in allowed}
        unknown = []
        for key in options:
            if key not in allowed:
                spelling = by_folded.get(str(key).replace("_", "").replace("-", "").lower())
                unknown.append(f"{key!r} (did you mean {spelling!r}?)" if spelling else repr(key))
        if unknown:
            raise ValueError(f"Unknown S3 request option(s) {', '.join(unknown)}; allowed: {allowed}")
        given = {key: value for key, value in options.items() if value is not None}
        return cls(**given) if given else None

    def parameters(self, operation_name: str, members: Collection[str]) -> dict[str, Any]:
        """The parameters to add to S3 operation `operation_name` (``"PutObject"``), whose input takes `members`."""
        chosen = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        if operation_name not in _UPLOAD_OPERATIONS:
            chosen = {k: v for k, v in chosen.items() if k in ("ExpectedBucketOwner", "RequestPayer")}
        return {k: v for k, v in chosen.items() if k in members}

    def add_to_request(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        """botocore ``before-parameter-build.s3`` handler: fill in the options a call did not set itself."""
        for name, value in self.parameters(model.name, model.input_shape.members if model.input_shape else ()).items():
            params.setdefault(name, value)


# --------------------------------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3ClientSettings:
    """Where and how to reach S3; unset fields fall back to botocore's sources. Credentials come from boto3's chain."""

    endpoint_url: str | None = None  # else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else AWS
    region_name: str | None = None
    addressing_style: str | None = None
    """``"path"`` (default for a custom endpoint; refuses virtual-only buckets if given), ``"virtual"``, ``"auto"``."""
    profile_name: str | None = None
    max_pool_connections: int = 32
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    user_agent_extra: str | None = None
    sign_payloads: bool = False
    """SHA-256-sign bodies over plain http too (off: every body carries a CRC the store verifies; signing is slow)."""
    request_options: S3RequestOptions | None = None  # added to the requests of this client
    max_requests_per_second: RequestRates | None = None  # a job-wide budget per prefix; None: adaptive pacing only

    path_style_by_default: bool = field(default=False, repr=False)  # "path" filled in by `resolved`

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_requests_per_second", RequestRates.from_value(self.max_requests_per_second))

    def resolved(self) -> S3ClientSettings:
        """The same settings with the endpoint and addressing style filled in from the environment."""
        endpoint = self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if self.addressing_style:
            return replace(self, endpoint_url=endpoint or None)
        style = "path" if endpoint else None
        return replace(
            self, endpoint_url=endpoint or None, addressing_style=style, path_style_by_default=bool(endpoint)
        )


_clients: dict[tuple[int, S3ClientSettings, tuple[tuple[str, str], ...]], Any] = {}
_clients_lock = threading.Lock()


def _proxy_environment() -> tuple[tuple[str, str], ...]:
    """The ``*_proxy`` variables botocore reads when it builds a client (``HTTP_PROXY``, ``NO_PROXY``, ...).

    A client keeps the proxies of the moment it was built, so a client built before the variables changed is not the
    client the same settings give now.
    """
    return tuple(sorted((name, value) for name, value in os.environ.items() if name.lower().endswith("_proxy")))


def get_s3_client(settings: S3ClientSettings | None = None) -> Any:
    """The process-wide boto3 S3 client for these settings and proxy variables (thread-safe), per process id (a
    fork builds its own)."""
    settings = (settings or S3ClientSettings()).resolved()
    key = (os.getpid(), settings, _proxy_environment())
    client = _clients.get(key)
    if client is not None:
        return client
    boto3_session = _process.import_optional_dependency("boto3.session", "S3 access")
    botocore_config = _process.import_optional_dependency("botocore.config", "S3 access")
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            s3_config: dict[str, Any] = {"payload_signing_enabled": settings.sign_payloads}
            if settings.addressing_style:
                s3_config["addressing_style"] = settings.addressing_style
            config = botocore_config.Config(
                max_pool_connections=settings.max_pool_connections,
                connect_timeout=settings.connect_timeout_s,
                read_timeout=settings.read_timeout_s,
                retries={"total_max_attempts": 1},  # RetryPolicy is the single retry layer
                s3=s3_config,
                user_agent_extra=user_agent(settings.user_agent_extra),
                request_checksum_calculation="when_required",  # this module sends and verifies checksums itself
                response_checksum_validation="when_required",
            )
            session = boto3_session.Session(profile_name=settings.profile_name)
            client = session.client(
                "s3", endpoint_url=settings.endpoint_url, region_name=settings.region_name, config=config
            )
            if settings.endpoint_url:
                client.meta.events.register("before-call.s3", _no_region_redirects)
            _add_request_options(client, settings.request_options)
            if settings.addressing_style == "path" and not settings.path_style_by_default:
                client.meta.events.register("before-parameter-build.s3", _refuse_virtual_only_buckets)
            _clients[key] = client
            logger.debug("Created S3 client (endpoint=%s, region=%s)", settings.endpoint_url, client.meta.region_name)
    return client


def _add_request_options(client: Any, options: S3RequestOptions | None) -> None:
    if options is not None:
        client.meta.events.register("before-parameter-build.s3", options.add_to_request)


def user_agent(extra: str | None = None) -> str:
    """What this package adds to botocore's User-Agent (``s3-checkpoint-io/<version>``, then `extra`)."""
    return f"s3-checkpoint-io/{__version__}" + (f" {extra}" if extra else "")


def _refuse_virtual_only_buckets(params: dict[str, Any], model: Any = None, **_: Any) -> None:
    """With ``addressing_style="path"`` asked for explicitly: refuse the buckets S3 serves virtual-hosted only."""
    bucket = params.get("Bucket")
    if not isinstance(bucket, str):
        return
    try:
        kind = _urls.bucket_kind(bucket, strict=False)
    except ValueError:
        return
    if kind in _VIRTUAL_HOSTED_ONLY:
        operation = getattr(model, "name", "S3 request")
        raise ValueError(
            f"{operation} on {_urls.build_s3_url(bucket, str(params.get('Key', '')), strict_bucket_names=False)}: "
            f"a {_VIRTUAL_HOSTED_ONLY[kind]} is only reachable with virtual-hosted-style requests, but "
            "S3ClientSettings(addressing_style='path') asks for path style. Leave addressing_style unset (path "
            "style is then still used for other buckets on a custom endpoint) or set it to 'virtual' or 'auto'."
        )


_VIRTUAL_HOSTED_ONLY = {
    "directory": "directory bucket (S3 Express One Zone)",
    "access_point_arn": "bucket given as an access point ARN",
    "outposts_access_point_arn": "bucket given as an S3 on Outposts access point ARN",
}


def _no_region_redirects(params: dict[str, Any], **_: Any) -> None:
    """No region redirects on a custom endpoint: botocore's HEAD bucket to find the region recurses without end."""
    redirect = params.get("context", {}).get("s3_redirect")
    if isinstance(redirect, dict):
        redirect["redirected"] = True


# --------------------------------------------------------------------------------------------------------------------
# Checksums: algorithms, combining part checksums, and the records a load is verified against
# --------------------------------------------------------------------------------------------------------------------


@functools.cache
def _awscrt_checksums() -> types.ModuleType | None:
    """awscrt's checksum module, or None: imported once per process, not per block."""
    return _process.optional_module("awscrt.checksums")


class ChecksumAlgorithm:
    """One of S3's full-object CRCs: compute, combine and spell it; get one with `ChecksumAlgorithm.named`.
    Package-internal (docs/api.md)."""

    def __init__(
        self, name: str, nbytes: int, polynomial: int, zlib_update: Callable[[Any, int], int] | None = None
    ) -> None:
        self.name = name  # S3's spelling, e.g. "CRC32C"
        self.nbytes = nbytes
        self.polynomial = polynomial  # reflected form, for the GF(2) fallback of `combine`
        self._update: Callable[[Any, int], int] | None = zlib_update  # CRC32 needs no awscrt; others resolve on use
        self._combine: Callable[[int, int, int], int] | None = None

    def __repr__(self) -> str:
        return f"<checksum {self.name}>"

    @classmethod
    def named(cls, name: str | None = "auto") -> ChecksumAlgorithm:
        """The algorithm `name` names (``"CRC32C"``...) or, for None/"auto", CRC32C with awscrt, else CRC32."""
        if name is None or name.lower() == "auto":
            return _CHECKSUMS["CRC32C"] if _awscrt_checksums() else _CHECKSUMS["CRC32"]
        try:
            algorithm = _CHECKSUMS[name.upper()]
        except KeyError:
            known = sorted(_CHECKSUMS)
            raise ValueError(f"Unknown checksum algorithm {name!r}; use one of {known} or 'auto'") from None
        if algorithm.name != "CRC32":
            _process.import_optional_dependency("awscrt.checksums", f"{algorithm.name} checksums")
        return algorithm

    @property
    def response_field(self) -> str:
        return f"Checksum{self.name}"

    def encode(self, value: int) -> str:
        """S3's spelling of a checksum: base64 of its big-endian bytes."""
        return base64.b64encode(value.to_bytes(self.nbytes, "big")).decode("ascii")

    def update(self, data: Any, previous: int) -> int:
        """The checksum of everything before `data` (whose checksum is `previous`) followed by `data`."""
        update = self._update
        if update is None:
            feature = f"{self.name} checksums"
            checksums = _awscrt_checksums() or _process.import_optional_dependency("awscrt.checksums", feature)
            update = self._update = getattr(checksums, self.name.lower())
        return update(data, previous)

    def combine(self, first: int, second: int, second_length: int) -> int:
        """The checksum of A + B from those of A and B, so parts can be checksummed in parallel."""
        combine = self._combine
        if combine is None:
            crt_combine = getattr(_awscrt_checksums(), f"combine_{self.name.lower()}", None)  # awscrt >= 0.31
            combine = self._combine = crt_combine or self.combine_gf2
        return combine(first, second, second_length)

    def combine_gf2(self, first: int, second: int, second_length: int) -> int:
        """`combine` without awscrt (or before 0.31): zlib's ``crc32_combine``, valid for these three CRCs."""
        return _gf2_times(_zeros_operator(self.polynomial, self.nbytes * 8, second_length), first) ^ second


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    result, row = 0, 0
    while vector:
        if vector & 1:
            result ^= matrix[row]
        vector >>= 1
        row += 1
    return result


def _gf2_compose(outer: tuple[int, ...], inner: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_gf2_times(outer, column) for column in inner)


@functools.lru_cache(maxsize=64)
def _zeros_operator(polynomial: int, width: int, length: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC register over `length` zero bytes (cached: parts share one size)."""
    operator = (polynomial, *(1 << n for n in range(width - 1)))  # one zero bit
    for _ in range(3):  # -> one zero byte
        operator = _gf2_compose(operator, operator)
    result = tuple(1 << n for n in range(width))  # identity
    while length:
        if length & 1:
            result = _gf2_compose(operator, result)
        length >>= 1
        if length:
            operator = _gf2_compose(operator, operator)
    return result


_CHECKSUMS = {
    "CRC32": ChecksumAlgorithm("CRC32", 4, 0xEDB88320, zlib.crc32),
    "CRC32C": ChecksumAlgorithm("CRC32C", 4, 0x82F63B78),
    "CRC64NVME": ChecksumAlgorithm("CRC64NVME", 8, 0x9A6C9329AC4BC9B5),
}


def validate_checksum_algorithm(name: str | None) -> str:
    """S3's name of the algorithm a save with `name` would use; raises as `ChecksumAlgorithm.named` (early) does."""
    return ChecksumAlgorithm.named(name).name


def checksum_of(algorithm: ChecksumAlgorithm | None, data: Any, block: int = 64 * MB) -> int:
    """Checksum of a buffer, in blocks (no temporary copy of a huge buffer); 0 without an algorithm."""
    if algorithm is None:
        return 0
    view = memoryview(data).cast("B")
    value = 0
    for start in range(0, len(view), block):
        value = algorithm.update(view[start : start + block], value)
    return value


def combine_checksums(algorithm: ChecksumAlgorithm, parts: Iterable[tuple[int, int]]) -> int:
    """The checksum of consecutive pieces from their ``(checksum, length)`` pairs, in order (0 for none).
    Package-internal (docs/api.md)."""
    total = 0
    for checksum, length in parts:
        total = algorithm.combine(total, checksum, length)
    return total


class ChecksumMismatchError(IOError):
    """The bytes read from S3 do not match the checksum recorded when the object was written."""


CHECKSUM_SOURCES = ("s3", "metadata", "sidecar")
"""Where a checksum is recorded: by the store, in the object's user metadata (single PUTs), or in a sidecar object."""
CHECKSUM_METADATA_KEY = "s3ckpt-checksum"  # user metadata of a single PUT: ``"<ALGORITHM> <value>"``


@dataclass(frozen=True)
class RecordedChecksum:
    """A full-object checksum recorded when an object was written, and where it is recorded."""

    algorithm: str  # S3's name of the algorithm: ``"CRC32C"``, ``"CRC64NVME"`` or ``"CRC32"``
    value: str  # the checksum as S3 spells it (base64 of the big-endian bytes)
    source: str  # one of `CHECKSUM_SOURCES` (a sidecar is bound to the object's size and ETag)

    def __str__(self) -> str:
        return f"{self.algorithm} {self.value} ({self.source})"


_MULTIPART_ETAG = re.compile(r'-\d+"?$')  # the ETag of a multipart object: "<md5 of the part md5s>-<part count>"
_CHECKSUM_ENTRY_FIELDS = {"algorithm": str, "checksum": str, "size": int, "etag": str}


def _is_checksum_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and all(isinstance(entry.get(k), t) for k, t in _CHECKSUM_ENTRY_FIELDS.items())


class _ChecksumRecords:
    """Reads, writes and checks the checksum records of objects through an `S3Utils` (a sidecar settles a dispute)."""

    def __init__(self, utils: S3Utils) -> None:
        self._utils = utils

    def expected(self, info: S3ObjectInfo) -> RecordedChecksum | None:
        """The record a download of `info` is verified against: the store's, else its metadata's, else the sidecar."""
        return self.native(info) or self.carried(info) or self.sidecar(info)

    @staticmethod
    def carried(info: S3ObjectInfo) -> RecordedChecksum | None:
        """The checksum the object's user metadata carries (`CHECKSUM_METADATA_KEY`), if any (and readable)."""
        algorithm, _, value = info.metadata.get(CHECKSUM_METADATA_KEY, "").partition(" ")
        if not value:
            return None
        try:
            return RecordedChecksum(ChecksumAlgorithm.named(algorithm).name, value, "metadata")
        except (ValueError, MissingOptionalDependencyError):
            return None

    @staticmethod
    def native(info: S3ObjectInfo) -> RecordedChecksum | None:
        """The store's full-object checksum in `info`, if any (not for a multipart object without ``ChecksumType``)."""
        if info.checksum_type not in (None, "FULL_OBJECT"):
            return None
        for algorithm in _CHECKSUMS.values():
            value = info.checksums.get(algorithm.response_field)
            if not value or "-" in value:  # "xxx-N" is a composite (per-part) checksum, not the object's
                continue
            if info.checksum_type is None and _MULTIPART_ETAG.search(info.etag):
                logger.debug(
                    "%s: the store's %s %s cannot be used: it comes without a ChecksumType for a multipart object "
                    "(ETag %s), so it may cover the part checksums rather than the bytes",
                    *(info.url, algorithm.name, value, info.etag),
                )
                return None
            with contextlib.suppress(MissingOptionalDependencyError):
                return RecordedChecksum(ChecksumAlgorithm.named(algorithm.name).name, value, "s3")
        return None

    def sidecar(self, info: S3ObjectInfo) -> RecordedChecksum | None:
        """The checksum recorded beside the object; ChecksumMismatchError if unusable or of an older object there."""
        entries = self.sidecar_entries(info)
        return entries[0] if entries else None

    def sidecar_entries(self, info: S3ObjectInfo) -> list[RecordedChecksum]:
        """The checksums the record beside the object may hold for it: the one bound to it, else unbound ones."""
        record = self._read_sidecar(info)
        if record is None:
            return []
        entries = [record, *(record.get("earlier") or [])] if isinstance(record.get("earlier", []), list) else []
        if not entries or not all(map(_is_checksum_entry, entries)):
            raise ChecksumMismatchError(
                f"The checksum record of {info.url} ({info.key}{CHECKSUM_SIDECAR_SUFFIX}) is malformed: "
                "refusing to load an unverified object; delete the record only if you trust the object"
            )
        bound = [e for e in entries if e["etag"] and e["etag"] == info.etag and e["size"] == info.size]
        unbound = [e for e in entries if not e["etag"] and e["size"] == info.size]
        if not bound and not unbound:
            raise ChecksumMismatchError(
                f"{info.url} was replaced after its checksum was recorded (size/ETag {info.size}/{info.etag}, "
                f"recorded {record['size']}/{record['etag'] or 'not yet committed'}): refusing to load an "
                "unverified object"
            )
        found = []
        for entry in bound[:1] or unbound:
            try:
                algorithm = ChecksumAlgorithm.named(entry["algorithm"])
            except ValueError as exc:
                problem = f"The checksum record of {info.url} names an unknown algorithm: {exc}"
                raise ChecksumMismatchError(problem) from exc
            found.append(RecordedChecksum(algorithm.name, entry["checksum"], "sidecar"))
        return found

    def check(
        self, info: S3ObjectInfo, target: DownloadedObject, expected: RecordedChecksum, actual: int
    ) -> RecordedChecksum:
        """The record the downloaded bytes (checksum `actual`) match, `expected` first; else ChecksumMismatchError."""
        algorithm = ChecksumAlgorithm.named(expected.algorithm)
        actual_text = algorithm.encode(actual)
        if actual_text == expected.value:
            return expected
        mismatch = f"its {expected.algorithm} is {actual_text}, but {expected.value} was recorded ({expected.source})"
        others = self.sidecar_entries(info)
        if expected.source == "s3":
            others = [c for c in [self.carried(info)] if c is not None] + others
        elif expected.source == "sidecar":
            others = others[1:]
        for other in others:
            other_algorithm = ChecksumAlgorithm.named(other.algorithm)
            if other_algorithm.name == algorithm.name:
                other_actual = actual_text
            else:
                with target.view() as view:
                    other_actual = other_algorithm.encode(checksum_of(other_algorithm, view))
            if other_actual == other.value:
                return other
            mismatch = f"its {other.algorithm} is {other_actual}, but {other.value} was recorded ({other.source})"
        raise ChecksumMismatchError(
            f"{info.url} is corrupt: {mismatch}. Do not use it; restore it from another copy or use an older one."
        )

    def write_sidecar(self, bucket: str, key: str, record: dict[str, Any]) -> None:
        """Record a checksum beside ``bucket/key``, for a store that did not keep it."""
        sidecar_key = key + CHECKSUM_SIDECAR_SUFFIX
        body = json.dumps(record, sort_keys=True).encode()
        url = _urls.build_s3_url(bucket, sidecar_key)
        self._utils.call("put_object", url, Bucket=bucket, Key=sidecar_key, Body=body)

    def write_pending(self, bucket: str, key: str, algorithm: str, checksum: str, size: int) -> bool:
        """Record the checksum about to be committed at ``bucket/key`` unbound, the current ones as ``"earlier"``;
        whether there was a record."""
        url = _urls.build_s3_url(bucket, key)
        earlier: list[Any] = []
        try:
            current = self._read_sidecar(S3ObjectInfo(bucket, key, size))
        except ChecksumMismatchError:  # a malformed record describes nothing: the new one replaces it
            logger.warning("%s: replacing its malformed checksum record", url)
            current = None
        if current is not None:
            previous = current.get("earlier")
            earlier = [{k: current.get(k) for k in _CHECKSUM_ENTRY_FIELDS}]
            if not current.get("etag") and isinstance(previous, list):
                earlier += previous  # the key holds one of these, or the unbound one: keep them all
            earlier = [entry for entry in earlier if _is_checksum_entry(entry)]
        record = {"algorithm": algorithm, "checksum": checksum, "size": size, "etag": "", "earlier": earlier[:8]}
        self.write_sidecar(bucket, key, record)
        return current is not None

    def remove_sidecar(self, bucket: str, key: str) -> None:
        """Delete the record beside ``bucket/key`` (missing is fine)."""
        sidecar_key = key + CHECKSUM_SIDECAR_SUFFIX
        self._utils.call("delete_object", _urls.build_s3_url(bucket, sidecar_key), Bucket=bucket, Key=sidecar_key)

    def _read_sidecar(self, info: S3ObjectInfo) -> dict[str, Any] | None:
        key = info.key + CHECKSUM_SIDECAR_SUFFIX
        url = _urls.build_s3_url(info.bucket, key)
        try:
            body = self._utils.call("get_object", url, Bucket=info.bucket, Key=key)["Body"]
        except FileNotFoundError:
            return None
        with body:
            raw = body.read()
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
            return record
        except ValueError as exc:  # includes undecodable bytes
            raise ChecksumMismatchError(
                f"The checksum record of {info.url} ({key}) is malformed: refusing to load an unverified object"
            ) from exc


# --------------------------------------------------------------------------------------------------------------------
# Object metadata and downloads
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3ObjectInfo:
    """One object as a listing or HEAD reports it."""

    bucket: str
    key: str
    size: int
    etag: str = ""
    last_modified: Any = None  # datetime.datetime
    checksums: dict[str, str] = field(default_factory=dict)
    checksum_type: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)  # user metadata from a HEAD (none from listings)

    @property
    def url(self) -> str:
        return _object_url(self.bucket, self.key)

    @classmethod
    def of_response(cls, bucket: str, key: str, response: dict[str, Any]) -> S3ObjectInfo:
        """The object a HEAD or a whole-object GET (``ChecksumMode="ENABLED"``) answered about: the same headers."""
        checksums = {name: value for name, value in response.items() if name.startswith("Checksum")}
        checksums.pop("ChecksumType", None)
        return cls(bucket, key, response["ContentLength"], response.get("ETag", ""), response.get("LastModified"),
                   checksums, response.get("ChecksumType"), dict(response.get("Metadata") or {}))


@dataclass(frozen=True)
class MultipartUploadInfo:
    """One in-progress multipart upload: its parts are stored, and billed, but there is no object until it completes."""

    bucket: str
    key: str
    upload_id: str
    initiated: Any = None  # datetime.datetime, by the store's clock
    parts: int | None = None  # how many parts it holds, and their bytes: None until counted (`count_upload_parts`)
    size: int | None = None

    @property
    def url(self) -> str:
        return _object_url(self.bucket, self.key)


def _object_url(bucket: str, key: str) -> str:
    """The URL of a listed object, keeping its key exactly (even one starting with ``/``)."""
    return f"{_urls.S3_PATH_PREFIX}{bucket}/{key}"


_HAS_PWRITE = hasattr(os, "pwrite")


class DownloadedObject:
    """An object in an anonymous in-memory file (``memfd``) whose `path` ``torch.load(path, mmap=True)`` can map."""

    def __init__(self, size: int, fd: int | None = None) -> None:
        """`fd`: an open, writable file to download into instead (resized to `size`; `close` leaves it open)."""
        self.size = size
        self._owns_fd = fd is None
        if fd is not None:
            self._fd, self.path = fd, f"/proc/self/fd/{fd}"
        elif hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
            self._fd = os.memfd_create("s3-checkpoint", getattr(os, "MFD_CLOEXEC", 0))
            self.path = f"/proc/self/fd/{self._fd}"
        else:  # pragma: no cover - non-Linux fallback
            self._fd, self.path = tempfile.mkstemp(prefix="s3-checkpoint-")
        os.ftruncate(self._fd, size)
        self._map: mmap.mmap | None = None
        self._write_lock = threading.Lock()
        self.verified_against: RecordedChecksum | None = None
        """Set by `S3Utils.download_to_memory`: the record the bytes matched (None: nothing recorded or verified)."""

    def write_at(self, offset: int, data: Any) -> None:
        """Store `data` at `offset` (disjoint ranges from several threads) with ``pwrite`` (no page faults), in turns
        (the kernel serialises writes anyway; a waiting writer would spin: benchmarks/README.md, "Loads")."""
        view = memoryview(data).cast("B")
        with self._write_lock:
            while view:
                if _HAS_PWRITE:
                    written = os.pwrite(self._fd, view, offset)
                else:  # pragma: no cover - Windows has no pwrite
                    os.lseek(self._fd, offset, os.SEEK_SET)
                    written = os.write(self._fd, view)
                view, offset = view[written:], offset + written

    def _mapping(self) -> mmap.mmap:
        if self._map is None:
            self._map = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ)
        return self._map

    @contextlib.contextmanager
    def view(self) -> Iterator[Any]:
        """A read-only, zero-copy view of the whole content, valid inside the ``with`` block."""
        if not self.size:
            yield b""
            return
        view = memoryview(self._mapping())
        try:
            yield view
        finally:
            view.release()

    def read_all(self) -> bytes:
        return self._mapping()[:] if self.size else b""

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still referenced (e.g. by a traceback): GC unmaps it
                self._map.close()
            self._map = None
        if self._fd >= 0 and self._owns_fd:
            os.close(self._fd)
            if not self.path.startswith("/proc/"):  # pragma: no cover - non-Linux fallback
                os.unlink(self.path)
            self._fd = -1

    def __enter__(self) -> DownloadedObject:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------------------------
# Errors: S3's answers as the exceptions Python code expects, annotated with the URL and what to do
# --------------------------------------------------------------------------------------------------------------------


class SharedLoadError(RuntimeError):
    """The rank that downloads a shared checkpoint for this rank (``s3_node_sharing.download_shared``) failed, died
    or took too long; the message names the URL and the cause. Also ``s3_checkpoint_io.SharedLoadError``."""


def _annotate(
    exc: BaseException, operation: str, url: str, options: S3RequestOptions | None = None, tried: str = ""
) -> None:
    """Note on `exc` (re-raised unchanged) the URL, what S3 said (status, request and host id) and what to do."""
    code = _pacing.error_code(exc)
    if code in {"AccessDenied", "403", "Forbidden"}:
        hint = "check the credentials and that their policy allows this action on this bucket and key"
        if options is not None and options.ExpectedBucketOwner:
            hint += f", and that account {options.ExpectedBucketOwner} (ExpectedBucketOwner) owns the bucket"
    elif code in {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "NoCredentialsError"}:
        hint = "check the AWS credentials (environment, profile or role) used by this process"
    elif code == "400":  # a HEAD has no error body: expired credentials and a wrong region both look like this
        hint = "the request was refused (400): check the AWS credentials (expired?) and the region of the bucket"
    elif code in {"AuthorizationHeaderMalformed", "PermanentRedirect", "IllegalLocationConstraintException", "301"}:
        hint = "the bucket may be in another region: set the region (AWS_REGION or region_name)"
    else:
        hint = ""
    if tried:
        hint = f"gave up after {tried}, the last answer {code}" + (f"; {hint}" if hint else "")
    if not any(url in note for note in getattr(exc, "__notes__", [])):
        exc.add_note(f"while running S3 {operation} on {url}{response_ids(exc)}" + (f": {hint}" if hint else ""))


def is_precondition_failed(exc: BaseException, conditions: Mapping[str, str]) -> bool:
    """Whether `exc` is the store refusing a write's `conditions`: 412, or 404 for If-Match on a key that is gone.
    Package-internal (docs/api.md)."""
    response = getattr(exc, "response", None)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") if isinstance(response, dict) else None
    if _pacing.error_code(exc) in ("PreconditionFailed", "412") or status == 412:
        return True
    return "IfMatch" in conditions and isinstance(exc, FileNotFoundError)


def response_ids(exc: BaseException) -> str:
    """`` (HTTP 403, request id ..., host id ...)`` from a botocore error's response, or empty.
    Package-internal (docs/api.md)."""
    response = getattr(exc, "response", None)
    metadata = response.get("ResponseMetadata", {}) if isinstance(response, dict) else {}
    headers = metadata.get("HTTPHeaders", {})
    labelled = [
        ("HTTP", metadata.get("HTTPStatusCode")),
        ("request id", metadata.get("RequestId") or headers.get("x-amz-request-id")),
        ("host id", metadata.get("HostId") or headers.get("x-amz-id-2")),
    ]
    parts = [f"{label} {value}" for label, value in labelled if value]
    return f" ({', '.join(parts)})" if parts else ""


# --------------------------------------------------------------------------------------------------------------------
# S3Utils
# --------------------------------------------------------------------------------------------------------------------


class _RemovalRefusedError(OSError):
    """A key's error in a DeleteObjects answer, as the exception a fence is handed (`Fence.precondition_failed`)."""

    def __init__(self, code: str, message: str, url: str) -> None:
        super().__init__(f"S3 answered {code} to the conditional removal of {url}: {message}")
        self.response = {"Error": {"Code": code, "Message": message}}


_CONDITIONAL_REMOVAL_ATTEMPTS = 5  # sends of a removal that a concurrent request (409) or a changed object (412) fails


class Fence(Protocol):
    """What the writer and the removals ask of a checkpoint directory's owner (the ``fence=`` of
    `S3Utils.open_writer`, `remove_object`, `remove_objects_with_prefix`): s3_fencing's `DirectoryFence` is one."""

    def before_mutation(self, url: str, action: str) -> None:
        """Before a ``"save"`` or ``"removal"`` of `url`: raise if this run may not, with nothing changed."""

    def conditions(self, key: str) -> dict[str, str]:
        """The ETag condition a commit of `key` carries (``IfMatch`` / ``IfNoneMatch``), or none."""

    def sent(self, url: str, action: str, request: Callable[[], _T]) -> _T:
        """`request()`, a commit or removal (`action`) of `url` that the last `before_mutation` allowed, sent so that
        a store which honours it refuses it once stale (signed to expire after that check; checked again if so)."""

    def precondition_failed(self, url: str, key: str, exc: BaseException, action: str = "save") -> dict[str, str]:
        """A commit's or a removal's (`action`) condition failed (`exc`): raise if another run owns the directory,
        else the retry's conditions (``IfMatch`` on what is there now; ``IfNoneMatch``: nothing is)."""

    def conditional_removals(self) -> bool:
        """Whether removals carry the ETag they checked (the store honours conditional deletes; else one warning)."""

    def committed_etag(self, key: str) -> str | None:
        """The ETag this run last committed at `key`, if it knows one."""

    def metadata(self) -> dict[str, str]:
        """User metadata every commit carries (the run that wrote it)."""

    def committed(self, key: str, etag: str) -> None:
        """`key` was committed with `etag`."""

    def removed(self, keys: Iterable[str]) -> None:
        """`keys` are about to be removed."""


def _refuse_overridden(caller: str, winner: str, overridden: list[str]) -> None:
    if overridden:
        raise ValueError(
            f"{caller}: {', '.join(overridden)} would be ignored because {winner} is given; "
            f"configure them in {winner} instead (or pass only the separate arguments)"
        )


class _ClassOrInstanceMethod:
    """A method NeMo code may call on the class (``S3Utils.remove_object(url)``): then on a default instance."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.__func__ = function
        functools.update_wrapper(self, function)

    def __get__(self, instance: Any, owner: type) -> Callable[..., Any]:
        return types.MethodType(self.__func__, instance if instance is not None else owner())


class S3Utils:
    """S3 operations for checkpoints, with retries, ``/``-bounded directory semantics and verified transfers.

    NeMo's static calls (``S3Utils.s3_path_exists(url)``) still work, with default settings; an instance chooses
    them: ``S3Utils(S3ClientSettings(endpoint_url=...), retry_policy=RetryPolicy(max_attempts=5))``.
    """

    def __init__(
        self, settings: S3ClientSettings | None = None, retry_policy: RetryPolicy | None = None, *, client: Any = None,
        list_page_size: int = 1000,
    ) -> None:
        if retry_policy is not None and not isinstance(retry_policy, RetryPolicy):
            raise TypeError(f"retry_policy must be an s3_utils.RetryPolicy, got {type(retry_policy).__name__}")
        if not isinstance(list_page_size, int) or not 1 <= list_page_size <= 1000:
            raise ValueError(f"list_page_size must be an int from 1 to 1000 (S3's page limit), got {list_page_size!r}")
        self.settings = (settings or S3ClientSettings()).resolved()
        self.retry_policy = retry_policy or RetryPolicy()
        self._client = client
        self._stats_lock = threading.Lock()
        self.retries = 0  # how many times a call was retried by this instance
        self.list_page_size = list_page_size  # keys (or uploads, or parts) asked for per listing request

    @classmethod
    def from_arguments(
        cls, *, s3_utils: S3Utils | None = None, client_settings: S3ClientSettings | None = None,
        endpoint_url: str | None = None, region_name: str | None = None, retry_policy: RetryPolicy | None = None,
        request_options: S3RequestOptions | Mapping[str, Any] | None = None,
        max_requests_per_second: float | Mapping[str, float] | RequestRates | None = None,
        max_pool_connections: int | None = None, user_agent_extra: str | None = None,
        caller: str = "S3Utils.from_arguments",
    ) -> S3Utils:
        """The one way this package builds an `S3Utils` from a caller's loose arguments: `s3_utils` as given, else
        `client_settings`, else settings from `endpoint_url` and `region_name`, plus the options, budget, pool size and
        user agent. ValueError (naming `caller`) for every argument another given one would silently override.
        """
        options = S3RequestOptions.from_mapping(request_options)  # an unknown or bad option fails here
        budget = RequestRates.from_value(max_requests_per_second)  # a bad value fails here
        given = {
            "endpoint_url": endpoint_url, "region_name": region_name, "client_settings": client_settings,
            "retry_policy": retry_policy, "request_options": options, "max_requests_per_second": budget,
        }
        if s3_utils is not None:
            _refuse_overridden(caller, "s3_utils", [name for name, value in given.items() if value is not None])
            return s3_utils
        if client_settings is not None:
            overridden = [name for name in ("endpoint_url", "region_name") if given[name] is not None]
            if options is not None and client_settings.request_options is not None:
                overridden.append("request_options")
            if budget is not None and client_settings.max_requests_per_second is not None:
                overridden.append("max_requests_per_second")
            _refuse_overridden(caller, "client_settings", overridden)
            settings = client_settings
        else:
            settings = S3ClientSettings(endpoint_url=endpoint_url, region_name=region_name)
            if max_pool_connections is not None:
                settings = replace(settings, max_pool_connections=max(32, max_pool_connections + 4))
        if user_agent_extra:
            settings = replace(
                settings, user_agent_extra=" ".join(p for p in (settings.user_agent_extra, user_agent_extra) if p)
            )
        if options is not None:
            settings = replace(settings, request_options=options)
        if budget is not None:
            settings = replace(settings, max_requests_per_second=budget)
        return cls(settings, retry_policy)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its settings and retry policy: the copy builds its own client."""
        return (type(self), (self.settings, self.retry_policy))

    # ---- plumbing -------------------------------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = get_s3_client(self.settings)
        return self._client

    def call(self, operation: str, url: str, **kwargs: Any) -> Any:
        """Call the client operation `operation` (e.g. ``"head_object"``) with retries; `url` is for messages."""
        return self.with_retries(
            lambda: getattr(self.client, operation)(**kwargs), operation, url, bucket=kwargs.get("Bucket")
        )

    def with_retries(
        self, attempt: Callable[[], _T], operation: str, url: str, *, bucket: str | None = None, detail: str = ""
    ) -> _T:
        """Run `attempt` (one request to `bucket`, by default `url`'s) through the request pacer and under the retry
        policy; the final failure is the original exception, annotated with the URL (and `detail`, e.g. "part 3").
        Throttling answers use up no attempts: they fail only after ``max_elapsed_s`` without a success.
        """
        policy = self.retry_policy
        pacer = self.pacer(url, bucket)
        url = f"{url} ({detail})" if detail else url
        if self.settings.max_requests_per_second is not None:
            pacer.limit(self.settings.max_requests_per_second)
        lane = pacer.lane(operation)
        started = time.monotonic()
        retries = _pacing.CallRetries(policy, started)
        while True:
            sent = lane.acquire(policy.max_backoff_s)
            try:
                result = attempt()
            except Exception as exc:
                now = time.monotonic()
                throttled = is_throttling_error(exc)
                if throttled:
                    lane.on_throttle(sent, now)
                if not _pacing.is_retriable_error(exc):
                    self._raise_final(exc, operation, url, retries.attempts + 1, now - started)
                delay = retries.after_failure(sent, now, throttled, lane.last_success)
                if delay is None:
                    self._raise_final(exc, operation, url, retries.attempts, now - started)
                with self._stats_lock:
                    self.retries += 1
                how = "throttled" if throttled else f"{retries.counted} of {policy.max_attempts} counted"
                (logger.debug if throttled else logger.warning)(
                    "S3 %s on %s failed with %s (attempt %d, %s); retrying%s", operation, url, _pacing.error_code(exc),
                    retries.attempts, how,
                    f" in {delay:.2f} s" if delay else " when the pacer allows",
                )
                if delay:
                    time.sleep(delay)
                continue
            lane.on_success(sent, time.monotonic())
            return result

    def _raise_final(self, exc: Exception, operation: str, url: str, attempts: int, seconds: float) -> NoReturn:
        """Raise a failed call's error: FileNotFoundError for a missing key or bucket, else `exc`, annotated."""
        code = _pacing.error_code(exc)
        if code in {"NoSuchKey", "404", "NotFound", "NoSuchBucket"}:
            what = "bucket" if code == "NoSuchBucket" else "object"
            raise FileNotFoundError(f"No such {what}: {url} (S3 {operation} answered {code})") from exc
        if exc.args and isinstance(exc.args[0], str) and " (reached max retries: " in exc.args[0]:
            exc.args = (re.sub(r" \(reached max retries: \d+\)", "", exc.args[0]), *exc.args[1:])
        tried = f"{attempts} attempts over {seconds:.1f} s" if attempts > 1 else ""
        _annotate(exc, operation, url, self.settings.request_options, tried)
        raise exc

    def pacer(self, s3_path: str | os.PathLike[str], bucket: str | None = None) -> RequestPacer:
        """The `RequestPacer` (shared by the process) this instance's requests to `s3_path` (in `bucket`, by default
        its own) go through: its bucket's, or its spread directory's (`_urls.spread_prefix`), which S3 serves apart."""
        try:
            own, key = _urls.parse_s3_url(s3_path)
        except ValueError:  # a request with its bucket and a text naming it (or a URL no bucket rule takes)
            if bucket is None:
                raise
            own, key = bucket, ""
        return request_pacer(self.settings.endpoint_url, bucket or own, _urls.spread_prefix(key))

    @property
    def _checksum_records(self) -> _ChecksumRecords:
        return _ChecksumRecords(self)

    # ---- NeMo-compatible URL helpers ------------------------------------------------------------------------------
    @staticmethod
    def parse_s3_url(s3_url: str | os.PathLike[str]) -> tuple[str, str]:
        """``(bucket, key)``; raises ValueError for anything that is not an S3 URL (NeMo returned (None, None))."""
        return _urls.parse_s3_url(s3_url)

    @staticmethod
    def build_s3_url(bucket: str, key: str) -> str:
        return _urls.build_s3_url(bucket, key)

    @staticmethod
    def is_s3_url(path: str | os.PathLike[str] | None) -> bool:
        return _urls.is_s3_url(path)

    @staticmethod
    def parse_prefix_with_step(path: str) -> str:
        """The part of `path` up to and including the last ``step=<digits>-``, else `path` (NeMo's rule)."""
        match = re.search(r"(.*step=\d+-)", path)
        return match.group(1) if match else path

    # ---- metadata and listing -------------------------------------------------------------------------------------
    @_ClassOrInstanceMethod
    def head_object(self, s3_path: str | os.PathLike[str]) -> S3ObjectInfo:
        """Size, ETag, modification time and stored checksums of one object; FileNotFoundError if there is none."""
        url = _urls.normalize_s3_url(s3_path)
        bucket, key = _urls.parse_s3_url(url)
        if not key or key.endswith("/"):
            raise IsADirectoryError(f"{url} names a directory (or bucket), not an object; give the object's key")
        response = self.call("head_object", url, Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        return S3ObjectInfo.of_response(bucket, key, response)

    @_ClassOrInstanceMethod
    def list_objects(self, s3_path: str | os.PathLike[str], *, include_sidecars: bool = False) -> list[S3ObjectInfo]:
        """Every object under the "directory" `s3_path`, sorted by key, without this package's records by default."""
        url = _urls.normalize_s3_url(s3_path)
        bucket, prefix = _urls.s3_dir_prefix(url)
        return sorted(self._iter_objects(bucket, prefix, url, include_sidecars), key=lambda info: info.key)

    @_ClassOrInstanceMethod
    def list_objects_with_key_prefix(self, s3_path: str | os.PathLike[str]) -> list[S3ObjectInfo]:
        """Every object whose key starts with that of `s3_path` (``s3://b/ckpt/model--step=10-``), sorted by key."""
        url = _urls.normalize_s3_url(s3_path)
        bucket, key = _urls.parse_s3_url(url)
        directory = key[: key.rfind("/") + 1]  # "" when the key has no "/": the bucket root
        matches = (info for info in self._iter_objects(bucket, directory, url, False) if info.key.startswith(key))
        return sorted(matches, key=lambda info: info.key)

    def _iter_objects(
        self, bucket: str, prefix: str, url: str, include_sidecars: bool, page_size: int | None = None
    ) -> Iterator[S3ObjectInfo]:
        """The objects (only ``Contents``) under `prefix` (``""`` or ending in ``/``) in listing order, page by page."""
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"listing prefix {prefix!r} for {url} must be empty or end in '/' (directory buckets)")
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": page_size or self.list_page_size}
            if token:
                kwargs["ContinuationToken"] = token
            page = self.call("list_objects_v2", url, **kwargs)
            for item in page.get("Contents", []):
                if include_sidecars or not _is_package_record(item["Key"]):
                    yield S3ObjectInfo(
                        bucket, item["Key"], item["Size"], item.get("ETag", ""), item.get("LastModified")
                    )
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    @_ClassOrInstanceMethod
    def s3_path_exists(self, s3_path: str | os.PathLike[str], match_directory: bool = False) -> bool:
        """True if an object exists at exactly `s3_path`, or (`match_directory`) any object under ``s3_path/`` (for the
        bucket root: the bucket); False for a missing bucket, other errors propagate."""
        url = _urls.normalize_s3_url(s3_path)
        bucket, key = _urls.parse_s3_url(url)
        try:
            if key and not key.endswith("/"):
                try:
                    self.head_object(url)
                    return True
                except FileNotFoundError:
                    if not match_directory:
                        return False
            elif not match_directory:
                self.call("head_bucket", url, Bucket=bucket)
                return True
            _, prefix = _urls.s3_dir_prefix(url)
            listed = self._iter_objects(bucket, prefix, url, include_sidecars=True, page_size=2)
            return any(info.key.rpartition("/")[2] != OWNER_RECORD_NAME for info in listed)
        except FileNotFoundError:
            return False

    @_ClassOrInstanceMethod
    def find_files_with_suffix(
        self, base_path: str | os.PathLike[str], suffix: str | None = None, return_key_only: bool = True,
        profile: str | None = None, creds: Any = None,
    ) -> list[str]:
        """Keys (or URLs) under ``base_path/`` ending in `suffix`; `profile` / `creds` as in NeMo select credentials."""
        utils = self if profile is None and creds is None else self._with_credentials(profile, creds)
        objects = utils.list_objects(base_path)
        keys = [obj.key for obj in objects if not suffix or obj.key.endswith(suffix)]
        if return_key_only:
            return keys
        bucket = _urls.parse_s3_url(_urls.normalize_s3_url(base_path))[0]
        return [_object_url(bucket, key) for key in keys]

    def _with_credentials(self, profile: str | None, creds: Any) -> S3Utils:
        if profile is not None and creds is not None:
            raise ValueError("Pass either profile or creds, not both")
        if profile is not None:
            return S3Utils(replace(self.settings, profile_name=profile), self.retry_policy)
        boto3_session = _process.import_optional_dependency("boto3.session", "S3 access")
        session = boto3_session.Session(
            aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
            aws_session_token=creds.get("SessionToken"),
        )
        client = session.client(
            "s3", endpoint_url=self.settings.endpoint_url, region_name=self.settings.region_name,
            config=get_s3_client(self.settings).meta.config,
        )
        _add_request_options(client, self.settings.request_options)
        return S3Utils(self.settings, self.retry_policy, client=client)

    # ---- removal --------------------------------------------------------------------------------------------------
    @_ClassOrInstanceMethod
    def remove_object(self, s3_path: str | os.PathLike[str], *, fence: Fence | None = None) -> None:
        """Delete one object and its checksum record (missing is fine); with a `fence`, only while its run owns it."""
        url = _urls.normalize_s3_url(s3_path)
        bucket, key = _urls.parse_s3_url(url)
        if not key:
            raise IsADirectoryError(f"{url} is a bucket, not an object; use remove_objects_with_prefix")
        self._delete_keys(bucket, [key, key + CHECKSUM_SIDECAR_SUFFIX], url, fence)

    @_ClassOrInstanceMethod
    def remove_objects_with_prefix(
        self, s3_path: str | os.PathLike[str], *, fence: Fence | None = None
    ) -> int:
        """Delete the object at `s3_path` and all under ``s3_path/``; how many. `fence` as in `remove_object`."""
        url = _urls.normalize_s3_url(s3_path)
        bucket, key = _urls.parse_s3_url(url)
        listed = {obj.key: obj.etag for obj in self.list_objects(url, include_sidecars=True)}
        keys = list(listed)
        if key and not key.endswith("/"):
            keys += [key, key + CHECKSUM_SIDECAR_SUFFIX]
        self._delete_keys(bucket, keys, url, fence, {k: etag for k, etag in listed.items() if etag})
        return len(keys)

    @_ClassOrInstanceMethod
    def remove_objects(self, s3_paths: Iterable[str | os.PathLike[str]]) -> int:
        """Delete these objects and their checksum records (missing is fine); returns how many keys were deleted."""
        keys: dict[str, dict[str, None]] = {}  # bucket -> keys in order, without repeats
        for path in s3_paths:
            url = _urls.normalize_s3_url(path)
            bucket, key = _urls.parse_s3_url(url)
            if not key or key.endswith("/"):
                raise IsADirectoryError(f"{url} names a directory (or bucket); use remove_objects_with_prefix")
            named = keys.setdefault(bucket, {})
            named[key] = None
            if not key.endswith(CHECKSUM_SIDECAR_SUFFIX):
                named[key + CHECKSUM_SIDECAR_SUFFIX] = None
        for bucket, named in keys.items():
            self._delete_keys(bucket, list(named), _urls.build_s3_url(bucket))
        return sum(map(len, keys.values()))

    def remove_listed(self, objects: Iterable[S3ObjectInfo], *, fence: Fence | None = None) -> int:
        """Delete these listed objects and their checksum records, each object conditioned on its listed ETag where
        the store honours conditional deletes (one replaced since it was listed is kept); `fence` as in
        `remove_object`. Returns how many keys were sent."""
        keys: dict[str, dict[str, str]] = {}  # bucket -> key -> listed ETag ("" for a checksum record)
        for info in objects:
            named = keys.setdefault(info.bucket, {})
            named[info.key] = info.etag
            if not info.key.endswith(("/", CHECKSUM_SIDECAR_SUFFIX)):
                named.setdefault(info.key + CHECKSUM_SIDECAR_SUFFIX, "")
        for bucket, named in keys.items():
            etags = {key: etag for key, etag in named.items() if etag}
            folder = next(iter(named)).rpartition("/")[0]  # where a probe of conditional deletes may write
            self._delete_keys(bucket, list(named), _urls.build_s3_url(bucket, folder), fence, etags)
        return sum(map(len, keys.values()))

    def _delete_keys(
        self, bucket: str, keys: list[str], url: str, fence: Fence | None = None, etags: Mapping[str, str] | None = None
    ) -> None:
        """Delete `keys`. Where the store honours conditional deletes, a fenced removal sends each key's ETag as read
        before the fence's check (`etags` from a listing, the run's own commit, else a HEAD; a key that is gone is
        skipped), so an object a newer run wrote after that check is refused by the store (412), and the fence then
        reads the owner record again; an unfenced removal sends the `etags` it was given (what was listed), and an
        object replaced since is kept. 409 (a concurrent request) is retried with backoff."""
        if fence is not None:
            conditional = bool(keys) and fence.conditional_removals()
        else:
            prefix = _urls.s3_dir_prefix(url)[1]
            conditional = bool(etags) and bool(store_capabilities(self, bucket, ("conditional_delete",), prefix)
                                              .conditional_delete)
        known: dict[str, str] = dict(etags or {}) if conditional else {}
        if conditional and fence is not None:
            known = self._etags_before_the_check(bucket, keys, known, fence)
            keys = [k for k in keys if k in known or k.endswith("/")]  # gone: nothing to remove
        if fence is not None and keys:
            fence.before_mutation(url, "removal")
            fence.removed(keys)  # before the request: a half-done removal must not leave stale ETags behind
        policy = self.retry_policy
        for attempt in range(1, _CONDITIONAL_REMOVAL_ATTEMPTS + 1):
            retry = []
            for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                batch = functools.partial(self._delete_batch, bucket, keys[start : start + 1000], url, fence, known)
                retry += fence.sent(url, "removal", batch) if fence is not None else batch()
            if not retry:
                return
            keys = retry
            if attempt < _CONDITIONAL_REMOVAL_ATTEMPTS:
                time.sleep(random.uniform(0, min(policy.max_backoff_s, policy.initial_backoff_s * 2**attempt)))
        raise OSError(
            f"Could not delete {len(keys)} object(s) under {url}: the store answered 409 ConditionalRequestConflict "
            f"{_CONDITIONAL_REMOVAL_ATTEMPTS} times (another request on them each time); try again"
        )

    def _etags_before_the_check(
        self, bucket: str, keys: list[str], known: dict[str, str], fence: Fence
    ) -> dict[str, str]:
        """Each key's ETag to condition its removal on, read before the fence's check; absent: no object there."""
        for key in keys:
            if key.endswith("/"):  # a folder (marker): SeaweedFS answers a HEAD of a folder with children and a 409 to
                continue  # its conditional delete; it is removed unconditionally, as before conditional removals
            etag = known.get(key) or fence.committed_etag(key)
            if not etag:
                try:
                    etag = self.call("head_object", _object_url(bucket, key), Bucket=bucket, Key=key).get("ETag")
                except FileNotFoundError:
                    etag = None
            if etag:
                known[key] = etag
        return known

    def _delete_batch(
        self, bucket: str, keys: list[str], url: str, fence: Fence | None, known: dict[str, str]
    ) -> list[str]:
        """One DeleteObjects of `keys` (conditioned on `known` ETags); the keys to send again."""
        objects = [{"Key": k, "ETag": known[k]} if k in known else {"Key": k} for k in keys]
        response = self.call("delete_objects", url, Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
        retry, errors = [], []
        for error in response.get("Errors", []):
            key, code = error.get("Key", ""), error.get("Code")
            if code == "NoSuchKey":
                continue
            if code in ("ConditionalRequestConflict", "409"):
                retry.append(key)
            elif code in ("PreconditionFailed", "412") and fence is not None:
                refused = _RemovalRefusedError(code, error.get("Message", ""), _object_url(bucket, key))
                conditions = fence.precondition_failed(_object_url(bucket, key), key, refused, "removal")
                if "IfMatch" in conditions:  # still this run's directory: remove what is there now
                    known[key] = conditions["IfMatch"]
                    retry.append(key)
            elif code in ("PreconditionFailed", "412"):
                logger.warning("%s changed since it was listed: kept", _object_url(bucket, key))
            else:
                errors.append(error)
        if errors:
            first = errors[0]
            raise OSError(
                f"Could not delete {len(errors)} object(s) under {url}: first "
                f"{_urls.build_s3_url(bucket, first.get('Key', ''))}: {first.get('Code')} {first.get('Message')}"
            )
        return retry

    # ---- in-progress multipart uploads -----------------------------------------------------------------------------
    @_ClassOrInstanceMethod
    def list_multipart_uploads(self, s3_path: str | os.PathLike[str]) -> list[MultipartUploadInfo]:
        """The in-progress multipart uploads under the "directory" `s3_path`, sorted by key then initiation."""
        url = _urls.normalize_s3_url(s3_path)
        bucket, prefix = _urls.s3_dir_prefix(url)
        uploads = []
        markers: dict[str, str] = {}
        while True:
            page = self.call(
                "list_multipart_uploads", url, Bucket=bucket, Prefix=prefix, MaxUploads=self.list_page_size, **markers
            )
            uploads += [
                MultipartUploadInfo(bucket, item["Key"], item["UploadId"], item.get("Initiated"))
                for item in page.get("Uploads", [])
            ]
            if not page.get("IsTruncated"):
                break
            # Whichever markers the store gives: AWS both, directory buckets the key marker, SeaweedFS the upload id's.
            following = {
                name: page[f"Next{name}"] for name in ("KeyMarker", "UploadIdMarker") if page.get(f"Next{name}")
            }
            if not following or following == markers:
                raise OSError(
                    f"Listing the multipart uploads under {url}: the store says there are more but gives "
                    "no new marker to continue from"
                )
            markers = following
        return sorted(uploads, key=lambda upload: (upload.key, str(upload.initiated), upload.upload_id))

    @_ClassOrInstanceMethod
    def count_upload_parts(
        self, uploads: Iterable[MultipartUploadInfo], max_concurrency: int = 16
    ) -> list[MultipartUploadInfo]:
        """`uploads` with `parts` and `size` filled in from ListParts, in order; uploads gone meanwhile are left out."""
        uploads = list(uploads)
        if not uploads:
            return []
        with _thread_pool(min(max_concurrency, len(uploads)), "list-parts") as pool:
            counted = _results_or_first_error([pool.submit(self._count_parts, upload) for upload in uploads])
        return [upload for upload in counted if upload is not None]

    def _count_parts(self, upload: MultipartUploadInfo) -> MultipartUploadInfo | None:
        parts = size = 0
        marker: dict[str, Any] = {}
        while True:
            try:
                page = self.call(
                    "list_parts", upload.url, Bucket=upload.bucket, Key=upload.key, UploadId=upload.upload_id,
                    MaxParts=self.list_page_size, **marker,
                )
            except Exception as exc:
                if _pacing.error_code(exc) == "NoSuchUpload":
                    return None
                raise
            parts += len(page.get("Parts", []))
            size += sum(part.get("Size", 0) for part in page.get("Parts", []))
            if not page.get("IsTruncated"):
                return replace(upload, parts=parts, size=size)
            marker = {"PartNumberMarker": page["NextPartNumberMarker"]}

    @_ClassOrInstanceMethod
    def abort_multipart_upload(self, s3_path: str | os.PathLike[str], upload_id: str) -> bool:
        """Abort the multipart upload `upload_id` to `s3_path` (its parts are deleted); False if it no longer exists."""
        url = _urls.normalize_s3_url(s3_path)
        bucket, key = _urls.parse_s3_url(url)
        try:
            self.call("abort_multipart_upload", url, Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as exc:
            if _pacing.error_code(exc) == "NoSuchUpload":
                return False
            raise
        return True

    @_ClassOrInstanceMethod
    def store_time(self, s3_path: str | os.PathLike[str]) -> datetime.datetime:
        """The store's clock (a HEAD's ``Date``, else this machine's), so a skewed local clock cannot age an upload."""
        url = _urls.normalize_s3_url(s3_path)
        bucket, _ = _urls.parse_s3_url(url)
        response = self.call("head_bucket", url, Bucket=bucket)
        date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        with contextlib.suppress(TypeError, ValueError):
            if date:
                return email.utils.parsedate_to_datetime(date)
        return datetime.datetime.now(datetime.timezone.utc)

    # ---- streaming upload -----------------------------------------------------------------------------------------
    @_ClassOrInstanceMethod
    def open_writer(
        self, s3_path: str | os.PathLike[str], chunk_size_MB: float = DEFAULT_CHUNK_SIZE_MB,
        max_concurrency: int = DEFAULT_MAX_WRITE_CONCURRENCY, checksum_algorithm: str | None = "auto", *,
        fence: Fence | None = None,
    ) -> S3MultipartWriter:
        """A write-only binary stream that uploads to `s3_path` as it is written (`S3MultipartWriter`)."""
        return S3MultipartWriter(self, s3_path, int(chunk_size_MB * MB), max_concurrency, checksum_algorithm, fence)

    @_ClassOrInstanceMethod
    def upload_file_stream_to_s3(
        self, bytes_buffer: BinaryIO, s3_path: str | os.PathLike[str], chunk_size_MB: float = DEFAULT_CHUNK_SIZE_MB,
        max_concurrency: int = DEFAULT_MAX_WRITE_CONCURRENCY,
    ) -> None:
        """Upload a binary stream, from its start if it is seekable (as NeMo did); never truncated by a retry."""
        self._upload_stream(bytes_buffer, s3_path, chunk_size_MB, max_concurrency)

    @_ClassOrInstanceMethod
    def upload_file(
        self, file_path: str | os.PathLike[str], s3_path: str | os.PathLike[str],
        chunk_size_MB: float = DEFAULT_CHUNK_SIZE_MB, max_concurrency: int = DEFAULT_MAX_WRITE_CONCURRENCY,
        remove_file: bool = False, *, progress: Callable[[int], None] | None = None,
    ) -> S3ObjectInfo:
        """Upload a local file and return what was written (`progress` gets each block's size); `remove_file` after."""
        started = time.monotonic()
        with open(file_path, "rb") as stream:
            info = self._upload_stream(stream, s3_path, chunk_size_MB, max_concurrency, progress)
        logger.info(
            "Uploaded %s (%.3f GB) to %s in %.2f s", file_path, info.size / GB, info.url, time.monotonic() - started
        )
        if remove_file:
            os.remove(file_path)
        return info

    def _upload_stream(
        self, stream: IO[bytes], s3_path: str | os.PathLike[str], chunk_size_MB: float, max_concurrency: int,
        progress: Callable[[int], None] | None = None,
    ) -> S3ObjectInfo:
        chunk = int(chunk_size_MB * MB)
        with self.open_writer(s3_path, chunk_size_MB, max_concurrency) as writer:
            if stream.seekable():
                stream.seek(0)
            while True:
                data = stream.read(chunk)
                if not data:
                    break
                writer.write(data)
                if progress is not None:
                    progress(len(data))
        assert writer.info is not None  # set by a successful close
        return writer.info

    # ---- download -------------------------------------------------------------------------------------------------
    @_ClassOrInstanceMethod
    def download_to_memory(
        self, s3_path: str | os.PathLike[str], chunk_size_MB: float = DEFAULT_CHUNK_SIZE_MB,
        max_concurrency: int = DEFAULT_MAX_READ_CONCURRENCY, *, verify: bool = True,
        progress: Callable[[int], None] | None = None, into_fd: int | None = None,
    ) -> DownloadedObject:
        """Download with parallel ranged GETs (``If-Match`` on the ETag) into a `DownloadedObject` (`into_fd`: into
        this file) and verify the recorded checksum (ChecksumMismatchError). `progress` gets each range's byte count.
        """
        url = _urls.normalize_s3_url(s3_path)
        info = self.head_object(url)
        records = self._checksum_records
        expected = records.expected(info) if verify else None
        target = DownloadedObject(info.size, fd=into_fd)
        try:
            part_size = max(int(chunk_size_MB * MB), MIN_PART_SIZE)
            algorithm = ChecksumAlgorithm.named(expected.algorithm) if expected else None
            actual = _RangedDownload(self, info, target, algorithm, progress).run(part_size, max_concurrency)
            if expected is not None:
                assert actual is not None
                target.verified_against = records.check(info, target, expected, actual)
            elif verify:
                logger.warning("%s has no recorded checksum (written by another tool?); checked its size only", url)
        except BaseException:
            target.close()
            raise
        return target

    @_ClassOrInstanceMethod
    def recorded_checksum(self, info: S3ObjectInfo) -> RecordedChecksum | None:
        """The checksum a download of `info` is verified against: the store's, its metadata's, or the sidecar's."""
        return self._checksum_records.expected(info)

    @_ClassOrInstanceMethod
    def read_range_into(
        self, s3_path: str | os.PathLike[str], start: int, target: Any, *, etag: str | None = None
    ) -> int:
        """Read bytes ``[start, start + len(target))`` of an object into the buffer `target` (or a list of them, in
        order: a scatter read); return how many arrived. With `etag`, a replaced object fails. Nothing is verified.
        """
        url = _urls.normalize_s3_url(s3_path)
        bucket, key = _urls.parse_s3_url(url)
        views = [memoryview(buffer).cast("B") for buffer in (target if isinstance(target, list) else [target])]
        views = [view for view in views if len(view)]
        total = sum(len(view) for view in views)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start} (reading {url})")
        if not total:
            return 0
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{start + total - 1}"}
        if etag:
            kwargs["IfMatch"] = etag

        def attempt() -> int:
            try:
                response = self.client.get_object(**kwargs)
            except Exception as exc:
                if _pacing.error_code(exc) == "InvalidRange":  # the range starts at or past the end of the object
                    return 0
                raise
            body = response["Body"]
            expected = int(response.get("ContentLength", total))
            content_range = response.get("ContentRange") or ""
            if not content_range.startswith(f"bytes {start}-") and (start or expected > total):
                body.close()
                raise OSError(
                    f"Asked {url} for bytes from {start}, the store answered {content_range or 'the whole object'}: "
                    "it ignores Range requests; use another store or download the object whole"
                )
            try:
                filled = _read_body_into(body, _first_bytes(views, expected))
            finally:
                body.close()
            if filled != expected:
                raise _pacing.TransientTransferError(f"got {filled} of {expected} bytes of {url} from offset {start}")
            return filled

        return self.with_retries(attempt, "get_object", url, bucket=bucket)

    @_ClassOrInstanceMethod
    def read_ranges_into(
        self, s3_path: str | os.PathLike[str], ranges: Iterable[tuple[int, Any]], *, etag: str | None = None,
        max_concurrency: int = DEFAULT_MAX_READ_CONCURRENCY,
    ) -> list[int]:
        """`read_range_into` for ``(start, target)`` pairs, `max_concurrency` at a time; the first failure raises."""
        ranges = list(ranges)
        if len(ranges) <= 1:
            return [self.read_range_into(s3_path, start, target, etag=etag) for start, target in ranges]
        with _thread_pool(min(max_concurrency, len(ranges)), "get") as pool:
            futures = [pool.submit(self.read_range_into, s3_path, s, t, etag=etag) for s, t in ranges]
            return _results_or_first_error(futures)

    @_ClassOrInstanceMethod
    def download_s3_file_to_stream(
        self, s3_path: str | os.PathLike[str], chunk_size_MB: float = DEFAULT_CHUNK_SIZE_MB,
        max_concurrency: int = DEFAULT_MAX_READ_CONCURRENCY,
    ) -> io.BytesIO:
        """The verified content of `s3_path` in a BytesIO positioned at 0 (NeMo's signature)."""
        with self.download_to_memory(s3_path, chunk_size_MB, max_concurrency) as downloaded:
            return io.BytesIO(downloaded.read_all())

    @_ClassOrInstanceMethod
    def download_s3_file_to_path(
        self, s3_path: str | os.PathLike[str], file_path: str | os.PathLike[str],
        chunk_size_MB: float = DEFAULT_CHUNK_SIZE_MB, max_concurrency: int = DEFAULT_MAX_READ_CONCURRENCY, *,
        progress: Callable[[int], None] | None = None,
    ) -> RecordedChecksum | None:
        """Download and verify `s3_path` into `file_path` (appearing once complete); the record the bytes matched."""
        directory = os.path.dirname(os.path.abspath(file_path))
        with self.download_to_memory(s3_path, chunk_size_MB, max_concurrency, progress=progress) as downloaded:
            fd, partial = tempfile.mkstemp(dir=directory, prefix=".s3ckpt-partial-")
            try:
                with os.fdopen(fd, "wb") as out, downloaded.view() as view:
                    for start in range(0, downloaded.size, 64 * MB):
                        out.write(view[start : start + 64 * MB])
                os.replace(partial, file_path)
            except BaseException:
                if os.path.exists(partial):
                    os.unlink(partial)
                raise
            return downloaded.verified_against


# --------------------------------------------------------------------------------------------------------------------
# The ranged reader: parallel ranged GETs, copied from the socket into a download
# --------------------------------------------------------------------------------------------------------------------


def _thread_pool(workers: int, name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix=f"s3ckpt-{name}")


def _results_or_first_error(futures: list[Future[_T]]) -> list[_T]:
    done, pending = wait(futures, return_when=FIRST_EXCEPTION)
    for future in pending:
        future.cancel()
    for future in done:
        future.result()
    return [future.result() for future in futures]


class _RangedDownload:
    """One object fetched into a `DownloadedObject` by parallel ranged GETs, each checksummed on its way in."""

    def __init__(
        self, utils: S3Utils, info: S3ObjectInfo, target: DownloadedObject, algorithm: ChecksumAlgorithm | None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.utils = utils
        self.info = info
        self.target = target
        self.algorithm = algorithm
        self.progress = progress

    def run(self, part_size: int, workers: int) -> int | None:
        """Fetch every range, up to `workers` at a time; the whole object's checksum (None without an algorithm)."""
        size = self.info.size
        ranges = [(start, min(start + part_size, size)) for start in range(0, size, part_size)]
        if len(ranges) <= 1:
            checksums = [self._download_range(start, end, whole=True) for start, end in ranges]
        else:
            with _thread_pool(min(workers, len(ranges)), "get") as pool:
                futures = [pool.submit(self._download_range, start, end, False) for start, end in ranges]
                checksums = _results_or_first_error(futures)
        if self.algorithm is None:
            return None
        pieces = [(crc, end - start) for (start, end), crc in zip(ranges, checksums, strict=True)]
        return combine_checksums(self.algorithm, pieces)

    def _download_range(self, start: int, end: int, whole: bool) -> int:
        """GET bytes ``[start, end)`` (without a Range header if `whole`) into the target; the range's checksum."""
        info = self.info
        kwargs: dict[str, Any] = {"Bucket": info.bucket, "Key": info.key}
        if info.etag:
            kwargs["IfMatch"] = info.etag
        if not whole:
            kwargs["Range"] = f"bytes={start}-{end - 1}"

        def attempt() -> int:
            body = self.utils.client.get_object(**kwargs)["Body"]
            try:
                filled, checksum = _copy_body(body, self.target, start, end - start, self.algorithm)
            finally:
                body.close()
            if filled != end - start:
                raise _pacing.TransientTransferError(f"got {filled} of {end - start} bytes of {info.url}")
            return checksum

        checksum = self.utils.with_retries(attempt, "get_object", info.url, bucket=info.bucket)
        if self.progress is not None:
            self.progress(end - start)  # after success only, so retried bytes are not counted twice
        return checksum


_STAGING_BYTES = 1 * MB  # per-thread buffer bodies pass through: fits the CPU cache, few trips

_staging = threading.local()


def _socket_reader(body: Any) -> tuple[Callable[[Any], int], Callable[[], None]]:
    """``(readinto, finish)`` for a response body: from the http.client response underneath (no urllib3 copy)."""
    raw = getattr(body, "_raw_stream", None)
    socket_response = getattr(raw, "_fp", None)
    direct = isinstance(socket_response, http.client.HTTPResponse) and hasattr(raw, "release_conn")
    if not direct:
        return body.readinto, lambda: None

    def finish() -> None:
        if socket_response.isclosed():  # read to its end: the connection can serve the next request
            raw.release_conn()

    return socket_response.readinto, finish


def _copy_body(
    body: Any, target: DownloadedObject, offset: int, length: int, algorithm: ChecksumAlgorithm | None
) -> tuple[int, int]:
    """Copy up to `length` bytes of a response body into `target` at `offset`; how many came, and their checksum."""
    read_into, finish = _socket_reader(body)
    staging = getattr(_staging, "buffer", None)
    if staging is None:
        staging = _staging.buffer = memoryview(bytearray(_STAGING_BYTES))
    filled = checksum = 0
    while filled < length:
        count = read_into(staging[: min(len(staging), length - filled)])
        if not count:
            break
        chunk = staging[:count]
        if algorithm is not None:
            checksum = algorithm.update(chunk, checksum)
        target.write_at(offset + filled, chunk)
        filled += count
    finish()
    return filled, checksum


def _first_bytes(views: list[memoryview], count: int) -> list[memoryview]:
    """The views, cut to hold the first `count` bytes (those wholly past them left out)."""
    starts = itertools.accumulate((len(view) for view in views), initial=0)
    return [view[: count - start] for view, start in zip(views, starts, strict=False) if start < count]


def _read_body_into(body: Any, views: list[memoryview]) -> int:
    """Read a response body into `views` in order until they are full or the body ends; return the byte count."""
    read_into, finish = _socket_reader(body)
    filled = 0
    for view in views:
        done = 0
        while done < len(view):
            count = read_into(view[done:])
            if not count:
                finish()
                return filled + done
            done += count
        filled += done
    finish()
    return filled


# --------------------------------------------------------------------------------------------------------------------
# Fast paths and their reference paths (one switch for all)
# --------------------------------------------------------------------------------------------------------------------

REFERENCE_PATHS_ENV = "S3CKPT_REFERENCE_PATHS"  # `FAST_PATHS` names (or ``all``) to take their reference path

FAST_PATHS = (
    "borrowed_parts", "framing_reuse", "direct_reads", "scatter_reads", "window_reads", "span_reads", "one_get_records"
)
"""The fast paths behind the switch (docs/internals.md); one gaining under 5% in benchmarks/realistic.md goes."""


def fast_path(name: str) -> bool:
    """Whether the fast path `name` (one of `FAST_PATHS`) is on: it is unless `REFERENCE_PATHS_ENV` names it.
    Package-internal (docs/api.md)."""
    if name not in FAST_PATHS:
        raise ValueError(f"unknown fast path {name!r}; known: {', '.join(FAST_PATHS)}")
    chosen = os.environ.get(REFERENCE_PATHS_ENV, "")
    if not chosen:
        return True
    names = {part.strip() for part in chosen.split(",")}
    return name not in names and "all" not in names


# --------------------------------------------------------------------------------------------------------------------
# Streaming multipart writer
# --------------------------------------------------------------------------------------------------------------------


_CONDITIONAL_COMMIT_ATTEMPTS = 5  # sends of a commit whose ETag condition fails while its run owns the directory
_LEND_MIN = 1 * MB  # `S3MultipartWriter.write_borrowed` lends at least this many bytes to a part, or copies them
_PartBuffer = bytearray | mmap.mmap  # a part buffer: `_new_part_buffer`


def _copy_into(target: _PartBuffer, offset: int, source: memoryview) -> None:
    """The one place a write's bytes are copied into a part buffer (a GIL-free copy gained nothing measurable)."""
    memoryview(target)[offset : offset + len(source)] = source


def _new_part_buffer(size: int) -> _PartBuffer:
    """`size` bytes the kernel maps in page by page as they are first written, private to the process (a fork's copy
    is copied on write); a ``bytearray`` is zeroed whole, 16 MiB a part, where a lent part writes only its framing."""
    if hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    return bytearray(size)


class _PartBuffers:
    """Part buffers shared by the process's writers, kept between saves; never more than writers held at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[_PartBuffer] = []

    def take(self, size: int) -> _PartBuffer:
        with self._lock:
            for index in range(len(self._free) - 1, -1, -1):
                if len(self._free[index]) == size:
                    return self._free.pop(index)
            self._free.clear()  # none of this size: the others would only add to the memory held
        return _new_part_buffer(size)

    def give_back(self, buffers: Iterable[_PartBuffer]) -> None:
        with self._lock:
            self._free.extend(buffers)

    def release(self) -> None:
        with self._lock:
            self._free.clear()


_part_buffers = _PartBuffers()


def release_part_buffers() -> None:
    """Free the part buffers kept for the next save (at most what this process's writers held at once)."""
    _part_buffers.release()


_SEND_BLOCK = 1 << 62
"""The smallest block `_BufferReader.read` hands the HTTP client: a part goes out in one ``sendall`` (no GIL)."""


class SeekableReader(io.RawIOBase):
    """A seekable read-only stream of `length` bytes, for ``zipfile``, ``torch.load`` or an HTTP client: the position
    bookkeeping (``readable``, ``seekable``, ``seek``, ``tell``, ``readinto``) of every such stream of the package; a
    subclass says where the bytes come from (`fill_at`). Package-internal (docs/api.md)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length
        self._position = 0

    def fill_at(self, out: memoryview, start: int) -> None:
        """Copy the bytes from `start` on into `out` (never past `length`)."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def tell(self) -> int:
        return self._position

    def readinto(self, target: Any) -> int:
        out = memoryview(target).cast("B")
        count = max(0, min(len(out), self.length - self._position))
        if count:
            self.fill_at(out[:count], self._position)
            self._position += count
        return count


class _BufferReader(SeekableReader):
    """A stream over a buffer or a part body's segments whose ``read`` hands out views (botocore would copy
    ``bytes`` bodies)."""

    def __init__(self, buffer: memoryview | list[memoryview], min_block: int = 0) -> None:
        self._segments = buffer if isinstance(buffer, list) else [buffer]
        self._starts = list(itertools.accumulate((len(segment) for segment in self._segments[:-1]), initial=0))
        super().__init__(sum(len(segment) for segment in self._segments))
        self._min_block = min_block

    def _block(self, start: int, size: int) -> memoryview:
        """The bytes from `start` on, at most `size`, within one segment."""
        if start >= self.length or size <= 0:
            return memoryview(b"")
        index = bisect.bisect_right(self._starts, start) - 1
        offset = start - self._starts[index]
        return self._segments[index][offset : offset + size]

    def read(self, size: int | None = -1) -> memoryview:  # type: ignore[override]
        """The next `size` bytes (at least `min_block`) as a view of the buffer, not a copy."""
        if size is not None and 0 <= size < self._min_block:
            size = self._min_block
        block = self._block(self._position, self.length if size is None or size < 0 else size)
        self._position += len(block)
        return block

    def fill_at(self, out: memoryview, start: int) -> None:
        done = 0
        while done < len(out):
            block = self._block(start + done, len(out) - done)
            out[done : done + len(block)] = block
            done += len(block)


@dataclass(frozen=True)
class _UploadedPart:
    number: int
    etag: str
    checksum: int
    length: int
    pieces: tuple[tuple[int, int], ...]  # (checksum, length) of the part's pieces between marked boundaries


def _piece_checksums(
    algorithm: ChecksumAlgorithm, data: memoryview | list[memoryview], cuts: Iterable[int]
) -> list[tuple[int, int]]:
    """``(checksum, length)`` of the pieces of `data` (a buffer, or segments) between the ascending offsets `cuts`."""
    segments = data if isinstance(data, list) else [data]
    pieces, start, index, base = [], 0, 0, 0  # segments[index] starts at offset `base`
    for end in [*cuts, sum(len(segment) for segment in segments)]:
        if end <= start:
            continue
        checksum, position = 0, start
        while position < end:
            while base + len(segments[index]) <= position:
                base += len(segments[index])
                index += 1
            segment = segments[index]
            stop = min(end, base + len(segment))
            checksum = algorithm.combine(
                checksum, checksum_of(algorithm, segment[position - base : stop - base]), stop - position
            )
            position = stop
        pieces.append((checksum, end - start))
        start = end
    return pieces


def _spliced(part: memoryview, lent: list[tuple[int, memoryview, object]]) -> memoryview | list[memoryview]:
    """A part body: the part buffer with the lent pieces (``(offset, view, owner)``, in order) in their places."""
    if not lent:
        return part
    segments, position = [], 0
    for offset, view, _ in lent:
        if offset > position:
            segments.append(part[position:offset])
        segments.append(view)
        position = offset + len(view)
    if position < len(part):
        segments.append(part[position:])
    return segments


class _WriterState(enum.Enum):
    """Where a writer is in its life. Only OPEN accepts writes; COMMITTED (visible) and ABORTED (nothing) are final."""

    OPEN = "open"
    COMPLETING = "completing"  # close() is uploading the last part and completing the object
    COMMITTED = "committed"
    ABORTED = "aborted"


# Crash safety: a checksum record never lags its object. A single PUT carries its checksum in its metadata. For a
# multipart upload to a store not known to keep the checksum sent with the commit, the writer records it *before*
# the commit, unbound (`_ChecksumRecords.write_pending`), then binds it to the committed ETag: a kill between any two
# requests leaves the previous object verifiable by its kept entry, or the new one by the unbound entry of its size.

def _keeps_checksums(utils: S3Utils, bucket: str, kind: str, keeps: bool | None = None) -> bool:
    """Whether the last commit of this kind to this bucket came back with the store's checksum (`keeps`: remember);
    kept in the store's `StoreCapabilities`."""
    record = store_capabilities(utils, bucket)
    with _capabilities_lock:
        if keeps is not None:
            record.checksums_kept[kind] = keeps
        return record.checksums_kept.get(kind, False)


class S3MultipartWriter(io.RawIOBase):
    """A binary stream whose bytes go to one S3 object while they are written (``torch.save(obj, writer)``).

    Parts are uploaded by up to `max_concurrency` threads while the caller writes, from at most ``max_concurrency +
    1`` buffers (a single PUT under one part). The full-object checksum goes with the commit (or to a sidecar). The
    object appears only when `close()` completes it; on any failure the upload is aborted. With a `fence`, the commit
    is sent only while its run owns the directory, with the fence's ETag condition.
    """

    parts_per_size = 1000  # parts of one size before the part size doubles

    def __init__(
        self, utils: S3Utils, s3_path: str | os.PathLike[str], part_size: int, max_concurrency: int,
        checksum_algorithm: str | None = "auto", fence: Fence | None = None,
    ) -> None:
        super().__init__()
        self._state = _WriterState.ABORTED  # until validated: an invalid writer has nothing to abort at GC
        check_transfer_sizes(part_size / MB, max_concurrency=max_concurrency)
        self.url = _urls.normalize_s3_url(s3_path)
        self.bucket, self.key = _urls.parse_s3_url(self.url)
        if not self.key or self.key.endswith("/"):
            raise IsADirectoryError(f"Cannot write an object at {self.url}: the URL names a directory, not a key")
        room = 1024 - len(CHECKSUM_SIDECAR_SUFFIX)
        if len(self.key.encode("utf-8")) > room:
            raise ValueError(
                f"Key too long for {self.url}: at most {room} bytes (S3's 1024 less room for the checksum record)"
            )
        self._utils, self._records, self._fence = utils, _ChecksumRecords(utils), fence
        self._part_size, self._max_concurrency = part_size, max_concurrency
        self._algorithm = ChecksumAlgorithm.named(checksum_algorithm)
        self._size = 0
        self._free_buffers: queue.SimpleQueue[_PartBuffer] = queue.SimpleQueue()
        self._buffers_made = 0  # buffers this writer holds (taken from `_part_buffers`)
        self._unfinished_parts = 0  # queued or in flight; `write_borrowed` keeps it at most max_concurrency + 1
        self._part_settled = threading.Condition()
        self._cuts: list[int] = []  # marked boundaries inside the part being filled (offsets into it)
        self._pieces: list[tuple[int, int, int]] = []  # (offset, length, checksum) tiling the object, once complete
        self._buffer: _PartBuffer | None = None  # the part being filled, up to `_filled`
        self._filled = 0
        self._lent: list[tuple[int, memoryview, object]] = []  # (offset, view, owner) lent into that part
        self._upload_id: str | None = None  # set while a multipart upload is open on S3
        self._native_checksums = True
        self._parts: list[Future[_UploadedPart]] = []
        self._failed_part: Future[_UploadedPart] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._commit_kind = ""  # "put" or "multipart" (-unchecked where the store refused its checksum), at commit
        self._wrote_pending = False
        self._state = _WriterState.OPEN
        self.info: S3ObjectInfo | None = None  # set by `close()`: the committed object's size, ETag and checksum
        self.error: BaseException | None = None  # what a `write` raised (``torch.save`` replaces it with its own)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.url} {self._state.value}, {self._size} bytes written, "
            f"{len(self._parts)} part(s) of {self._part_size // MB} MiB>"
        )

    @property
    def state(self) -> str:
        """``"open"``, ``"completing"``, ``"committed"`` or ``"aborted"``."""
        return self._state.value

    # ---- io.RawIOBase ---------------------------------------------------------------------------------------------
    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        """Bytes written so far (the stream's position: it only appends)."""
        return self._size

    def write(self, data: Any) -> int:
        if self._state is not _WriterState.OPEN:
            raise ValueError(f"write to a closed S3 writer ({self.url}, {self._state.value})")
        try:
            return self._write(data)
        except BaseException as exc:
            self.error = exc  # callers such as torch.save may replace it with an error of their own
            raise

    def _write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            if self._buffer is None:
                self._buffer, self._filled = self._take_buffer(), 0
            count = min(len(view), len(self._buffer) - self._filled)
            _copy_into(self._buffer, self._filled, view[:count])
            self._filled += count
            view = view[count:]
            if self._filled == len(self._buffer):
                self._send_part(self._buffer, self._filled)
                self._buffer = None
        self._size += total
        return total

    def write_borrowed(self, data: Any, owner: object) -> int:
        """`write` for bytes the caller leaves unchanged (and `owner` alive) until the writer completes or aborts: whole
        parts go straight from them, the rest is lent to its parts (copied under `_LEND_MIN`). ``borrowed_parts``."""
        if self._state is not _WriterState.OPEN:
            raise ValueError(f"write to a closed S3 writer ({self.url}, {self._state.value})")
        try:
            view = memoryview(data)
            if not view.c_contiguous or not fast_path("borrowed_parts"):
                return self._write(view)
            view = view.cast("B")
            total = len(view)
            while view:
                size = self.part_size_of(len(self._parts) + 1)
                if self._buffer is None and len(view) >= size:
                    self._send_borrowed_part(view[:size], owner)
                    view = view[size:]
                elif len(view) < _LEND_MIN:
                    self._write(view)
                    break
                else:  # lent to the part being filled, up to its end
                    if self._buffer is None:
                        self._buffer, self._filled = self._take_buffer(), 0
                    count = min(len(self._buffer) - self._filled, len(view))
                    self._lent.append((self._filled, view[:count], owner))
                    self._filled += count
                    self._size += count
                    view = view[count:]
                    if self._filled == len(self._buffer):
                        self._send_part(self._buffer, self._filled)
                        self._buffer = None
            return total
        except BaseException as exc:
            self.error = exc
            raise

    def close(self) -> None:
        """Upload what is left and complete the object; on failure abort the upload and re-raise."""
        self._finish(commit=True)

    def mark_checksum_boundary(self) -> None:
        """Split the checksums at the current offset: after `close()`, `checksum_of` can start or end a span here."""
        if self._buffer is not None and 0 < self._filled < len(self._buffer):
            if not self._cuts or self._cuts[-1] != self._filled:
                self._cuts.append(self._filled)

    def checksum_of(self, start: int, end: int) -> int:
        """The checksum of bytes ``[start, end)`` of the committed object; both must be boundaries (parts, marks)."""
        if self._state is not _WriterState.COMMITTED:
            raise ValueError(f"checksum_of needs a committed writer ({self.url} is {self._state.value})")
        pieces = self._pieces  # a DCP save asks once per item: a search, not a list of offsets per call
        first = bisect.bisect_left(pieces, start, key=lambda piece: piece[0])
        if start != end and (first == len(pieces) or pieces[first][0] != start):
            raise ValueError(f"{self.url}: offset {start} is not a checksum boundary")
        total, position = 0, start
        for offset, length, checksum in itertools.islice(pieces, first, None):
            if offset >= end:
                break
            total = self._algorithm.combine(total, checksum, length)
            position = offset + length
        if position != end and start != end:
            raise ValueError(f"{self.url}: offset {end} is not a checksum boundary")
        return total

    def abort(self) -> None:
        """Give up: stop uploading, abort the multipart upload. Nothing becomes visible at the URL."""
        self._finish(commit=False)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._finish(commit=exc_type is None)

    def __del__(self) -> None:
        # Never commit (as IOBase.__del__ would): an abandoned writer holds a prefix of what was meant, and committing
        # it would replace a good checkpoint with a truncated one. Abort, so no multipart upload is left behind.
        if getattr(self, "_state", None) is _WriterState.OPEN:
            self._finish(commit=False)

    # ---- commit or abort ------------------------------------------------------------------------------------------
    def _finish(self, commit: bool) -> None:
        """The one place that ends a writer: complete the object (`commit`; aborting if that fails) or abort."""
        if self._state is not _WriterState.OPEN:
            return
        try:
            if commit:
                self._state = _WriterState.COMPLETING
                try:
                    self._complete()
                except BaseException:
                    self._abort_upload()
                    raise
                self._state = _WriterState.COMMITTED
            else:
                self._abort_upload()
        finally:
            if self._buffer is not None:  # the part being filled (or a small object's whole body) was never sent
                self._free_buffers.put(self._buffer)
                self._buffer = None
            self._lent = []
            self._return_buffers()
            super().close()

    def _return_buffers(self) -> None:
        """Give the buffers back to the process's free list (no upload can touch them after `_finish`)."""
        returned = []
        while True:
            try:
                returned.append(self._free_buffers.get_nowait())
            except queue.Empty:
                break
        _part_buffers.give_back(returned)  # a buffer an upload cancelled before it started dropped is freed
        self._buffers_made = 0

    def _abort_upload(self) -> None:
        self._state = _WriterState.ABORTED
        for future in self._parts:
            future.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            try:
                self._utils.call(
                    "abort_multipart_upload", self.url, Bucket=self.bucket, Key=self.key, UploadId=upload_id
                )
                logger.info("Aborted the multipart upload to %s", self.url)
            except Exception:
                logger.exception("Could not abort the multipart upload %s to %s", upload_id, self.url)

    # ---- parts ----------------------------------------------------------------------------------------------------
    def part_size_of(self, number: int) -> int:
        """Size of part `number` (1-based): doubled every `parts_per_size` parts, so 10,000 parts reach S3's 5 TiB."""
        return self._part_size << min((number - 1) // self.parts_per_size, 20)

    def _take_buffer(self) -> _PartBuffer:
        """A buffer for the next part: a free one, a new one (up to max_concurrency + 1), else the next given back."""
        size = self.part_size_of(len(self._parts) + 1)
        while True:
            try:
                buffer = self._free_buffers.get_nowait()
            except queue.Empty:
                if self._buffers_made <= self._max_concurrency:
                    buffer = _part_buffers.take(size)
                    self._buffers_made += 1
                    return buffer
                buffer = self._free_buffers.get()  # every upload gives its buffer back, failed or not
            if len(buffer) == size:
                return buffer
            self._buffers_made -= 1
            _part_buffers.give_back([buffer])

    def _start_multipart(self) -> None:
        if self._fence is not None:
            self._warn_without_conditional_completes()
        checksum_args = {"ChecksumAlgorithm": self._algorithm.name, "ChecksumType": "FULL_OBJECT"}
        metadata = {"Metadata": self._run_metadata()} if self._fence is not None else {}
        try:
            response = self._utils.call(
                "create_multipart_upload", self.url, Bucket=self.bucket, Key=self.key, **checksum_args, **metadata
            )
        except Exception as exc:
            if _pacing.error_code(exc) not in {"InvalidArgument", "InvalidRequest", "NotImplemented"}:
                raise
            url, code = self.url, _pacing.error_code(exc)
            logger.info("%s: the store rejects full-object checksums (%s); recording them beside the object", url, code)
            self._native_checksums = False
            response = self._utils.call(
                "create_multipart_upload", self.url, Bucket=self.bucket, Key=self.key, **metadata
            )
        self._upload_id = response["UploadId"]
        self._pool = _thread_pool(self._max_concurrency, "put")

    def _run_metadata(self) -> dict[str, str]:
        """The fence's metadata (the run that commits this object; `s3_fencing.stale_objects` reads it)."""
        return dict(self._fence.metadata()) if self._fence is not None else {}

    def _send_part(self, buffer: _PartBuffer | memoryview, length: int, owner: object = None) -> None:
        """Queue one part: a part buffer (the upload gives it back), or a borrowed view kept alive by `owner`."""
        self._raise_failed_part()
        if self._upload_id is None:
            self._start_multipart()
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise ValueError(f"{self.url}: more than {MAX_PARTS} parts, past S3's object size limit")
        assert self._pool is not None
        cuts, self._cuts = tuple(cut for cut in self._cuts if cut < length), []
        lent, self._lent = self._lent, []
        with self._part_settled:
            self._unfinished_parts += 1
        future = self._pool.submit(self._upload_part, number, buffer, length, cuts, owner, lent)
        future.add_done_callback(self._part_done)
        self._parts.append(future)

    def _send_borrowed_part(self, view: memoryview, owner: object) -> None:
        """Queue a whole part of the caller's bytes, once at most ``max_concurrency`` parts are unfinished."""
        with self._part_settled:
            self._part_settled.wait_for(lambda: self._unfinished_parts <= self._max_concurrency)
        self._send_part(view, len(view), owner)
        self._size += len(view)

    def _part_done(self, future: Future[_UploadedPart]) -> None:
        with self._part_settled:
            self._unfinished_parts -= 1
            self._part_settled.notify_all()
        if not future.cancelled() and future.exception() is not None and self._failed_part is None:
            self._failed_part = future

    def _raise_failed_part(self) -> None:
        """Surface a failed part at the next part rather than after serialising the rest of the checkpoint."""
        if self._failed_part is not None:
            self._failed_part.result()

    def _upload_part(
        self, number: int, buffer: _PartBuffer | memoryview, length: int, cuts: tuple[int, ...], owner: object = None,
        lent: list[tuple[int, memoryview, object]] | None = None,
    ) -> _UploadedPart:
        try:
            part = _spliced(memoryview(buffer)[:length], lent or [])
            pieces = _piece_checksums(self._algorithm, part, cuts)
            checksum = combine_checksums(self._algorithm, pieces)
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.key, "UploadId": self._upload_id}
            if self._native_checksums:
                kwargs[self._algorithm.response_field] = self._algorithm.encode(checksum)
            response = self._utils.with_retries(  # each attempt reads the part from its start
                lambda: self._utils.client.upload_part(
                    PartNumber=number, Body=_BufferReader(part, _SEND_BLOCK), **kwargs
                ),
                "upload_part",
                self.url,
                bucket=self.bucket,
                detail=f"part {number}",
            )
            return _UploadedPart(number, response["ETag"], checksum, length, tuple(pieces))
        finally:
            if owner is None:
                self._free_buffers.put(buffer)  # type: ignore[arg-type]

    # ---- completion -----------------------------------------------------------------------------------------------
    def _complete(self) -> None:
        """Send what is left, make the object visible, and check (or record) its checksum; sets `info`."""
        if self._upload_id is None:
            response, checksum = self._put_whole()
        else:
            response, checksum = self._complete_multipart()
        etag = response.get("ETag", "")
        stored = response.get(self._algorithm.response_field)
        if stored is not None and stored != checksum:
            raise ChecksumMismatchError(f"S3 stored checksum {stored} for {self.url}, but {checksum} was uploaded")
        _keeps_checksums(self._utils, self.bucket, self._commit_kind, keeps=stored is not None)
        if stored is None:  # the store ignored the checksum: record it ourselves, bound to this exact object
            self._records.write_sidecar(
                self.bucket, self.key,
                {"algorithm": self._algorithm.name, "checksum": checksum, "size": self._size, "etag": etag},
            )
        elif self._wrote_pending:  # the store keeps it: the unbound record written before the commit is not needed
            try:
                self._records.remove_sidecar(self.bucket, self.key)
            except Exception as exc:  # harmless where it stays: the store's checksum comes first
                logger.debug("%s: could not remove its unneeded checksum record: %r", self.url, exc)
        checksums = {self._algorithm.response_field: checksum}
        self.info = S3ObjectInfo(self.bucket, self.key, self._size, etag, checksums=checksums)
        logger.debug("Wrote %s (%d bytes, %s %s)", self.url, self._size, self._algorithm.name, checksum)

    def _keep_pieces(self, pieces: list[tuple[int, int]]) -> None:
        offsets = itertools.accumulate((length for _, length in pieces), initial=0)
        self._pieces = [(start, length, crc) for start, (crc, length) in zip(offsets, pieces, strict=False)]

    def _put_whole(self) -> tuple[dict[str, Any], str]:
        """A small object (less than one part): one PUT."""
        buffer = memoryview(self._buffer)[: self._filled] if self._buffer is not None else memoryview(b"")
        body = _spliced(buffer, self._lent)
        pieces = _piece_checksums(self._algorithm, body, [cut for cut in self._cuts if cut < self._filled])
        self._keep_pieces(pieces)
        checksum = self._algorithm.encode(combine_checksums(self._algorithm, pieces))
        self._commit_kind = "put"
        response = self._commit(
            checksum,
            lambda conditions: self._utils.with_retries(  # each attempt reads the body from its start
                lambda: self._utils.client.put_object(
                    Bucket=self.bucket, Key=self.key, Body=_BufferReader(body, _SEND_BLOCK) if len(buffer) else b"",
                    ChecksumAlgorithm=self._algorithm.name, **{self._algorithm.response_field: checksum},
                    Metadata={CHECKSUM_METADATA_KEY: f"{self._algorithm.name} {checksum}", **self._run_metadata()},
                    **conditions,
                ),
                "put_object",
                self.url,
            )
        )
        return response, checksum

    def _complete_multipart(self) -> tuple[dict[str, Any], str]:
        if self._buffer is not None and self._filled:
            self._send_part(self._buffer, self._filled)
        self._buffer = None
        parts = _results_or_first_error(self._parts)
        self._keep_pieces([piece for part in parts for piece in part.pieces])
        pieces = [(part.checksum, part.length) for part in parts]
        checksum = self._algorithm.encode(combine_checksums(self._algorithm, pieces))
        listed = []
        for part in parts:
            entry = {"PartNumber": part.number, "ETag": part.etag}
            if self._native_checksums:
                entry[self._algorithm.response_field] = self._algorithm.encode(part.checksum)
            listed.append(entry)
        extra: dict[str, Any] = {}
        if self._native_checksums:
            extra = {self._algorithm.response_field: checksum, "ChecksumType": "FULL_OBJECT"}
        self._commit_kind = "multipart" if self._native_checksums else "multipart-unchecked"
        response = self._commit(
            checksum,
            lambda conditions: self._utils.call(
                "complete_multipart_upload", self.url, Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                MultipartUpload={"Parts": listed}, **extra, **conditions,
            )
        )
        self._upload_id = None
        assert self._pool is not None
        self._pool.shutdown(wait=False)
        return response, checksum

    def _commit(self, checksum: str, request: Callable[[dict[str, str]], dict[str, Any]]) -> dict[str, Any]:
        """Send the commit (`request(conditions)`) after its pending checksum record ("Crash safety"), fenced."""
        fence = self._fence
        if fence is not None:
            fence.before_mutation(self.url, "save")  # a stale run writes nothing, not even the record
        had_record = True
        if self._commit_kind != "put" and not _keeps_checksums(self._utils, self.bucket, self._commit_kind):
            pending = functools.partial(
                self._records.write_pending, self.bucket, self.key, self._algorithm.name, checksum, self._size
            )
            had_record = fence.sent(self.url, "save", pending) if fence is not None else pending()
            self._wrote_pending = True
        try:
            if fence is not None and self._wrote_pending:
                # once more right before the commit: the gap after a check is where a stale run slips through
                fence.before_mutation(self.url, "save")
            if fence is None:
                return request({})
            conditions = fence.conditions(self.key)
            for attempt in range(1, _CONDITIONAL_COMMIT_ATTEMPTS + 1):
                try:
                    response = fence.sent(self.url, "save", lambda: request(conditions))  # noqa: B023 (sent at once)
                    break
                except Exception as exc:
                    if not (conditions and is_precondition_failed(exc, conditions)):
                        raise
                    if attempt == _CONDITIONAL_COMMIT_ATTEMPTS:
                        exc.add_note(
                            f"{self.url} changed under each of {attempt} conditional commits while this run owned its "
                            "directory: another writer outside fencing is writing this key; stop it, then save again"
                        )
                        raise
                    conditions = fence.precondition_failed(self.url, self.key, exc)
        except BaseException:
            if not had_record:
                self._forget_pending_record()
            raise
        fence.committed(self.key, response.get("ETag", ""))
        return response

    def _warn_without_conditional_completes(self) -> None:
        """Where the store is known (`doctor`, an earlier probe) to ignore conditions on completes: no probe here,
        as several multipart requests amid a save's own would confuse what watches them (and cost a save)."""
        record = store_capabilities(self._utils, self.bucket)
        if record.conditional_complete is False:
            warn_missing(
                record, "conditional_complete",
                "If-Match / If-None-Match on CompleteMultipartUpload: a fenced multipart commit there relies on the "
                "owner record's check alone, so a stale run paused between that check and its commit can replace a "
                "newer run's object (docs/fencing.md)",
            )

    def _forget_pending_record(self) -> None:
        """After a failed commit to a key without a record: remove the one written, unless an object is there."""
        try:
            self._utils.head_object(self.url)
        except FileNotFoundError:
            with contextlib.suppress(Exception):
                self._records.remove_sidecar(self.bucket, self.key)
        except Exception as exc:  # the record stays: harmless, the next save at this key replaces it
            logger.debug("%s: kept the checksum record of a failed commit: %r", self.url, exc)


# --------------------------------------------------------------------------------------------------------------------
# Store capabilities: what a store and bucket honours, learnt once per process (docs/s3.md, "What each store honours")
# --------------------------------------------------------------------------------------------------------------------
#
# Every protection that rests on a store's ability reads it here: fencing's conditional commits and removals, the
# checksums a multipart upload keeps. A probe works on a temporary key under the caller's prefix and removes it
# (`PROBE_KEY_PREFIX`; listings leave such keys out). What a save learns on the way (the fence's conditional PUT of
# its owner record, the checksum a commit returns) is noted in the same record, so nothing is probed twice.

CAPABILITIES = (
    "conditional_put", "conditional_complete", "conditional_delete", "conditional_copy", "multipart_checksum",
)
_WRONG_ETAG = '"00000000000000000000000000000000"'
_REFUSALS = frozenset({"NotImplemented", "501", "InvalidArgument", "InvalidRequest", "400"})


@dataclass
class StoreCapabilities:
    """What one store and bucket honours (`store_capabilities`); None: not known yet."""

    store: str  # the endpoint URL, or ``"AWS S3"``
    bucket: str
    conditional_put: bool | None = None  # If-None-Match: * / If-Match on PutObject answer 412 when they fail
    conditional_complete: bool | None = None  # If-None-Match: * and If-Match on CompleteMultipartUpload answer 412
    conditional_delete: bool | None = None  # If-Match on DeleteObject and a per-object ETag in DeleteObjects
    conditional_copy: bool | None = None  # If-None-Match: * on CopyObject's destination answers 412
    expiring_requests: bool | None = None  # a request signed to expire is refused once expired (s3_fencing probes)
    multipart_checksum: str | None = None  # what a multipart upload keeps: "FULL_OBJECT", "COMPOSITE" or "none"
    checksums_kept: dict[str, bool] = field(default_factory=dict)  # commit kind -> whether its answer had a checksum
    warned: set[str] = field(default_factory=set)  # capabilities whose absence was logged

    def describe(self) -> list[str]:
        """One line per capability, for the debug log and ``s3-checkpoint-io doctor``."""
        def shown(value: object) -> str:
            return "unknown" if value is None else "yes" if value is True else "no" if value is False else str(value)

        lines = [f"{name}: {shown(getattr(self, name))}  ({use})" for name, use in _CAPABILITY_USES.items()]
        return [*lines, "409 ConditionalRequestConflict: retried with backoff (not probed: it needs a race)"]


_CAPABILITY_USES = {
    "conditional_put": "fencing: the owner record's takeover and every fenced single-PUT commit",
    "conditional_complete": "fencing: every fenced multipart commit",
    "conditional_delete": "fencing, rm and gc: a removal carries the ETag it checked",
    "conditional_copy": "not used yet",
    "expiring_requests": "fencing: a stale run's late commit or removal is refused (probed at a takeover)",
    "multipart_checksum": "verified loads; without one, a checksum record beside the object",
}


_capabilities: dict[tuple[str, str], StoreCapabilities] = {}
_capabilities_lock = threading.RLock()


def store_capabilities(
    utils: S3Utils, bucket: str, probe: Collection[str] = (), prefix: str = ""
) -> StoreCapabilities:
    """The record of `utils`'s store and `bucket` (made on first use, kept for the process), after probing each
    capability named in `probe` (`CAPABILITIES`) that is not known yet, on a temporary key under `prefix`."""
    endpoint = str(getattr(getattr(utils.client, "meta", None), "endpoint_url", "") or "")
    store = "AWS S3" if _is_aws_endpoint(endpoint) else endpoint
    with _capabilities_lock:
        record = _capabilities.setdefault((endpoint, bucket), StoreCapabilities(store, bucket))
        unknown = [name for name in probe if getattr(record, name) is None]
        if unknown:
            _probe_capabilities(utils, record, unknown, prefix)
            logger.debug("%s (bucket %s): %s", store, bucket, "; ".join(record.describe()))
        return record


def _is_aws_endpoint(endpoint: str) -> bool:
    """Whether `endpoint` (empty: boto3's default) is AWS S3's, in any partition (``.amazonaws.com``, China's
    ``.amazonaws.com.cn``), with or without a port or a path."""
    host = urllib.parse.urlsplit(endpoint if "//" in endpoint else f"//{endpoint}").hostname or ""
    return not endpoint or host.endswith((".amazonaws.com", ".amazonaws.com.cn")) or host == "amazonaws.com"


def note_capability(record: StoreCapabilities, name: str, value: bool | str) -> None:
    """Record what a request found out on the way (a fence's conditional PUT, say). Package-internal (docs/api.md)."""
    with _capabilities_lock:
        if getattr(record, name) != value:
            setattr(record, name, value)
            logger.debug("%s (bucket %s): %s is %s", record.store, record.bucket, name, value)


def warn_missing(record: StoreCapabilities, name: str, what: str) -> bool:
    """Log once per store, bucket and capability `name` that it is missing: `what` names it and what is not
    protected; True if logged. Package-internal (docs/api.md)."""
    with _capabilities_lock:
        if name in record.warned:
            return False
        record.warned.add(name)
    logger.warning("%s (bucket %s) does not honour %s", record.store, record.bucket, what)
    return True


def _probe_capabilities(utils: S3Utils, record: StoreCapabilities, names: list[str], prefix: str) -> None:
    """Probe `names`; one that fails (access denied, say) stays unknown: the caller's own request will say why."""
    bucket, key = record.bucket, prefix + PROBE_KEY_PREFIX + secrets.token_hex(8)
    url = _object_url(bucket, key)
    try:
        utils.call("put_object", url, Bucket=bucket, Key=key, Body=b"probe")
        for name in names:
            setattr(record, name, _PROBES[name](utils, bucket, key, url))
    except Exception as exc:
        logger.debug("%s (bucket %s): could not probe %s: %r", record.store, bucket, ", ".join(names), exc)
    finally:
        with contextlib.suppress(Exception):
            utils.call("delete_object", url, Bucket=bucket, Key=key)


def _refused_by_condition(utils: S3Utils, operation: str, url: str, **kwargs: Any) -> bool:
    """Whether a request whose condition fails is refused (412); False when the store ignores or rejects it."""
    try:
        utils.call(operation, url, **kwargs)
    except Exception as exc:
        if is_precondition_failed(exc, {}):
            return True
        if _pacing.error_code(exc) in _REFUSALS:
            return False
        raise
    return False


def _probe_put(utils: S3Utils, bucket: str, key: str, url: str) -> bool:
    return _refused_by_condition(utils, "put_object", url, Bucket=bucket, Key=key, Body=b"probe", IfNoneMatch="*")


def _probe_complete(utils: S3Utils, bucket: str, key: str, url: str) -> bool:
    """Both conditions must refuse a one-part upload's completion over the probe's object (moto ignores If-Match)."""
    for condition in ({"IfNoneMatch": "*"}, {"IfMatch": _WRONG_ETAG}):
        upload = utils.call("create_multipart_upload", url, Bucket=bucket, Key=key)["UploadId"]
        try:
            part = utils.call("upload_part", url, Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"probe")
            parts = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]}
            if not _refused_by_condition(
                utils, "complete_multipart_upload", url, Bucket=bucket, Key=key, UploadId=upload,
                MultipartUpload=parts, **condition,
            ):
                return False
        finally:
            with contextlib.suppress(Exception):
                utils.call("abort_multipart_upload", url, Bucket=bucket, Key=key, UploadId=upload)
    return True


def _probe_delete(utils: S3Utils, bucket: str, key: str, url: str) -> bool:
    """Both forms must refuse a wrong ETag and leave the object, and DeleteObjects must remove it on its own ETag
    (a store, or a proxy, that refuses every ETag is no better than one that ignores them)."""
    single = _refused_by_condition(utils, "delete_object", url, Bucket=bucket, Key=key, IfMatch=_WRONG_ETAG)
    batch = {"Objects": [{"Key": key, "ETag": _WRONG_ETAG}], "Quiet": True}
    errors = utils.call("delete_objects", url, Bucket=bucket, Delete=batch).get("Errors", [])
    refused = single and any(error.get("Code") in ("PreconditionFailed", "412") for error in errors)
    try:
        etag = utils.call("head_object", url, Bucket=bucket, Key=key)["ETag"]
    except FileNotFoundError:  # one form removed it
        refused = False
    else:
        batch = {"Objects": [{"Key": key, "ETag": etag}], "Quiet": True}
        refused = refused and not utils.call("delete_objects", url, Bucket=bucket, Delete=batch).get("Errors")
    utils.call("put_object", url, Bucket=bucket, Key=key, Body=b"probe")  # for the other probes
    return refused


def _probe_copy(utils: S3Utils, bucket: str, key: str, url: str) -> bool:
    return _refused_by_condition(
        utils, "copy_object", url, Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": key},
        MetadataDirective="REPLACE", IfNoneMatch="*",
    )


def _probe_multipart_checksum(utils: S3Utils, bucket: str, key: str, url: str) -> str:
    """Upload one CRC32 part as a full-object checksum (else composite) and read back what the store kept."""
    body = b"probe"
    crc = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
    for kind in ("FULL_OBJECT", "COMPOSITE"):
        try:
            upload = utils.call(
                "create_multipart_upload", url, Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32", ChecksumType=kind
            )["UploadId"]
        except Exception as exc:
            if _pacing.error_code(exc) in _REFUSALS:
                continue
            raise
        try:
            part = utils.call(
                "upload_part", url, Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=body,
                ChecksumAlgorithm="CRC32", ChecksumCRC32=crc,
            )
            parts = {"Parts": [{"PartNumber": 1, "ETag": part["ETag"], "ChecksumCRC32": crc}]}
            extra = {"ChecksumCRC32": crc, "ChecksumType": kind} if kind == "FULL_OBJECT" else {}
            utils.call(
                "complete_multipart_upload", url, Bucket=bucket, Key=key, UploadId=upload, MultipartUpload=parts,
                **extra,
            )
            upload = ""
        except Exception as exc:
            if _pacing.error_code(exc) in _REFUSALS:
                continue
            raise
        finally:
            if upload:
                with contextlib.suppress(Exception):
                    utils.call("abort_multipart_upload", url, Bucket=bucket, Key=key, UploadId=upload)
        head = utils.call("head_object", url, Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        if head.get("ChecksumCRC32"):
            return str(head.get("ChecksumType") or ("COMPOSITE" if "-" in head["ChecksumCRC32"] else kind))
    return "none"


_PROBES: dict[str, Callable[[S3Utils, str, str, str], Any]] = {
    "conditional_put": _probe_put, "conditional_complete": _probe_complete, "conditional_delete": _probe_delete,
    "conditional_copy": _probe_copy, "multipart_checksum": _probe_multipart_checksum,
}


# --------------------------------------------------------------------------------------------------------------------
# s3fs caches: for code that also reaches S3 through fsspec (Lightning's ModelCheckpoint does)
# --------------------------------------------------------------------------------------------------------------------


def invalidate_fsspec_cache(url: str) -> None:
    """Tell live s3fs filesystems that `url` changed (Lightning's ModelCheckpoint asks their cached listings)."""
    s3fs = sys.modules.get("s3fs")
    if s3fs is None:
        return
    bucket_and_key = _urls.normalize_s3_url(url)[len(_urls.S3_PATH_PREFIX) :]
    for filesystem in list(getattr(s3fs.S3FileSystem, "_cache", {}).values()):
        with contextlib.suppress(Exception):
            filesystem.invalidate_cache(bucket_and_key)


def forget_s3fs_instances() -> None:
    """Drop the s3fs filesystems cached in this process (bound to the endpoint and credentials of their moment)."""
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def fresh_s3fs_instances() -> Iterator[None]:
    """`forget_s3fs_instances` on entry and on exit: no filesystem outlives the block (e.g. a local server)."""
    forget_s3fs_instances()
    try:
        yield
    finally:
        forget_s3fs_instances()

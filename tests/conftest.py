"""Shared pytest fixtures: local S3 servers (moto, SeaweedFS or an external endpoint), buckets, fault proxy.

Backends come from ``S3CKPT_TEST_BACKENDS`` (comma-separated, default ``moto,seaweedfs``).
``S3CKPT_TEST_ENDPOINT_URL`` (+ ``S3CKPT_TEST_ACCESS_KEY``, ``S3CKPT_TEST_SECRET_KEY``,
``S3CKPT_TEST_REGION``) runs the suite against that endpoint instead (backend ``external``).
A backend that cannot start here (no ``weed`` binary, its fixed ports taken) skips its tests, or fails
them when ``S3CKPT_TEST_REQUIRE_BACKENDS=1`` (for CI).
Every test that uses ``s3_server``, directly or through another fixture, is marked ``integration``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from fault_proxy import FaultProxy
from s3_servers import (
    S3Endpoint,
    S3ServerUnavailableError,
    ServerNotInstalledError,
    empty_and_delete_bucket,
    parallel_group,
    start_moto,
    start_seaweedfs,
)

from s3_utils import forget_s3fs_instances, fresh_s3fs_instances

KNOWN_BACKENDS = ("moto", "seaweedfs", "external")

# A takeover from another run waits the fenced requests' lifetime and a second (docs/fencing.md): 2 s, not 15, in tests
# (subprocesses inherit it); the tests of that wait set their own.
os.environ.setdefault("S3CKPT_FENCED_REQUEST_LIFETIME_S", "1")


def _selected_backends() -> list[str]:
    """Backends to run, from the environment (see module docstring)."""
    explicit = os.environ.get("S3CKPT_TEST_BACKENDS")
    if explicit:
        names = [b.strip() for b in explicit.split(",") if b.strip()]
    elif os.environ.get("S3CKPT_TEST_ENDPOINT_URL"):
        names = ["external"]
    else:
        names = ["moto", "seaweedfs"]
    unknown = sorted(set(names) - set(KNOWN_BACKENDS))
    if unknown:
        raise pytest.UsageError(f"S3CKPT_TEST_BACKENDS: unknown backend(s) {unknown}; known: {KNOWN_BACKENDS}")
    return names


BACKENDS = _selected_backends()


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark every test that (transitively) uses the ``s3_server`` fixture as ``integration``; check that a test that
    runs SeaweedFS can be told by its id (see `pytest_xdist_make_scheduler`)."""
    if "s3_server" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.integration)
    callspec = getattr(item, "callspec", None)
    backend = callspec.params.get("s3_server") if callspec is not None else None
    needs_weed = backend == "seaweedfs" or item.get_closest_marker("weed") is not None
    if needs_weed and parallel_group(item.nodeid) != "seaweedfs":
        raise pytest.UsageError(
            f"{item.nodeid} starts or locks SeaweedFS but 'seaweedfs' is not in its id: name the test so (the "
            "parallel runs put every such test in the one worker that may run a weed)"
        )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the ``weed`` tests first, before the session's SeaweedFS server holds the fixed ports and the lock they
    need (after pytest has grouped the tests by backend; the sort is stable)."""
    items.sort(key=lambda item: item.get_closest_marker("weed") is None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Whatever ``--dist`` says, hand out whole `parallel_group` groups (xdist's ``loadscope`` scheduling, largest
    group first), so that only one worker ever starts SeaweedFS."""
    from xdist.scheduler import LoadScopeScheduling

    class ParallelGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return parallel_group(nodeid)

    return ParallelGroupScheduling(config, log)


def _external_endpoint() -> S3Endpoint:
    url = os.environ.get("S3CKPT_TEST_ENDPOINT_URL")
    if not url:
        pytest.skip("backend 'external' needs S3CKPT_TEST_ENDPOINT_URL")
    return S3Endpoint(
        name="external",
        endpoint_url=url,
        access_key=os.environ.get("S3CKPT_TEST_ACCESS_KEY", "test"),
        secret_key=os.environ.get("S3CKPT_TEST_SECRET_KEY", "test"),
        region=os.environ.get("S3CKPT_TEST_REGION", "us-east-1"),
    )


@pytest.fixture(scope="session", params=BACKENDS)
def s3_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """A running S3-compatible server (one per backend, session-scoped) with AWS_* env pointing at it.

    While active, the standard AWS variables (keys, region, ``AWS_ENDPOINT_URL_S3``,
    ``AWS_EC2_METADATA_DISABLED``) are set and every other ``AWS_*`` variable is removed; config and
    credential files point at files that do not exist, so no developer profile leaks in.
    """
    backend: str = request.param
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(name)
        no_files = tmp_path_factory.mktemp(f"aws-{backend}")
        mp.setenv("AWS_CONFIG_FILE", str(no_files / "missing-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(no_files / "missing-credentials"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")

        with contextlib.ExitStack() as stack:
            try:
                if backend == "moto":
                    endpoint = stack.enter_context(start_moto())
                elif backend == "seaweedfs":
                    endpoint = stack.enter_context(start_seaweedfs(tmp_path_factory.mktemp("seaweedfs")))
                else:
                    endpoint = _external_endpoint()
            except (S3ServerUnavailableError, ServerNotInstalledError) as exc:
                if os.environ.get("S3CKPT_TEST_REQUIRE_BACKENDS") == "1":
                    pytest.fail(f"{backend} unavailable (S3CKPT_TEST_REQUIRE_BACKENDS=1): {exc}", pytrace=False)
                pytest.skip(f"{backend} unavailable: {exc}")
            for key, value in endpoint.env().items():
                mp.setenv(key, value)
            with fresh_s3fs_instances():  # s3fs keeps one instance per process, bound to the endpoint it first saw
                yield endpoint


@pytest.fixture
def s3_client(s3_server: S3Endpoint, request: pytest.FixtureRequest) -> Any:
    """A boto3 S3 client for assertions: path-style, retries off, explicit keys (through `directory_bucket_proxy`
    when the test's `bucket` is a directory bucket)."""
    if _bucket_kind(request) == "directory":
        return s3_server.client(endpoint_url=request.getfixturevalue("directory_bucket_proxy").endpoint_url)
    return s3_server.client()


DIRECTORY_ZONE_SUFFIX = "--use1-az4--x-s3"


def _bucket_kind(request: pytest.FixtureRequest) -> str:
    """``"directory"`` when the test parametrizes `bucket` with it (indirectly), else ``"general_purpose"``."""
    callspec = getattr(request.node, "callspec", None)
    return callspec.params.get("bucket", "general_purpose") if callspec is not None else "general_purpose"


@pytest.fixture
def bucket(s3_server: S3Endpoint, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty bucket ``test-<uuid8>``; emptied and deleted afterwards (best effort).

    ``@pytest.mark.parametrize("bucket", ["general_purpose", "directory"], indirect=True)`` also runs a test on a
    directory bucket ``test-<uuid8>--use1-az4--x-s3`` that is reached through `directory_bucket_proxy` only:
    ``AWS_ENDPOINT_URL_S3``, `s3_client` and `fault_proxy` point at that proxy while the test runs.
    """
    client = s3_server.client()
    name = f"test-{uuid.uuid4().hex[:8]}"
    if _bucket_kind(request) == "directory":
        proxy = request.getfixturevalue("directory_bucket_proxy")
        request.getfixturevalue("monkeypatch").setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint_url)
        forget_s3fs_instances()
        client = s3_server.client(endpoint_url=proxy.endpoint_url)
        name += DIRECTORY_ZONE_SUFFIX
    client.create_bucket(Bucket=name)
    if s3_server.name == "seaweedfs":  # its first write into a new bucket grows volumes: seconds on a busy machine,
        client.put_object(Bucket=name, Key=".warm-up", Body=b"")  # past the short timeouts the fault tests set
        client.delete_object(Bucket=name, Key=".warm-up")
    yield name
    try:
        empty_and_delete_bucket(client, name)
    except Exception as exc:  # cleanup must not mask the test result
        warnings.warn(f"could not clean up bucket {name} on {s3_server.name}: {exc!r}", stacklevel=1)


@pytest.fixture
def directory_bucket_proxy(s3_server: S3Endpoint) -> Iterator[FaultProxy]:
    """A FaultProxy in directory-bucket mode (S3 Express One Zone's listing, ETag and upload behaviour) in front of
    the current server, re-signing with its keys; closed afterwards."""
    if not s3_server.endpoint_url.startswith("http://"):
        pytest.skip("FaultProxy forwards plain http:// endpoints only")
    credentials = (s3_server.access_key, s3_server.secret_key)
    with FaultProxy(s3_server.endpoint_url, directory_buckets=True, credentials=credentials) as proxy:
        yield proxy


@pytest.fixture
def fault_proxy(s3_server: S3Endpoint, request: pytest.FixtureRequest) -> Iterator[FaultProxy]:
    """A FaultProxy on 127.0.0.1 in front of the current server (of `directory_bucket_proxy` for a directory
    bucket); closed afterwards."""
    if not s3_server.endpoint_url.startswith("http://"):
        pytest.skip("FaultProxy forwards plain http:// endpoints only")
    upstream = s3_server.endpoint_url
    if _bucket_kind(request) == "directory":
        upstream = request.getfixturevalue("directory_bucket_proxy").endpoint_url
    with FaultProxy(upstream) as proxy:
        yield proxy

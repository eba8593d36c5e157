"""Tests of the test harness itself: server fixtures, bucket fixture and the fault-injecting proxy.

Every test that takes ``s3_server`` (directly or via ``bucket``/``s3_client``/``fault_proxy``) runs
once per backend (moto, SeaweedFS). Objects stay small so the whole file runs in seconds.
"""

from __future__ import annotations

import http.client
import io
import os
import random
import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    FlexibleChecksumError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from fault_proxy import Fault, FaultProxy, FaultRule
from s3_servers import S3Endpoint, S3ServerUnavailableError, free_port, seaweedfs_process, start_seaweedfs

MiB = 1024 * 1024


def payload(n: int, seed: int = 0) -> bytes:
    """Deterministic pseudo-random bytes (so corruption/truncation is visible)."""
    return random.Random(seed).randbytes(n)


def via(proxy: FaultProxy, server: S3Endpoint, **config: Any) -> Any:
    """A no-retry boto3 client that talks to ``server`` through ``proxy``."""
    return server.client(endpoint_url=proxy.endpoint_url, **config)


def signed_headers(server: S3Endpoint, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
    """SigV4-sign a raw request (UNSIGNED-PAYLOAD) for use with http.client or raw sockets."""
    req = AWSRequest(method=method, url=url, headers={"X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD", **headers})
    S3SigV4Auth(Credentials(server.access_key, server.secret_key), "s3", server.region).add_auth(req)
    return dict(req.headers.items())


# ------------------------------------------------------------------------------------------------
# Fixtures and plain S3 API against each backend
# ------------------------------------------------------------------------------------------------


def test_fixture_sets_aws_environment(s3_server: S3Endpoint, bucket: str, request: pytest.FixtureRequest) -> None:
    assert os.environ["AWS_ENDPOINT_URL_S3"] == s3_server.endpoint_url
    assert os.environ["AWS_ACCESS_KEY_ID"] == s3_server.access_key
    assert os.environ["AWS_EC2_METADATA_DISABLED"] == "true"
    assert not os.path.exists(os.environ["AWS_CONFIG_FILE"])
    assert "AWS_PROFILE" not in os.environ
    assert s3_server.env()["AWS_ENDPOINT_URL_S3"] == s3_server.endpoint_url
    # The default credential chain + botocore's endpoint variable reach the test server.
    client = boto3.session.Session().client("s3", config=Config(s3={"addressing_style": "path"}))
    assert client.meta.endpoint_url == s3_server.endpoint_url
    client.head_bucket(Bucket=bucket)
    assert request.node.get_closest_marker("integration") is not None


def test_put_get_list_delete(s3_client: Any, bucket: str) -> None:
    data = payload(300_000)
    s3_client.put_object(Bucket=bucket, Key="dir/a.bin", Body=data)
    s3_client.put_object(Bucket=bucket, Key="dir/b.bin", Body=b"b")
    s3_client.put_object(Bucket=bucket, Key="other.txt", Body=b"o")

    assert s3_client.get_object(Bucket=bucket, Key="dir/a.bin")["Body"].read() == data
    ranged = s3_client.get_object(Bucket=bucket, Key="dir/a.bin", Range="bytes=10-19")["Body"].read()
    assert ranged == data[10:20]
    assert s3_client.head_object(Bucket=bucket, Key="dir/a.bin")["ContentLength"] == len(data)

    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix="dir/")
    assert [o["Key"] for o in listed["Contents"]] == ["dir/a.bin", "dir/b.bin"]

    s3_client.delete_object(Bucket=bucket, Key="dir/a.bin")
    with pytest.raises(ClientError) as exc:
        s3_client.head_object(Bucket=bucket, Key="dir/a.bin")
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    assert [o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"]] == ["dir/b.bin", "other.txt"]


def test_multipart_complete(s3_client: Any, bucket: str) -> None:
    parts_data = [payload(5 * MiB, seed=1), payload(1000, seed=2)]
    upload_id = s3_client.create_multipart_upload(Bucket=bucket, Key="mpu.bin")["UploadId"]
    parts = []
    for number, chunk in enumerate(parts_data, start=1):
        etag = s3_client.upload_part(Bucket=bucket, Key="mpu.bin", UploadId=upload_id, PartNumber=number, Body=chunk)[
            "ETag"
        ]
        parts.append({"PartNumber": number, "ETag": etag})
    s3_client.complete_multipart_upload(
        Bucket=bucket, Key="mpu.bin", UploadId=upload_id, MultipartUpload={"Parts": parts}
    )
    assert s3_client.get_object(Bucket=bucket, Key="mpu.bin")["Body"].read() == b"".join(parts_data)
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_multipart_abort(s3_client: Any, bucket: str) -> None:
    upload_id = s3_client.create_multipart_upload(Bucket=bucket, Key="aborted.bin")["UploadId"]
    s3_client.upload_part(Bucket=bucket, Key="aborted.bin", UploadId=upload_id, PartNumber=1, Body=payload(1000))
    uploads = s3_client.list_multipart_uploads(Bucket=bucket)["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in uploads] == [("aborted.bin", upload_id)]

    s3_client.abort_multipart_upload(Bucket=bucket, Key="aborted.bin", UploadId=upload_id)
    assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert s3_client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


@pytest.mark.weed
def test_busy_seaweedfs_ports_are_refused_clearly(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listener on one of weed's fixed ports (another weed) -> clear error, nothing spawned."""
    import s3_local_servers

    def no_spawn(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("must not spawn weed when its ports are taken")

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        monkeypatch.setattr(s3_local_servers, "WEED_FIXED_PORTS", (holder.getsockname()[1],))
        monkeypatch.setattr(s3_local_servers.subprocess, "Popen", no_spawn)
        with pytest.raises(S3ServerUnavailableError, match="another 'weed' running"), start_seaweedfs(tmp_path):
            pass
    assert not (tmp_path / "weed.log").exists()


def test_seaweedfs_listens_below_the_ephemeral_port_range(s3_server: S3Endpoint) -> None:
    """A port in Linux's ephemeral range (32768-60999 by default) can be taken as the local end of an outgoing
    connection just before weed binds it, and weed then fails to start (CI saw it on weed's default admin gRPC
    port 33646). Every port weed listens on must be below the range."""
    import psutil

    try:
        weed = seaweedfs_process(s3_server)
    except KeyError:
        pytest.skip("only SeaweedFS listens on fixed ports")
    process = psutil.Process(weed.proc.pid)
    ports = {
        conn.laddr.port
        for proc in [process, *process.children(recursive=True)]
        for conn in proc.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    }
    assert len(ports) >= 8, f"weed listens on {sorted(ports)}: the check would prove little"
    assert max(ports) < 32768, sorted(ports)


def test_free_port_in_range() -> None:
    port = free_port(20000, 45000, also_free=(10000,))
    assert 20000 <= port <= 45000
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # would raise if the port were taken


# ------------------------------------------------------------------------------------------------
# FaultRule budget logic (no server needed)
# ------------------------------------------------------------------------------------------------


def test_rule_matching_and_budget() -> None:
    rule = FaultRule(
        Fault.slow_down(), method="put", path_regex=r"/ckpt/epoch=\d+", query="partNumber=", times=2, after_requests=1
    )
    args = ("PUT", "/b/ckpt/epoch=3.ckpt", "partNumber=1&uploadId=x", "ua")
    assert not rule.matches("GET", *args[1:])
    assert not rule.matches("PUT", "/b/other", *args[2:])
    assert not rule.matches("PUT", args[1], "uploads", "ua")
    fired = [rule.try_fire(*args) for _ in range(5)]
    assert fired == [False, True, True, False, False]  # skip 1, then fire twice
    assert (rule.matched, rule.fired) == (5, 2)

    by_agent = FaultRule(Fault.reset_before_response(), user_agent="rank-1")
    assert by_agent.try_fire("GET", "/b/k", "", "Boto3/1.x rank-1")
    assert not by_agent.try_fire("GET", "/b/k", "", "Boto3/1.x rank-0")


def test_rule_probability_is_seeded() -> None:
    expected_rng = random.Random(42)
    expected = [expected_rng.random() < 0.3 for _ in range(50)]
    rule = FaultRule(Fault.status(500), probability=0.3, seed=42)
    assert [rule.try_fire("GET", "/b/k", "", "") for _ in range(50)] == expected
    assert 0 < sum(expected) < 50
    with pytest.raises(ValueError):
        FaultRule(Fault.status(500), probability=1.5)


# ------------------------------------------------------------------------------------------------
# The proxy against each backend
# ------------------------------------------------------------------------------------------------


def test_proxy_passthrough_records_requests(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    client = via(fault_proxy, s3_server, user_agent_extra="rank-3")
    data = payload(200_000)
    client.put_object(Bucket=bucket, Key="ckpt/epoch=1.ckpt", Body=data)
    assert client.get_object(Bucket=bucket, Key="ckpt/epoch=1.ckpt")["Body"].read() == data
    assert client.head_object(Bucket=bucket, Key="ckpt/epoch=1.ckpt")["ContentLength"] == len(data)
    assert [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]] == ["ckpt/epoch=1.ckpt"]

    records = fault_proxy.requests
    assert [(r.method, r.status) for r in records] == [("PUT", 200), ("GET", 200), ("HEAD", 200), ("GET", 200)]
    assert records[0].path == f"/{bucket}/ckpt/epoch=1.ckpt"  # URL-decoded (%3D -> =)
    assert "list-type=2" in records[3].query
    assert all("rank-3" in r.user_agent and r.fault is None for r in records)
    assert all(r.ended is not None and r.ended >= r.started for r in records)
    assert fault_proxy.count(method="GET") == 2
    assert fault_proxy.count(query_contains="list-type=2") == 1
    assert fault_proxy.count(path_regex=r"epoch=1\.ckpt$") == 3
    assert fault_proxy.count(faulted=True) == 0
    fault_proxy.clear()
    assert fault_proxy.requests == []


def test_proxy_streams_multipart_and_ranged_download(
    s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy
) -> None:
    """Concurrent part uploads (Expect: 100-continue bodies) and ranged GETs through the proxy."""
    client = via(fault_proxy, s3_server)
    data = payload(6 * MiB + 123, seed=7)
    cfg = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=4)
    client.upload_fileobj(io.BytesIO(data), bucket, "big.bin", Config=cfg)
    assert fault_proxy.count(method="POST", query_contains="uploads") == 1
    assert fault_proxy.count(method="PUT", query_contains="partNumber=") == 2

    out = io.BytesIO()
    dl_cfg = TransferConfig(multipart_threshold=1 * MiB, multipart_chunksize=2 * MiB, max_concurrency=4)
    client.download_fileobj(bucket, "big.bin", out, Config=dl_cfg)
    assert out.getvalue() == data
    assert fault_proxy.count(method="GET", path_regex=r"/big\.bin$") == 4  # ceil(6 MiB+123 / 2 MiB)
    assert all(r.status in (200, 206) for r in fault_proxy.requests)


def test_signed_put_through_proxy(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    """The proxy keeps the client's Host header, so SigV4 still validates upstream (SeaweedFS checks it)."""
    client = via(fault_proxy, s3_server)
    client.put_object(Bucket=bucket, Key="signed.bin", Body=b"signed-body")
    assert s3_server.client().get_object(Bucket=bucket, Key="signed.bin")["Body"].read() == b"signed-body"

    if s3_server.name == "moto":
        return  # moto accepts any signature; the negative check below is meaningful only for real servers
    bad = S3Endpoint(s3_server.name, s3_server.endpoint_url, s3_server.access_key, "wrong-secret", s3_server.region)
    with pytest.raises(ClientError) as exc:
        via(fault_proxy, bad).put_object(Bucket=bucket, Key="unsigned.bin", Body=b"x")
    assert exc.value.response["Error"]["Code"] == "SignatureDoesNotMatch"


def test_expect_100_continue_is_relayed(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    """A raw client that waits for 100 Continue before the body gets it from the upstream via the proxy."""
    body = payload(100_000)
    url = f"{fault_proxy.endpoint_url}/{bucket}/expect.bin"
    headers = signed_headers(s3_server, "PUT", url, {"Content-Length": str(len(body)), "Expect": "100-continue"})
    head = f"PUT /{bucket}/expect.bin HTTP/1.1\r\nHost: 127.0.0.1:{fault_proxy.port}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", fault_proxy.port), timeout=10) as sock:
        sock.sendall(head.encode())
        interim = sock.recv(4096)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n")
        sock.sendall(body)
        reader = sock.makefile("rb")
        status_line = reader.readline()
        while status_line.startswith(b"HTTP/1.1 100"):  # moto sends 100 Continue twice
            while reader.readline() not in (b"\r\n", b""):
                pass
            status_line = reader.readline()
        assert status_line.split()[1] == b"200", status_line
    assert s3_server.client().get_object(Bucket=bucket, Key="expect.bin")["Body"].read() == body


def test_chunked_request_body_and_keepalive(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    """Transfer-Encoding: chunked request bodies are forwarded; keep-alive follows the upstream."""
    pieces = [payload(1000, 1), payload(70_000, 2), b"end"]
    parts = urlsplit(fault_proxy.endpoint_url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        url = f"{fault_proxy.endpoint_url}/{bucket}/chunked.bin"
        conn.putrequest("PUT", f"/{bucket}/chunked.bin", skip_accept_encoding=True)
        for key, value in signed_headers(s3_server, "PUT", url, {"Transfer-Encoding": "chunked"}).items():
            conn.putheader(key, value)
        conn.endheaders()
        for piece in pieces:
            conn.send(b"%x\r\n" % len(piece) + piece + b"\r\n")
        conn.send(b"0\r\n\r\n")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        first_sock = conn.sock
        upstream_keeps_alive = (resp.getheader("Connection") or "").lower() != "close"

        url = f"{fault_proxy.endpoint_url}/{bucket}/chunked.bin"
        conn.request("GET", f"/{bucket}/chunked.bin", headers=signed_headers(s3_server, "GET", url, {}))
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.read() == b"".join(pieces)
        if upstream_keeps_alive:  # SeaweedFS keeps connections open, moto's Werkzeug closes each one
            assert conn.sock is first_sock
    finally:
        conn.close()


def test_slowdown_twice_then_success(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    rule = fault_proxy.add_rule(FaultRule(Fault.slow_down(), method="PUT", path_regex=r"/obj$", times=2))
    client = via(fault_proxy, s3_server)
    for _ in range(2):
        with pytest.raises(ClientError) as exc:
            client.put_object(Bucket=bucket, Key="obj", Body=b"data")
        assert exc.value.response["Error"]["Code"] == "SlowDown"
        assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert exc.value.response["Error"]["Message"] == "Please reduce your request rate."
    client.put_object(Bucket=bucket, Key="obj", Body=b"data")
    assert s3_server.client().get_object(Bucket=bucket, Key="obj")["Body"].read() == b"data"

    assert rule.fired == 2
    assert [(r.status, r.fault) for r in fault_proxy.requests] == [
        (503, "status:503:SlowDown"),
        (503, "status:503:SlowDown"),
        (200, None),
    ]
    assert fault_proxy.count(method="PUT", faulted=True) == 2


def test_status_after_requests_and_head(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
    fault_proxy.add_rule(FaultRule(Fault.status(500, "InternalError"), method="HEAD", after_requests=1, times=1))
    client = via(fault_proxy, s3_server)
    client.head_object(Bucket=bucket, Key="k")  # first match is let through
    with pytest.raises(ClientError) as exc:
        client.head_object(Bucket=bucket, Key="k")
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500  # HEAD errors carry no body
    client.head_object(Bucket=bucket, Key="k")  # budget used up
    assert [r.status for r in fault_proxy.requests] == [200, 500, 200]


def test_reset_before_response(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    fault_proxy.add_rule(FaultRule(Fault.reset_before_response(), method="PUT", times=1))
    client = via(fault_proxy, s3_server)
    with pytest.raises(ConnectionClosedError):
        client.put_object(Bucket=bucket, Key="reset.bin", Body=payload(10_000))
    # The proxy read the request but never forwarded it.
    with pytest.raises(ClientError):
        s3_server.client().head_object(Bucket=bucket, Key="reset.bin")
    client.put_object(Bucket=bucket, Key="reset.bin", Body=b"ok")  # pool recovers on a new connection
    assert [(r.status, r.fault) for r in fault_proxy.requests] == [(None, "reset_before_response"), (200, None)]


def test_reset_mid_request(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    fault_proxy.add_rule(FaultRule(Fault.reset_mid_request(), method="PUT", times=1))
    with pytest.raises(ConnectionClosedError):
        via(fault_proxy, s3_server).put_object(Bucket=bucket, Key="half.bin", Body=payload(2 * MiB))
    with pytest.raises(ClientError):
        s3_server.client().head_object(Bucket=bucket, Key="half.bin")
    assert fault_proxy.requests[0].fault == "reset_mid_request"


def test_reset_mid_response(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    data = payload(256 * 1024)
    s3_server.client().put_object(Bucket=bucket, Key="r.bin", Body=data)
    fault_proxy.add_rule(FaultRule(Fault.reset_mid_response(), method="GET", times=1))
    client = via(fault_proxy, s3_server)
    resp = client.get_object(Bucket=bucket, Key="r.bin")  # headers arrive intact
    assert resp["ContentLength"] == len(data)
    with pytest.raises(ResponseStreamingError):
        resp["Body"].read()
    assert client.get_object(Bucket=bucket, Key="r.bin")["Body"].read() == data


def test_truncate_body(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    data = payload(64 * 1024)
    s3_server.client().put_object(Bucket=bucket, Key="t.bin", Body=data)
    fault_proxy.add_rule(FaultRule(Fault.truncate_body(1000), method="GET", path_regex=r"/t\.bin$", times=1))
    resp = via(fault_proxy, s3_server).get_object(Bucket=bucket, Key="t.bin")
    assert resp["ContentLength"] == len(data)  # original Content-Length is kept
    with pytest.raises((ResponseStreamingError, IncompleteReadError)):
        resp["Body"].read()
    # Reading in small pieces shows exactly the first 1000 bytes arrive.
    fault_proxy.add_rule(FaultRule(Fault.truncate_body(1000), method="GET", times=1))
    body = via(fault_proxy, s3_server).get_object(Bucket=bucket, Key="t.bin")["Body"]
    received = body.read(1000)
    assert received == data[:1000]
    with pytest.raises((ResponseStreamingError, IncompleteReadError)):
        body.read()
    assert [r.fault for r in fault_proxy.requests] == ["truncate_body:1000"] * 2


def test_corrupt_body(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    data = payload(64 * 1024)
    s3_server.client().put_object(Bucket=bucket, Key="c.bin", Body=data)
    fault_proxy.add_rule(FaultRule(Fault.corrupt_body(offset=40_000), method="GET"))

    raw_client = via(fault_proxy, s3_server, response_checksum_validation="when_required")
    got = raw_client.get_object(Bucket=bucket, Key="c.bin")["Body"].read()
    assert len(got) == len(data) and got != data
    assert [i for i in range(len(data)) if got[i] != data[i]] == [40_000]
    assert got[40_000] == data[40_000] ^ 0xFF

    # boto3 stores a CRC32 with the object (default since 1.36); if the server returns it,
    # botocore's default response validation catches the corruption.
    direct = s3_server.client().get_object(Bucket=bucket, Key="c.bin", ChecksumMode="ENABLED")
    returns_checksum = any(h.startswith("x-amz-checksum-") for h in direct["ResponseMetadata"]["HTTPHeaders"])
    default_client = via(fault_proxy, s3_server)
    if returns_checksum:
        with pytest.raises(FlexibleChecksumError):
            default_client.get_object(Bucket=bucket, Key="c.bin")["Body"].read()
    else:
        assert default_client.get_object(Bucket=bucket, Key="c.bin")["Body"].read() != data


def test_stall_hits_read_timeout(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    s3_server.client().put_object(Bucket=bucket, Key="s.bin", Body=b"slow")
    fault_proxy.add_rule(FaultRule(Fault.stall(30), method="GET", times=1))
    client = via(fault_proxy, s3_server, read_timeout=1, connect_timeout=1)
    started = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        client.get_object(Bucket=bucket, Key="s.bin")
    assert 0.9 <= time.monotonic() - started < 5
    assert client.get_object(Bucket=bucket, Key="s.bin")["Body"].read() == b"slow"
    stalled = fault_proxy.requests[0]
    assert (stalled.method, stalled.status, stalled.fault, stalled.ended) == ("GET", None, "stall:30s", None)
    # fixture teardown (proxy.close) must end the stalled handler promptly, not after 30 s


def test_rules_by_query_and_user_agent(s3_server: S3Endpoint, bucket: str, fault_proxy: FaultProxy) -> None:
    """Faults aimed at part uploads of one 'rank' only; the other rank's requests pass."""
    fault_proxy.add_rule(FaultRule(Fault.slow_down(), query="partNumber=", user_agent="rank-1"))
    rank0 = via(fault_proxy, s3_server, user_agent_extra="rank-0")
    rank1 = via(fault_proxy, s3_server, user_agent_extra="rank-1")
    for name, client in (("r0", rank0), ("r1", rank1)):
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=name)["UploadId"]
        try:
            client.upload_part(Bucket=bucket, Key=name, UploadId=upload_id, PartNumber=1, Body=b"p")
            ok = True
        except ClientError as exc:
            assert exc.response["Error"]["Code"] == "SlowDown"
            ok = False
        assert ok is (name == "r0")
        client.abort_multipart_upload(Bucket=bucket, Key=name, UploadId=upload_id)
    assert fault_proxy.count(method="POST", query_contains="uploads") == 2
    faulted = [r for r in fault_proxy.requests if r.fault]
    assert len(faulted) == 1 and "rank-1" in faulted[0].user_agent and "partNumber=1" in faulted[0].query


def test_proxy_close_stops_everything(s3_server: S3Endpoint, bucket: str) -> None:
    before = set(threading.enumerate())
    proxy = FaultProxy(s3_server.endpoint_url)
    client = via(proxy, s3_server, read_timeout=1, connect_timeout=1)
    client.put_object(Bucket=bucket, Key="x", Body=b"x")  # leaves a keep-alive connection open
    proxy.add_rule(FaultRule(Fault.stall(60), method="GET"))
    with pytest.raises(ReadTimeoutError):
        client.get_object(Bucket=bucket, Key="x")
    started = time.monotonic()
    proxy.close()
    assert time.monotonic() - started < 3
    leftover = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert leftover == []
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", proxy.port), timeout=1):
        pass
    proxy.close()  # idempotent


def test_parallel_runs_put_every_seaweedfs_test_in_one_worker(pytestconfig: pytest.Config) -> None:
    """`pytest -n N` hands out whole `parallel_group` groups through xdist's loadscope scheduler, whose private
    ``_split_scope`` conftest overrides (pinned here, with the real scheduler and two recording workers): the
    SeaweedFS tests, the `weed` ones first, go to one worker, in collection order; a module's other tests stay
    together."""
    pytest.importorskip("xdist")
    from conftest import pytest_xdist_make_scheduler

    class RecordingWorker:
        def __init__(self, name: str) -> None:
            self.gateway = type("Gateway", (), {"id": name})()
            self.received: list[str] = []
            self.pending: list[int] = []
            self.shutting_down = False

        def send_runtest_some(self, indices: list[int]) -> None:
            self.received.extend(collection[i] for i in indices)
            self.pending.extend(indices)

        def shutdown(self) -> None:
            self.shutting_down = True

    collection = [
        "tests/test_demo.py::test_demo_with_embedded_seaweedfs_as_a_subprocess",
        "tests/test_a.py::test_one[moto]",
        "tests/test_a.py::test_one[seaweedfs]",
        "tests/test_a.py::test_two[moto-directory]",
        "tests/test_b.py::test_three[seaweedfs-directory]",
        "tests/test_b.py::test_four",
        "tests/test_c.py::test_five[moto]",
    ]
    config = type("Config", (), {})()
    config.getvalue = {"tx": ["2*popen"]}.__getitem__
    config.option = type("Options", (), {"loadscopereorder": True, "maxschedchunk": None})()
    scheduler = pytest_xdist_make_scheduler(config, None)
    workers = [RecordingWorker("gw0"), RecordingWorker("gw1")]
    for worker in workers:
        scheduler.add_node(worker)
    for worker in workers:
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    while any(worker.pending for worker in workers):  # each worker runs its tests; the rest is handed out meanwhile
        for worker in workers:
            if worker.pending:
                scheduler.mark_test_complete(worker, worker.pending.pop(0))

    seaweedfs = [nodeid for nodeid in collection if "seaweedfs" in nodeid]
    holders = [worker for worker in workers if set(seaweedfs) & set(worker.received)]
    assert len(holders) == 1, [worker.received for worker in workers]
    assert [nodeid for nodeid in holders[0].received if nodeid in seaweedfs] == seaweedfs
    for module in ("tests/test_a.py", "tests/test_b.py"):
        others = {n for n in collection if n.startswith(module) and "seaweedfs" not in n}
        assert sum(1 for worker in workers if others & set(worker.received)) == 1, module
    assert sorted(n for worker in workers for n in worker.received) == sorted(collection)

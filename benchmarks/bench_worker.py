"""One measurement in a fresh process: ``python bench_worker.py '<json spec>'`` prints one JSON line.

Run by ``bench_checkpoint.py`` (never by hand, except for debugging). The same file runs in the project venv
and in the peers venv (``benchmarks/.venv-peers``, for s3torchconnector), so it imports only the standard
library, torch and psutil at module level; each method imports its client lazily.

Every load scenario ends with ``make_resident`` inside the measurement (a load is done when its tensors are usable).
What it measures around the operation only (setup such as building the state dict, serialising the payload of
the raw scenarios, importing clients and opening a connection is done before the clock starts):

* wall time (``time.perf_counter``);
* client CPU: ``resource.getrusage`` of this process (all threads, native CRT threads included) plus children
  (curl);
* server CPU: psutil user+system time of the weed process and all its descendants;
* memory: ``/proc/self/clear_refs`` "5" resets VmHWM just before the operation; the peak is
  ``VmHWM - VmRSS before``. A 20 ms sampler also adds up RssAnon + RssFile + the pages held by the process's
  memfd files (a memfd written with pwrite is not in RSS until mapped and touched), and the larger of the two
  peaks is reported as ``peak_extra_mib``.
"""

from __future__ import annotations

import gc
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

MiB = 1024**2


# ---------------------------------------------------------------------------------------------------------------
# memory / cpu probes
# ---------------------------------------------------------------------------------------------------------------


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _memfd_bytes() -> int:
    """Pages held by this process's memfd files, each file counted once (torch.load(mmap=True) of
    /proc/self/fd/N opens a second fd onto the same memfd)."""
    seen: dict[tuple[int, int], int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:"):
                st = os.stat(f"/proc/self/fd/{name}")
                seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
        except OSError:
            pass
    return sum(seen.values())


def _footprint() -> int:
    s = _status()
    return s.get("RssAnon", 0) + s.get("RssFile", 0) + _memfd_bytes()


class MemorySampler:
    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _footprint())
            self._stop.wait(self.interval)

    def __enter__(self) -> MemorySampler:
        self.peak = _footprint()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _footprint())


def _cpu_self() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + c.ru_utime + c.ru_stime


def _cpu_system() -> float:
    """Busy CPU seconds of the whole machine (all cores) from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _cpu_server(pid: int | None) -> float:
    if not pid:
        return 0.0
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class Measure:
    """Context manager around exactly the measured operation."""

    def __init__(self, weed_pid: int | None) -> None:
        self.weed_pid = weed_pid
        self.result: dict[str, Any] = {}

    def __enter__(self) -> Measure:
        gc.collect()
        self.base = _status()
        self.base_fp = _footprint()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.sampler = MemorySampler().__enter__()
        self.cpu0 = _cpu_self()
        self.srv0 = _cpu_server(self.weed_pid)
        self.sys0 = _cpu_system()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        t1 = time.perf_counter()
        cpu1 = _cpu_self()
        srv1 = _cpu_server(self.weed_pid)
        sys1 = _cpu_system()
        self.sampler.__exit__()
        hwm = _status()["VmHWM"]
        hwm_extra = hwm - self.base["VmRSS"]
        fp_extra = self.sampler.peak - self.base_fp
        self.result = {
            "wall_s": t1 - self.t0,
            "client_cpu_s": cpu1 - self.cpu0,
            "server_cpu_s": srv1 - self.srv0,
            # machine-wide busy CPU not explained by client+server: noise from other processes (and the sampler)
            "other_cpu_s": (sys1 - self.sys0) - (cpu1 - self.cpu0) - (srv1 - self.srv0),
            "base_rss_mib": self.base["VmRSS"] / MiB,
            "hwm_extra_mib": hwm_extra / MiB,
            "footprint_extra_mib": fp_extra / MiB,
            "peak_extra_mib": max(hwm_extra, fp_extra) / MiB,
            "retained_extra_mib": (_footprint() - self.base_fp) / MiB,
        }


# ---------------------------------------------------------------------------------------------------------------
# state dict
# ---------------------------------------------------------------------------------------------------------------


def tensor_specs(size_mib: int, tensor_mib: int) -> list[tuple[str, int, int]]:
    """(name, numel, seed) for a state dict of exactly size_mib MiB of float32."""
    specs = []
    remaining = size_mib * MiB
    i = 0
    while remaining > 0:
        nbytes = min(tensor_mib * MiB, remaining)
        specs.append((f"layers.{i}.weight", nbytes // 4, 1000 + i))
        remaining -= nbytes
        i += 1
    return specs


def make_tensor(numel: int, seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.rand(numel, generator=g, dtype=torch.float32)


REALISTIC: tuple[int, int] | None = None
"""``(d, layers)`` when the spec asks for the realistic state (`realistic_state.checkpoint`) instead of equal
float32 tensors; set by `run`."""


def make_checkpoint(size_mib: int, tensor_mib: int) -> dict[str, Any]:
    if REALISTIC is not None:
        import realistic_state

        return realistic_state.checkpoint(*REALISTIC)
    state = {name: make_tensor(n, s) for name, n, s in tensor_specs(size_mib, tensor_mib)}
    return {"state_dict": state, "global_step": 1234, "epoch": 3, "hyper_parameters": {"lr": 1e-3}}


def _tensors(obj: Any) -> Iterator[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def verify(loaded: dict[str, Any], size_mib: int, tensor_mib: int) -> None:
    import torch

    if REALISTIC is not None:
        import realistic_state

        try:
            realistic_state.assert_equal(loaded, realistic_state.checkpoint(*REALISTIC))
        except AssertionError as exc:
            raise SystemExit(f"VERIFY FAILED: {exc}") from None
        return

    state = loaded["state_dict"]
    specs = tensor_specs(size_mib, tensor_mib)
    if sorted(state) != sorted(name for name, _, _ in specs) or loaded.get("global_step") != 1234:
        raise SystemExit(f"VERIFY FAILED: keys differ: {sorted(state)[:5]}...")
    for name, n, seed in specs:
        got = state[name]
        if got.dtype != torch.float32 or got.numel() != n or not torch.equal(got, make_tensor(n, seed)):
            raise SystemExit(f"VERIFY FAILED: tensor {name} is not bit-identical")


def make_resident(loaded: dict[str, Any]) -> None:
    """Read one byte of every 4 KiB page of every loaded tensor, inside the measurement of every load scenario.

    A load is done when its tensors can be used. ``torch.load(mmap=True)`` (ours) returns tensors whose pages are
    mapped lazily, so without this their page faults would land in the caller's first step, outside the clock;
    for loads that copy into fresh tensors (NeMo, Lightning, s3torchconnector) the pages are already resident and
    this costs a few milliseconds.
    """
    import torch

    for tensor in _tensors(loaded):
        if tensor.numel():
            tensor.view(-1).view(torch.uint8)[::4096].sum()


def serialise(ckpt: dict[str, Any]) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(ckpt, buf)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# clients
# ---------------------------------------------------------------------------------------------------------------


def boto3_client(default_checksums: bool = True, pool: int = 32) -> Any:
    """A plain boto3 client from the environment (AWS_ENDPOINT_URL_S3, keys). default_checksums=False switches
    botocore's default CRC32 on every upload off (fastest plain client)."""
    import boto3
    from botocore.config import Config

    kwargs: dict[str, Any] = {"s3": {"addressing_style": "path"}, "max_pool_connections": pool}
    if not default_checksums:
        kwargs.update(request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return boto3.session.Session().client("s3", config=Config(**kwargs))


def s3tc_checkpoint(part_mib: int, gbps: float | None) -> Any:
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    cfg: dict[str, Any] = {"force_path_style": True, "part_size": part_mib * MiB}
    if gbps:
        cfg["throughput_target_gbps"] = gbps
    return S3Checkpoint(
        region="us-east-1", endpoint=os.environ["AWS_ENDPOINT_URL_S3"], s3client_config=S3ClientConfig(**cfg)
    )


def curl_base() -> list[str]:
    return [
        "curl",
        "-sS",
        "--fail",
        "--aws-sigv4",
        "aws:amz:us-east-1:s3",
        "--user",
        f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}",
    ]


# ---------------------------------------------------------------------------------------------------------------
# operations
# ---------------------------------------------------------------------------------------------------------------


def run(spec: dict[str, Any]) -> dict[str, Any]:
    method: str = spec["method"]
    size: int = spec["size_mib"]
    tmib: int = spec["tensor_mib"]
    bucket: str = spec["bucket"]
    key: str = spec["key"]
    url = f"s3://{bucket}/{key}"
    p: dict[str, Any] = spec.get("params", {})
    weed = spec.get("weed_pid")
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3", "")
    out: dict[str, Any] = {}
    loaded: Any = None
    global REALISTIC
    if spec.get("state") == "realistic":
        REALISTIC = (int(spec["d"]), int(spec["layers"]))
    if p.get("reference"):  # fast paths that take their reference path (s3_utils.REFERENCE_PATHS_ENV)
        os.environ["S3CKPT_REFERENCE_PATHS"] = p["reference"]

    import torch

    torch.set_num_threads(int(p.get("torch_threads", torch.get_num_threads())))

    # ---------------- host copy (reference for async blocked time)
    if method == "host-copy":
        ckpt = make_checkpoint(size, tmib)
        with Measure(weed) as m:
            copy = {k: v.clone() for k, v in ckpt["state_dict"].items()}
        del copy
        out.update(m.result)

    # ---------------- this package
    elif method in ("ours-save", "ours-async-save"):
        sys.path.insert(0, spec["repo"])
        from s3_checkpoint_io import S3CheckpointIO
        from s3_utils import DEFAULT_CHUNK_SIZE_MB

        ckpt = make_checkpoint(size, tmib)
        cio = S3CheckpointIO(
            f"s3://{bucket}/",
            chunk_size_MB=p.get("chunk", DEFAULT_CHUNK_SIZE_MB),
            max_write_concurrency=p.get("wc", 10),
            max_read_concurrency=p.get("rc", 15),
            async_checkpointing=method == "ours-async-save",
            endpoint_url=endpoint,
        )
        cio.s3.call("head_bucket", url, Bucket=bucket)  # build the client and open a connection
        from s3_fencing import DirectoryFence

        # the directory's takeover before the clock, as in a running job (a relaunch's first save also waits for the
        # last owner's requests to expire on stores that honour them: docs/fencing.md)
        DirectoryFence(cio.s3, url.rpartition("/")[0]).before_mutation(url, "save")
        with Measure(weed) as m:
            cio.save_checkpoint(ckpt, url)
            blocked = cio.last_save_blocked_s
            cio.wait_for_pending_saves()
        cio.teardown()
        out.update(m.result)
        out["blocked_s"] = blocked
    elif method == "ours-load":
        sys.path.insert(0, spec["repo"])
        from s3_checkpoint_io import S3CheckpointIO
        from s3_utils import DEFAULT_CHUNK_SIZE_MB

        cio = S3CheckpointIO(
            f"s3://{bucket}/",
            chunk_size_MB=p.get("chunk", DEFAULT_CHUNK_SIZE_MB),
            max_read_concurrency=p.get("rc", 15),
            endpoint_url=endpoint,
        )
        cio.s3.call("head_bucket", url, Bucket=bucket)
        with Measure(weed) as m:
            loaded = cio.load_checkpoint(url, map_location="cpu")
            make_resident(loaded)
        out.update(m.result)

    # ---------------- NeMo: torch.save -> BytesIO -> upload_fileobj ; download_fileobj -> BytesIO -> torch.load
    elif method == "nemo-save":
        from boto3.s3.transfer import TransferConfig

        ckpt = make_checkpoint(size, tmib)
        client = boto3_client()
        client.head_bucket(Bucket=bucket)
        cfg = TransferConfig(multipart_chunksize=64 * MiB, max_concurrency=10)
        with Measure(weed) as m:
            buf = io.BytesIO()
            torch.save(ckpt, buf)
            buf.seek(0)
            client.upload_fileobj(buf, bucket, key, Config=cfg)
            del buf
        out.update(m.result)
    elif method == "nemo-load":
        from boto3.s3.transfer import TransferConfig

        client = boto3_client()
        client.head_bucket(Bucket=bucket)
        cfg = TransferConfig(multipart_chunksize=64 * MiB, max_concurrency=15)
        with Measure(weed) as m:
            buf = io.BytesIO()
            client.download_fileobj(bucket, key, buf, Config=cfg)
            buf.seek(0)
            loaded = torch.load(buf, map_location="cpu")
            del buf
            make_resident(loaded)
        out.update(m.result)

    # ---------------- Lightning TorchCheckpointIO on s3:// (fsspec / s3fs)
    elif method == "lightning-save":
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        ckpt = make_checkpoint(size, tmib)
        lio = TorchCheckpointIO()
        import fsspec

        fsspec.filesystem("s3").ls(bucket)  # build the filesystem and its session
        with Measure(weed) as m:
            lio.save_checkpoint(ckpt, url)
        out.update(m.result)
    elif method == "lightning-load":
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        lio = TorchCheckpointIO()
        import fsspec

        fsspec.filesystem("s3").ls(bucket)
        with Measure(weed) as m:
            loaded = lio.load_checkpoint(url, map_location="cpu")
            make_resident(loaded)
        out.update(m.result)

    # ---------------- AWS s3torchconnector (peers venv)
    elif method == "s3tc-save":
        ckpt = make_checkpoint(size, tmib)
        s3c = s3tc_checkpoint(p.get("part", 8), p.get("gbps"))
        with s3c.writer(f"s3://{bucket}/warmup-{key}") as w:  # start the CRT client outside the measurement
            w.write(b"x")
        with Measure(weed) as m:
            with s3c.writer(url) as w:
                torch.save(ckpt, w)
        out.update(m.result)
    elif method in ("s3tc-load", "s3tc-load-ranged"):
        from s3torchconnector import S3ReaderConstructor

        s3c = s3tc_checkpoint(p.get("part", 8), p.get("gbps"))
        with s3c.reader(f"s3://{bucket}/warmup-{key}") as r:
            r.read()
        ctor = S3ReaderConstructor.range_based() if method == "s3tc-load-ranged" else S3ReaderConstructor.sequential()
        with Measure(weed) as m:
            with s3c._client.get_object(bucket, key, reader_constructor=ctor) as r:
                loaded = torch.load(r, map_location="cpu")
            make_resident(loaded)
        out.update(m.result)

    # ---------------- raw ceilings on pre-serialised bytes
    elif method in ("raw-put-boto3", "raw-put-curl", "raw-mpu-put"):
        payload = serialise(make_checkpoint(size, tmib))
        gc.collect()
        out["object_bytes"] = len(payload)
        if method == "raw-put-boto3":
            client = boto3_client(default_checksums=False)
            client.head_bucket(Bucket=bucket)
            with Measure(weed) as m:
                client.put_object(Bucket=bucket, Key=key, Body=payload)
        elif method == "raw-put-curl":
            fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="bench-payload-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(payload)
                del payload
                gc.collect()
                with Measure(weed) as m:
                    subprocess.run(
                        [*curl_base(), "-o", "/dev/null", "-T", path, f"{endpoint}/{bucket}/{key}"], check=True
                    )
            finally:
                os.unlink(path)
        else:
            from boto3.s3.transfer import TransferConfig

            client = boto3_client()
            client.head_bucket(Bucket=bucket)
            cfg = TransferConfig(multipart_chunksize=64 * MiB, multipart_threshold=64 * MiB, max_concurrency=10)
            with Measure(weed) as m:
                client.upload_fileobj(io.BytesIO(payload), bucket, key, Config=cfg)
        out.update(m.result)
    elif method == "raw-ranged-get":
        sys.path.insert(0, spec["repo"])
        import s3_utils

        utils = s3_utils.S3Utils(s3_utils.S3ClientSettings(endpoint_url=endpoint))
        n = utils.client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        chunk = int(p.get("chunk", 16)) * MiB
        utils.read_range_into(url, 0, bytearray(1024))  # connection up first
        with Measure(weed) as m:
            target = bytearray(n)
            view = memoryview(target)
            utils.read_ranges_into(
                url, [(start, view[start : start + chunk]) for start in range(0, n, chunk)], max_concurrency=15
            )
            view[::4096].tobytes()  # touched, as make_resident touches a load's tensors
        out.update(m.result)
        loaded = torch.load(io.BytesIO(target), map_location="cpu", weights_only=False)
    elif method in ("raw-get-boto3", "raw-get-curl", "raw-mpu-get"):
        if method == "raw-get-curl":
            with Measure(weed) as m:
                subprocess.run([*curl_base(), "-o", "/dev/null", f"{endpoint}/{bucket}/{key}"], check=True)
            out.update(m.result)
            out["note"] = "body to /dev/null; not verified"
        else:
            client = boto3_client(default_checksums=False)
            client.head_bucket(Bucket=bucket)
            n = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
            if method == "raw-get-boto3":
                with Measure(weed) as m:
                    target = bytearray(n)
                    view = memoryview(target)
                    body = client.get_object(Bucket=bucket, Key=key)["Body"]
                    off = 0
                    while off < n:
                        chunk = body.read(min(8 * MiB, n - off))
                        if not chunk:
                            break
                        view[off : off + len(chunk)] = chunk
                        off += len(chunk)
                    body.close()
                assert off == n, (off, n)
                out.update(m.result)
                loaded = torch.load(io.BytesIO(target), map_location="cpu")
            else:
                from boto3.s3.transfer import TransferConfig

                cfg = TransferConfig(multipart_chunksize=64 * MiB, multipart_threshold=64 * MiB, max_concurrency=15)
                with Measure(weed) as m:
                    target_io = io.BytesIO()
                    client.download_fileobj(bucket, key, target_io, Config=cfg)
                out.update(m.result)
                target_io.seek(0)
                loaded = torch.load(target_io, map_location="cpu")
    else:
        raise SystemExit(f"unknown method {method}")

    if loaded is not None:
        verify(loaded, size, tmib)
        out["verified"] = True
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = run(spec)
    result["python"] = sys.executable
    print("BENCH_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

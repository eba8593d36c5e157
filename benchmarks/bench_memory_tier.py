#!/usr/bin/env python
"""The memory tier against today's saves and loads: two simulated nodes, one or more gloo ranks
each, the realistic GPT-style state (bf16 parameters, fp32 Adam moments), S3 on SeaweedFS (moto only if SeaweedFS
stays busy, said in the output).

    python benchmarks/bench_memory_tier.py                      # d=256, 2 layers (~70 MiB of tensors)
    python benchmarks/bench_memory_tier.py --d 512 --layers 4   # bigger, where the machine has room
    python benchmarks/bench_memory_tier.py --ranks-per-node 2   # 2 nodes x 2 ranks

Rank 0 of node 0 (this process) measures; the other ranks (subprocesses, each with its node's ``GROUP_RANK``,
``LOCAL_RANK`` and tier directory) run their node's replica server on local rank 0, as
`S3CheckpointIO.start_replication` sets it up, and receive the other node's replicas. Per round, the variants
alternate (the machine may be shared: medians and min..max over the rounds):

Stall per save (what training waits for) and the time until the checkpoint is on the peer and on S3:
* ``copy``: every tensor's bytes written into one new tmpfs file (no serialisation, no checksum): the floor;
* ``tier``: `S3CheckpointIO.save_checkpoint` with ``memory_tier`` (drain every save here, replication on); "on the
  peer" is when node 1's replica manifest appears, "on S3" when the drain's transfer record appears;
* ``async-s3``: today's async `S3CheckpointIO` save (the snapshot), on S3 when `wait_for_pending_saves` returns;
* ``dcp-async``: ``dcp.async_save`` with `s3_dcp.S3StorageWriter` (a one-rank group), on S3 when its future is done.

Resume (each load followed by touching every tensor):
* ``read-tmpfs``: the ``copy`` file's bytes read into preallocated tensors: the floor for a memory resume;
* ``load-memory``: `load_checkpoint` from the verified memory copy; ``load-s3``: from S3 (a plugin without a tier);
* ``load-replica``: `s3_tier_replication.fetch_directory` of the replica node 1 holds, then ``torch.load`` of it
  (a replaced node's resume); ``transport``: the same bytes over a loopback TCP socket: its floor.

Then ``--steps`` saves on every rank (each its own part: the state; a save every step, S3 every 10th), rank 0's
through a request-counting proxy: bytes and requests rank 0 sent to S3, against today's every-step S3 save; and each
node's RAM (tmpfs bytes of its ranks' own copies plus the replicas it holds, and rank 0's RSS), sampled once every
rank saved the step. Writes ``benchmarks/results/memory-tier-<UTC>[-tag].json`` and prints tables.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks", REPO / "tests" / "helpers"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import realistic_state  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import s3_local_servers  # noqa: E402
import s3_tier_replication  # noqa: E402
from s3_checkpoint_io import S3CheckpointIO  # noqa: E402
from s3_memory_tier import MemoryTier, TierReplication  # noqa: E402
from s3_process import node_key  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
JOB = "bench-tier"


# ---- helpers ------------------------------------------------------------------------------------------------------


def tensors_of(obj: object) -> list[torch.Tensor]:
    found, pending = [], [obj]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return found


def byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())


def plain_copy(tensors: list[torch.Tensor], path: str) -> float:
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for tensor in tensors:
            view = byte_view(tensor)
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return time.perf_counter() - started


def read_into(targets: list[torch.Tensor], path: str) -> float:
    """The floor of a memory resume: the file's bytes read into the preallocated tensors."""
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for target in targets:
            view = byte_view(target)
            while view:
                view = view[f.readinto(view) :]
    return time.perf_counter() - started


def touch(checkpoint: object, targets: list[torch.Tensor]) -> None:
    """What a resume does with the loaded tensors: copy them into the model's and optimizer's own (every byte read,
    so a memory-mapped load pays for its page faults here)."""
    loaded = tensors_of(checkpoint)
    assert len(loaded) == len(targets)
    for target, tensor in zip(targets, loaded, strict=True):
        target.copy_(tensor)


def transport(path: str) -> float:
    """The file's bytes over a loopback TCP connection into a buffer: the floor of a replica fetch."""
    size = os.path.getsize(path)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as sock, open(path, "rb") as f:
                sock.sendfile(f)

        started = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        connection, _ = server.accept()
        buffer = memoryview(bytearray(size))
        with connection:
            while buffer:
                buffer = buffer[connection.recv_into(buffer) :]
        sender.join()
    return time.perf_counter() - started


def tmpfs_bytes(root: Path) -> int:
    total = 0
    for path in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):  # a copy dropped or renamed while counting
            total += path.stat().st_size if path.is_file() else 0
    return total


def tier_bytes(root: Path) -> tuple[int, int]:
    """A node's tmpfs bytes: its ranks' own copies (``<job>/own``), and the rest (the replicas it holds)."""
    own = sum(tmpfs_bytes(directory) for directory in root.glob("*/*/own"))
    return own, tmpfs_bytes(root) - own


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_for(predicate: Any, timeout_s: float = 600.0, poll_s: float = 0.002) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark: waited too long")
        time.sleep(poll_s)


def spread(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


# ---- node 1: the peer ---------------------------------------------------------------------------------------------


def peer_node(args: Any) -> None:
    """Every rank but rank 0: its node's replica server (local rank 0, start_replication) for each phase, in step
    with rank 0; in the steps phase it saves its own part every step too."""
    dist.init_process_group("gloo", timeout=dt.timedelta(hours=2))
    dist.new_group([0])  # collective: node 0's one-rank group for dcp.async_save
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    for phase in ("rounds", "steps"):
        config = MemoryTier(root=f"{args.peer_root}/{phase}", job=JOB, keep=2, drain_every=10)
        plugin = S3CheckpointIO(memory_tier=config)
        plugin.start_replication(local_rank=local_rank)
        if phase == "steps":
            state = realistic_state.checkpoint(args.d, args.layers)
            for step in range(1, args.steps + 1):
                plugin.save_checkpoint(state, f"s3://{args.bucket}/steps/rank{rank}/step={step}-last.ckpt")
                dist.barrier()  # every rank saved the step: rank 0 samples the nodes' memory
        dist.barrier()  # rank 0 is done with the phase
        plugin.teardown()
    dist.destroy_process_group()


# ---- node 0: the measurements -------------------------------------------------------------------------------------


def s3_store(data_dir: str, wait_s: float) -> Any:
    """SeaweedFS (one per machine: retried while another run holds it), else moto, said in the results."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            server = s3_local_servers.seaweedfs_server(data_dir, lock="fail")
            endpoint = server.__enter__()
            return server, endpoint, "SeaweedFS"
        except s3_local_servers.LocalServerError as exc:
            if time.monotonic() > deadline:
                print(f"SeaweedFS busy ({exc}): moto instead", flush=True)
                server = s3_local_servers.moto_server()
                return server, server.__enter__(), "moto (SeaweedFS was busy)"
            time.sleep(10)


def rounds_phase(args: Any, state: dict[str, Any], roots: dict[str, Path], bucket: str) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp

    from s3_dcp import S3StorageWriter

    tensors = tensors_of(state)
    results: dict[str, list[float]] = {}

    def add(kind: str, seconds: float) -> None:
        results.setdefault(kind, []).append(seconds)

    tiered = S3CheckpointIO(memory_tier=MemoryTier(root=str(roots["node0"] / "rounds"), job=JOB, keep=2, drain_every=1))
    tiered.start_replication()
    plain = S3CheckpointIO(async_checkpointing=True)  # today's async S3 save
    targets = [torch.empty_like(t) for t in tensors]  # the "model" a resume copies into
    group0 = dist.new_group([0])
    warm = f"s3://{bucket}/warm/step=0.ckpt"
    tiered.save_checkpoint(state, warm)
    tiered.wait_for_pending_saves()
    replica_root = roots["node1"] / "rounds"
    sender = node_key()
    for index in range(args.rounds):
        step = index + 1
        order = ["copy", "tier", "async-s3", "dcp-async"]
        order = order[index % len(order) :] + order[: index % len(order)]  # who goes first rotates
        for variant in order:
            if variant == "copy":
                path = str(roots["scratch"] / f"copy-{step}")
                add("stall copy", plain_copy(tensors, path))
            elif variant == "tier":
                url = f"s3://{bucket}/tier/step={step}.ckpt"
                name = TierReplication.replica_name(url)
                started = time.perf_counter()
                tiered.save_checkpoint(state, url)
                add("stall tier", tiered.last_save_blocked_s)
                wait_for(lambda n=name: any(replica_root.rglob(f"{n}.replica.json")))
                add("on peer tier", time.perf_counter() - started)
                wait_for(lambda u=url: any(r.url == u and r.tier == "s3" for r in list(tiered.records)))
                add("on S3 tier", time.perf_counter() - started)
                tiered.wait_for_pending_saves()
            elif variant == "async-s3":
                started = time.perf_counter()
                plain.save_checkpoint(state, f"s3://{bucket}/async/step={step}.ckpt")
                add("stall async-s3", plain.last_save_blocked_s)
                plain.wait_for_pending_saves()
                add("on S3 async-s3", time.perf_counter() - started)
            else:
                started = time.perf_counter()
                writer = S3StorageWriter(f"s3://{bucket}/dcp/step={step}")
                future = dcp.async_save(state, storage_writer=writer, process_group=group0)
                add("stall dcp-async", time.perf_counter() - started)
                future.result()
                add("on S3 dcp-async", time.perf_counter() - started)
        # resume, alternating too
        url = f"s3://{bucket}/tier/step={step}.ckpt"
        copy_path = str(roots["scratch"] / f"copy-{step}")
        order = ["read-tmpfs", "load-memory", "load-s3", "load-replica", "transport"]
        order = order[index % len(order) :] + order[: index % len(order)]
        for variant in order:
            started = time.perf_counter()
            if variant == "read-tmpfs":
                add(variant, read_into(targets, copy_path))
                continue
            if variant == "transport":
                add(variant, transport(str(tiered.node_tier().path_of(url))))
                continue
            if variant == "load-memory":
                touch(tiered.load_checkpoint(url, weights_only=False), targets)
                assert tiered.records[-1].tier == "memory", tiered.records[-1]
            elif variant == "load-s3":
                touch(plain.load_checkpoint(url, weights_only=False), targets)
            else:
                dest = roots["scratch"] / f"fetched-{step}"
                info = tiered.node_tier()
                fetched = s3_tier_replication.fetch_directory(
                    replica_peer(tiered), sender_node=sender, name=TierReplication.replica_name(url), dest=dest,
                    job=info.job, launch=info.run.run_id if info.run.job else None,
                )
                touch(torch.load(fetched / info.path_of(url).name, weights_only=False, mmap=True), targets)
            add(variant, time.perf_counter() - started)
        for leftover in roots["scratch"].iterdir():
            if leftover.is_file():
                leftover.unlink()
            else:
                for f in leftover.iterdir():
                    f.unlink()
                leftover.rmdir()
    tiered.teardown()
    plain.teardown()
    dist.barrier()  # node 1 closes this phase's replica server
    return results


def replica_peer(plugin: S3CheckpointIO) -> Any:
    """The peer's replica server address, as `start_replication` found it: the plugin keeps its `TierReplication`
    to itself, so the benchmark finds it by type (a resume from a peer's replica is not built into the plugin yet)."""
    for value in vars(plugin).values():
        if isinstance(value, TierReplication):
            return value.peer
    raise RuntimeError("replication was not started")


def steps_phase(args: Any, state: dict[str, Any], roots: dict[str, Path], bucket: str, endpoint: str) -> dict[str, Any]:
    """`--steps` saves, S3 every 10th, through a request-counting proxy; RAM sampled after each save."""
    from fault_proxy import FaultProxy

    out: dict[str, Any] = {}
    root = roots["node0"] / "steps"
    with FaultProxy(endpoint) as proxy:
        previous = os.environ.get("AWS_ENDPOINT_URL_S3")
        os.environ["AWS_ENDPOINT_URL_S3"] = proxy.endpoint_url
        try:
            tiered = S3CheckpointIO(memory_tier=MemoryTier(root=str(root), job=JOB, keep=2, drain_every=10))
            tiered.start_replication()
            tmpfs_max = own_max = replicas_max = rss_max = 0
            for step in range(1, args.steps + 1):
                tiered.save_checkpoint(state, f"s3://{bucket}/steps/rank0/step={step}-last.ckpt")
                dist.barrier()  # every rank saved the step
                for node in ("node0", "node1"):
                    own, replicas = tier_bytes(roots[node] / "steps")
                    tmpfs_max, own_max = max(tmpfs_max, own + replicas), max(own_max, own)
                    replicas_max = max(replicas_max, replicas)
                rss_max = max(rss_max, rss_bytes())
            tiered.teardown()  # the last one drains too
            dist.barrier()  # the other ranks end the phase (their last replicas to node 0 may find it closed)
            tier_requests = list(proxy.requests)
            drained = [r for r in tiered.records if r.kind == "save" and r.tier == "s3"]
            sizes = [r.size for r in tiered.records if r.kind == "save" and r.tier == "memory"]
            plain = S3CheckpointIO(async_checkpointing=True)
            mark = len(proxy.requests)
            plain.save_checkpoint(state, f"s3://{bucket}/steps-plain/step=1-last.ckpt")
            plain.teardown()
            one_save = proxy.requests[mark:]
        finally:
            if previous is None:
                os.environ.pop("AWS_ENDPOINT_URL_S3", None)
            else:
                os.environ["AWS_ENDPOINT_URL_S3"] = previous
    checkpoint_bytes = max(sizes)
    sent = sum(r.size for r in drained)
    out.update(
        steps=args.steps, checkpoint_bytes=checkpoint_bytes, drains=len(drained), tier_bytes_to_s3=sent,
        tier_requests=len(tier_requests), today_bytes_to_s3=args.steps * checkpoint_bytes,
        today_requests=args.steps * len(one_save), requests_per_plain_save=len(one_save),
        tmpfs_max_bytes=tmpfs_max, own_max_bytes=own_max, replicas_max_bytes=replicas_max, rss_max_bytes=rss_max,
        keep=2, ranks_per_node=args.ranks_per_node,
    )
    return out


def node0(args: Any) -> dict[str, Any]:
    state = realistic_state.checkpoint(args.d, args.layers)
    tensors = tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    base = Path(tempfile.mkdtemp(prefix="bench-tier-", dir=args.tmpfs))
    roots = {name: base / name for name in ("node0", "node1", "scratch", "weed")}
    for path in roots.values():
        path.mkdir(mode=0o700)
    server, endpoint, store = s3_store(str(roots["weed"]), args.weed_wait_s)
    try:
        os.environ.update(endpoint.env())
        os.environ.setdefault("MASTER_PORT", str(s3_local_servers.free_port()))  # once the store holds its ports
        bucket = "bench-tier"
        endpoint.client().create_bucket(Bucket=bucket)
        per_node = args.ranks_per_node
        sizes = {"WORLD_SIZE": str(2 * per_node), "LOCAL_WORLD_SIZE": str(per_node)}
        peers = []
        for node, local in [(node, local) for node in (0, 1) for local in range(per_node)][1:]:
            env = dict(os.environ, RANK=str(node * per_node + local), GROUP_RANK=str(node), LOCAL_RANK=str(local),
                       **sizes)  # fmt: skip
            command = [sys.executable, __file__, "--peer-root", str(roots[f"node{node}"]), "--bucket", bucket,
                       "--d", str(args.d), "--layers", str(args.layers), "--steps", str(args.steps)]  # fmt: skip
            peers.append(subprocess.Popen(command, env=env, cwd=REPO))
        os.environ.update(RANK="0", GROUP_RANK="0", LOCAL_RANK="0", **sizes)
        dist.init_process_group("gloo", timeout=dt.timedelta(hours=2))
        samples = rounds_phase(args, state, roots, bucket)
        steps = steps_phase(args, state, roots, bucket, endpoint.endpoint_url)
        dist.destroy_process_group()
        for peer in peers:
            peer.wait(timeout=300)
    finally:
        server.__exit__(None, None, None)
        subprocess.run(["rm", "-rf", str(base)], check=False)
    return {"store": store, "tensor_bytes": nbytes, "tensors": len(tensors), "samples": samples, "steps": steps}


# ---- report -------------------------------------------------------------------------------------------------------


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    m = {kind: spread(values)["median"] for kind, values in report["samples"].items()}
    steps = report["steps"]
    k, per_node = steps["keep"], steps.get("ranks_per_node", 1)
    node_bytes = per_node * steps["checkpoint_bytes"]  # a node's checkpoint: its ranks' parts
    ram_limit = (k + 1) * node_bytes + k * node_bytes  # own (K+1) + the peer node's replicas (K)
    rows = [
        ("stall tier <= 1.2x plain copy into tmpfs", m["stall tier"] / m["stall copy"], 1.2, "<="),
        ("resume from memory <= 1.3x reading the bytes from tmpfs", m["load-memory"] / m["read-tmpfs"], 1.3, "<="),
        ("resume from memory >= 3x faster than from S3", m["load-s3"] / m["load-memory"], 3.0, ">="),
        ("resume from a peer's replica <= 2x the bytes over the transport", m["load-replica"] / m["transport"], 2.0,
         "<="),
        ("own copies per node <= (K+1) x node's checkpoint", steps["own_max_bytes"] / ((k + 1) * node_bytes), 1.0,
         "<="),
        ("tmpfs per node <= (K+1) x node's checkpoint + K replicas", steps["tmpfs_max_bytes"] / ram_limit, 1.0,
         "<="),
    ]
    return [
        {"target": name, "measured": round(value, 4), "bound": bound,
         "met": value <= bound if op == "<=" else value >= bound}
        for name, value, bound, op in rows
    ]


def tables(report: dict[str, Any]) -> str:
    nbytes = report["tensor_bytes"]
    lines = [
        f"state d={report['args']['d']} layers={report['args']['layers']}: {nbytes / 2**20:.0f} MiB of tensors, "
        f"{report['args']['rounds']} rounds, 2 nodes x {report['args']['ranks_per_node']} ranks, S3 on "
        f"{report['store']}, {os.cpu_count()} CPUs (shared: not quiet)",
        "",
        "| what | median s | min..max s | GiB/s (median) |",
        "|---|---|---|---|",
    ]
    for kind, values in report["samples"].items():
        s = spread(values)
        lines.append(f"| {kind} | {s['median']:.3f} | {s['min']:.3f}..{s['max']:.3f} | "
                     f"{nbytes / s['median'] / 2**30:.2f} |")
    st = report["steps"]
    mib = 2**20
    lines += [
        "",
        f"{st['steps']} steps, a save every step, S3 every 10th: rank 0 to S3 {st['tier_bytes_to_s3'] / mib:.0f} "
        f"MiB in "
        f"{st['tier_requests']} requests ({st['drains']} drains) with the tier; today {st['today_bytes_to_s3'] / mib:.0f}"
        f" MiB in {st['today_requests']} requests ({st['requests_per_plain_save']} per save). RAM per node: tmpfs max "
        f"{st['tmpfs_max_bytes'] / mib:.0f} MiB (own copies max {st['own_max_bytes'] / mib:.0f} MiB + replicas held max "
        f"{st['replicas_max_bytes'] / mib:.0f} MiB; checkpoint {st['checkpoint_bytes'] / mib:.0f}"
        f" MiB, K={st['keep']}), RSS max {st['rss_max_bytes'] / mib:.0f} MiB (includes the training state itself)",
        "",
        "| target | measured | bound | met |",
        "|---|---|---|---|",
    ]
    for t in report["targets"]:
        lines.append(f"| {t['target']} | {t['measured']} | {t['bound']} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tmpfs", default="/dev/shm")
    parser.add_argument("--weed-wait-s", type=float, default=300.0)
    parser.add_argument("--ranks-per-node", type=int, default=1, help="gloo ranks on each of the two nodes")
    parser.add_argument("--tag", default="")
    parser.add_argument("--peer-root", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log, when moto stands in
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if args.peer_root:
        peer_node(args)
        return
    os.environ.setdefault("TORCHELASTIC_RUN_ID", f"bench-tier-{os.getpid()}")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    report = node0(args)
    report["args"] = vars(args)
    report["targets"] = targets(report)
    report["summary"] = {kind: spread(values) for kind, values in report["samples"].items()}
    report["environment"] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
        "cpus": os.cpu_count(), "load_average": os.getloadavg(), "note": "shared machine, not quiet",
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"memory-tier-{stamp}{'-' + args.tag if args.tag else ''}.json"
    out.write_text(json.dumps(report, indent=1))
    print(tables(report))
    print(f"results: {out}")


if __name__ == "__main__":
    main()

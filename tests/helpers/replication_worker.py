"""Processes for tests/test_tier_replication.py: a replica server in a process of its own (to kill or stop it), and
the ranks of a gloo job that exchange their nodes' replica server addresses and replicate around the ring.

Modes:
  serve     ``serve ROOT JOB LAUNCH``: run a `ReplicaServer` on ROOT (127.0.0.1, any port), print its port as one
            line on stdout, then wait until killed
  exchange  ``exchange OUT``: one rank of a job started with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
            GROUP_RANK, MASTER_ADDR, MASTER_PORT); the node's local rank 0 serves replicas under
            OUT/node<GROUP_RANK>/replicas, every rank calls `exchange_addresses`, each serving rank sends a checkpoint
            directory of its node to its ring peer (`peer_of`) and lists what its own server then holds. Writes
            OUT/rank<N>.json: the addresses and, on serving ranks, the replicas held.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import s3_tier_replication as replication
from s3_memory_tier import file_checksum

JOB = "test-job"
LAUNCH = "test-job#0"


def serve(root: str, job: str, launch: str) -> None:
    server = replication.ReplicaServer(Path(root), job=job, launch=None if launch == "-" else launch)
    print(server.address[1], flush=True)
    while True:
        time.sleep(60)


def exchange(out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, node = dist.get_rank(), int(os.environ["GROUP_RANK"])
    server = None
    if os.environ["LOCAL_RANK"] == "0":
        server = replication.ReplicaServer(out / f"node{node}" / "replicas", job=JOB, launch=LAUNCH)
    addresses = replication.exchange_addresses(server=server)
    result: dict[str, object] = {"addresses": {key: list(address) for key, address in addresses.items()}}
    if server is not None:
        nodes = list(addresses)
        me = nodes.index(next(key for key in nodes if key.startswith(f"node {node} ")))
        peer = replication.peer_of(me, len(nodes))
        source = out / f"node{node}" / "memory" / "step=1"
        source.mkdir(parents=True)
        (source / "shard.bin").write_bytes(bytes([node]) * (1 << 20) + os.urandom(4096))
        manifest = {"shard.bin": file_checksum(source / "shard.bin", "auto")}
        if peer is not None:
            replication.send_directory(
                source, "step=1", addresses[nodes[peer]], sender_node=nodes[me], job=JOB, launch=LAUNCH,
                manifest=manifest,
            )  # fmt: skip
        result["manifest"] = {path: list(entry) for path, entry in manifest.items()}
    dist.barrier()
    if server is not None:
        result["held"] = [info.record() for info in server.replicas()]
    dist.barrier()
    if server is not None:
        server.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(*sys.argv[2:5])
    else:
        exchange(Path(sys.argv[2]))

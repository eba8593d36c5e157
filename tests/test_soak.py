"""Kill-and-relaunch soak, short: see tests/helpers/soak.py for what it does and checks.

Two ranks under a torchrun-style environment, SIGKILLed at random instants (also while resuming), relaunched as a
new launch, once left as a straggler that continues after the relaunch saved, through a proxy injecting 503s, resets
and stalls. With the memory tier: two simulated nodes saving every step into memory, replicated, every 3rd drained
to S3, killed at random, and every 2nd kill a node loss (its tier directory wiped); relaunches resume from memory
(node 0 its own copy, node 1 its replica of it), and after node 0's loss from node 1's replica.
The longer version with its table: benchmarks/bench_soak.py (benchmarks/soak.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from soak import Launch, SoakConfig, launch_environment, run_soak, straggler_effects, weights

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize(
    "config",
    [
        SoakConfig(mode="single", kills=3, seed=3, straggler_launches=(1,), early_kill_probability=0.5),
        SoakConfig(mode="dcp", kills=2, seed=2, straggler_launches=(0,), early_kill_probability=0.0),
        SoakConfig(
            mode="tier", kills=3, seed=5, straggler_launches=(0,), early_kill_probability=0.25, node_loss_every=2,
            drain_every=3,
        ),
    ],
    ids=["single", "dcp", "tier"],
)
def test_kills_and_relaunches_never_strand_the_job(
    s3_server: Any, bucket: str, tmp_path: Path, config: SoakConfig
) -> None:
    report = run_soak(s3_server.env(), s3_server.endpoint_url, bucket, "soak", config, tmp_path / "logs")
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "logs").glob("*.log")))
    print(json.dumps(report.as_json()))
    assert report.failures == [], f"{json.dumps(report.as_json(), indent=1)}\n{logs}"
    assert report.kills == config.kills
    assert report.resumes + report.fresh_starts == config.kills + 1 - report.early_kills
    assert report.uploads_after_gc == 0
    assert report.stragglers == len(config.straggler_launches or ())
    # with conditions honoured (moto): no straggler overwrote or removed the relaunch's objects, and what it created
    # (a key the relaunch had not written) was removed by the relaunches' next saves
    assert (report.straggler_changes, report.straggler_removals, report.straggler_keys_left) == ([], 0, [])
    assert report.node_losses == (config.kills // config.node_loss_every if config.node_loss_every else 0)
    if config.mode == "tier":  # relaunches read memory (node 0 its own copy or node 1's replica, node 1 its replica);
        # once node 0 is lost, node 0 fetches node 1's replica. The harness fails a resume older than the newest replica
        # on node 1 or one of its step that read S3; which of the two memory tiers node 0 reads depends on whether its
        # newest save had reached node 1 at the kill (its "-last" clean-up drops its older own copy at once), so the
        # count here is of resumes that read no S3 at all.
        from_memory = {tiers: n for tiers, n in report.resume_tiers.items() if "s3" not in tiers.split("/")}
        assert sum(from_memory.values()) >= 1 and set(from_memory) <= {"memory/replica", "replica/replica"}, (
            report.resume_tiers
        )
        assert report.resume_tiers.get("replica/replica", 0) >= 1, report.resume_tiers


@pytest.mark.parametrize(("mode", "sharing"), [("single", "node"), ("single", "job"), ("dcp", "node")])
def test_both_ranks_fall_back_alike_from_a_newest_checkpoint_that_does_not_verify(
    s3_server: Any, bucket: str, s3_client: Any, tmp_path: Path, mode: str, sharing: str
) -> None:
    """Two ranks, the newest checkpoint corrupt: both skip it (through node or job load sharing, or dcp.load) and
    resume bit-exactly from the next newest; the corrupt one is still there."""
    import torch.distributed.checkpoint as dcp

    from s3_checkpoint_io import S3CheckpointIO
    from s3_dcp import S3StorageWriter

    base = f"s3://{bucket}/job"
    numel = 2**20 // 4
    io = S3CheckpointIO(chunk_size_MB=5, fencing=False)
    for step in (1, 2):
        if mode == "single":
            io.save_checkpoint({"step": step, "w": weights(step, numel)}, f"{base}/step={step}.ckpt")
        else:
            shards = {f"w{rank}": weights(step, numel)[rank::2].clone() for rank in range(2)}
            writer = S3StorageWriter(f"{base}/step={step}.ckpt")
            dcp.save({"step": step, **shards}, storage_writer=writer, no_dist=True)
    newest = f"{base}/step=2-last.ckpt"
    if mode == "single":  # truncated by another tool, which sends no checksum: it downloads, but does not unpickle
        io.save_checkpoint({"step": 2, "w": weights(2, numel)}, newest)
        data = s3_client.get_object(Bucket=bucket, Key="job/step=2-last.ckpt")["Body"].read()
        other_tool = s3_server.client(request_checksum_calculation="when_required")
        other_tool.put_object(Bucket=bucket, Key="job/step=2-last.ckpt", Body=data[: len(data) // 2])
    else:  # a shard lost
        shards = {f"w{rank}": weights(2, numel)[rank::2].clone() for rank in range(2)}
        dcp.save({"step": 2, **shards}, storage_writer=S3StorageWriter(newest), no_dist=True)
        s3_client.delete_object(Bucket=bucket, Key="job/step=2-last.ckpt/__0_0.distcp")
    env = launch_environment(s3_server.env(), f"fallback-{mode}-{sharing}", SOAK_LOAD_SHARING=sharing)
    launch = Launch(0, env, [base, mode, "3", "--mib", "1", "--more", "0"], tmp_path)
    try:
        resumed = [launch.wait_for(lambda e, r=r: e.get("event") == "resumed" and e["rank"] == r, 180) for r in (0, 1)]
        logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("*.log")))
        assert all(resumed), logs
        outcome = [(e["url"], e["step"], e["exact"], e["skipped"]) for e in resumed]
        assert outcome == [(f"{base}/step=2.ckpt", 2, True, 1)] * 2, logs
    finally:
        launch.kill()
    assert io.s3.s3_path_exists(newest if mode == "single" else f"{newest}/.metadata")  # skipped, never deleted


def test_straggler_effects_sorts_what_a_straggler_did_to_the_relaunchs_objects() -> None:
    """The soak's own measure, on a made-up request log: only the straggler's commits over objects the relaunch had
    committed before them (and not removed) are overwrites; launch 1 is not launch 12; failed requests and part
    uploads do nothing; a removal counts the relaunch's keys it names."""
    from fault_proxy import RecordedRequest

    def req(
        method: str, path: str, query: str, launch: int, status: int | None = 200, deleted: tuple[str, ...] = ()
    ) -> RecordedRequest:
        agent = f"Boto3/1 md/x soak-launch-{launch}"
        return RecordedRequest(method, path, query, status, agent, None, 0.0, deleted_keys=deleted)

    log = [
        req("PUT", "/b/s/step=5.ckpt", "", 0),  # the straggler first: created
        req("PUT", "/b/s/step=6.ckpt", "", 1),  # the relaunch's
        req("PUT", "/b/s/step=6.ckpt", "partNumber=1&uploadId=u", 0),  # a part: not a commit
        req("POST", "/b/s/step=6.ckpt", "uploadId=u", 0),  # completes over the relaunch's object: an overwrite
        req("PUT", "/b/s/step=7.ckpt", "", 0, 412),  # refused: nothing
        req("PUT", "/b/s/step=8.ckpt", "", 12),  # another launch's: not the relaunch's
        req("PUT", "/b/s/step=8.ckpt", "", 0),  # created
        req("PUT", "/b/s/step=6.ckpt.s3ckpt-checksum.json", "", 0),  # a checksum record: not a commit
        req("POST", "/b", "delete", 0, deleted=("s/step=6.ckpt", "s/step=5.ckpt")),  # names one of the relaunch's
        req("PUT", "/b/s/step=9.ckpt", "", 1),  # the relaunch's, then removed by itself:
        req("POST", "/b", "delete", 1, deleted=("s/step=9.ckpt",)),
        req("PUT", "/b/s/step=9.ckpt", "", 0),  # the straggler's commit there is a new key, not an overwrite
    ]
    effects = straggler_effects(log, "soak-launch-0", "soak-launch-1")
    assert [(r.method, r.path) for r in effects.overwrites] == [("POST", "/b/s/step=6.ckpt")]
    assert [r.path for r in effects.created] == ["/b/s/step=5.ckpt", "/b/s/step=8.ckpt", "/b/s/step=9.ckpt"]
    assert effects.removed == ["/b/s/step=6.ckpt"] and effects.relaunch_removed == {"/b/s/step=9.ckpt"}

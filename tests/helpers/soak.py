"""The kill-and-relaunch soak: tests/test_soak.py runs it short, benchmarks/bench_soak.py long.

A launch is two ranks of `soak_worker` (gloo) under a torchrun-style environment: ``TORCHELASTIC_RUN_ID`` fixed for
the job, ``TORCHELASTIC_RESTART_COUNT`` the launch number, ``RANK`` / ``LOCAL_RANK`` / ``GROUP_RANK`` / ``WORLD_SIZE``
/ ``LOCAL_WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``. Every launch talks to S3 through a `FaultProxy` injecting
503 SlowDown, connection resets (also on commits) and stalled answers at random. Each launch but the last is
SIGKILLed at a random instant: while it resumes, or while it trains and saves (uploads, commits, record writes,
removals and the "-last" clean-up all run then). Sometimes the launch is not killed but stopped (SIGSTOP) and left
as a straggler: the relaunch starts, saves, and only then the straggler continues (SIGCONT) for a while before it is
killed. The last launch trains a few steps to the end.

Checked after every relaunch (a failure is counted and described, never raised, so a benchmark reports them all):
* every rank resumed from the same checkpoint, and its weights equal the closed form for its step bit for bit;
* the resumed step is not older than the newest "-last" save any killed launch reported durable;
* what a straggler did once continued (SIGCONT), as the proxy saw it: commits over objects the relaunch had
  committed (overwrites), commits at keys the relaunch had not written (new keys), and removals of the relaunch's
  objects (the keys its DeleteObjects named that are gone afterwards);
and at the end: which new keys of stragglers still hold a straggler's object after the relaunches' saves (the owner's
next save removes them), and ``s3-checkpoint-io gc --yes`` aborts every multipart upload the kills left open.

Mode ``tier``: the job saves every step into the memory tier (each rank a node of its own, its
tier directory under a tmpfs, replication to the other node on), every ``drain_every``-th save drains to S3, so kills
fall during the memory copy, the replication, the drain and the clean-up. Every ``node_loss_every``-th kill is also
a node loss: that node's whole tier directory (its own copies and the replicas it held) is wiped before the
relaunch, node 0 (the saver) and node 1 in turn. Two floors: the newest "-last" save a killed launch saw on S3, and
the newest replica that survives on node 1 (every rank can load it from a tier: rank 1 its replica, rank 0 its own
copy or, after its node's loss, the replica fetched from node 1), which the ranks must read from memory or the
replica, not S3. Loads are counted by the tier each rank read.

Launch mechanics: each launch's ranks are started (and import) while the launch before runs, then let go when it is
killed; the rendezvous store's socket is bound by the harness and handed to rank 0 (no race for ``MASTER_PORT``); a
launch that does not resume in time writes every thread's stack into its log (SIGUSR1) before it is killed, and every
launch's events go to ``launch<N>-events.jsonl`` beside the logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fault_proxy import Fault, FaultProxy, FaultRule

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "soak_worker.py"
WORLD = 2
_LAUNCHER_VARIABLES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")
_RANK_VARIABLES = {"RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"}


def weights(step: int, numel: int) -> Any:
    """The job's weights at `step`: a pure function of the step (float32, `numel` values)."""
    import torch  # only here: the harness itself runs without torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + step))


@dataclass
class SoakConfig:
    mode: str = "single"
    """``"single"`` (async S3CheckpointIO, global rank 0 saves) or ``"dcp"`` (every rank, dcp.save)."""
    kills: int = 3
    straggler_probability: float = 0.25
    straggler_launches: tuple[int, ...] | None = None
    """Which launches are left as stragglers (instead of `straggler_probability`; tests pick them)."""
    early_kill_probability: float = 0.2
    """How often the kill falls while the launch resumes (after discovery, during the load)."""
    kill_window_s: tuple[float, float] = (0.2, 2.5)
    """A kill during training falls this long after the launch resumed (uniform)."""
    final_steps: int = 4
    mib: float = 6.0
    step_s: float = 0.05
    faults: bool = True
    seed: int = 0
    launch_timeout_s: float = 180.0
    drain_every: int = 3
    """``tier``: every Nth save in memory goes to S3."""
    node_loss_every: int = 0
    """``tier``: every Nth kill also wipes a node's tier directory (0: never)."""


@dataclass
class SoakReport:
    mode: str
    kills: int = 0
    stragglers: int = 0
    early_kills: int = 0
    resumes: int = 0
    fresh_starts: int = 0
    fallbacks: int = 0
    """Resumes that skipped a newer checkpoint (it did not verify or load)."""
    steps_lost: list[int] = field(default_factory=list)
    """Per kill: the newest step the killed launch reached minus the step the relaunch resumed from."""
    faults_injected: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    uploads_left_open: int = 0
    uploads_aborted_by_gc: int = 0
    uploads_after_gc: int = 0
    failures: list[str] = field(default_factory=list)
    straggler_changes: list[str] = field(default_factory=list)
    """Stragglers' commits (after they continued) over keys the relaunch had committed (`straggler_effects`)."""
    straggler_created: int = 0
    """Commits of stragglers (after they continued) at keys the relaunch had not written: the gap fencing leaves."""
    straggler_keys_left: list[str] = field(default_factory=list)
    """Of those keys, the ones still holding the straggler's object at the end, after the relaunches' saves (and
    before ``gc``): what the owner's next save must remove (docs/fencing.md)."""
    straggler_removals: int = 0
    """Objects the relaunch had committed (and not removed itself) that a straggler's removal, once it continued,
    named and that are gone afterwards."""
    straggler_removed_keys: list[str] = field(default_factory=list)
    straggler_keys_created: list[tuple[str, int]] = field(default_factory=list)
    """Each straggler commit at a key the relaunch had not written: (``/bucket/key``, the straggler's launch)."""
    node_losses: int = 0
    resumed_from: dict[str, int] = field(default_factory=dict)
    """Rank loads by the tier each read (``memory``, ``replica``, ``s3``; two per resume)."""
    resume_seconds: list[float] = field(default_factory=list)
    """Per checked launch: seconds from its start until both ranks had resumed (process start-up included)."""
    resume_tiers: dict[str, int] = field(default_factory=dict)
    """Resumes by the tiers their ranks read, ``"<rank 0's>/<rank 1's>"`` (e.g. ``memory/replica``)."""
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return dict(vars(self))


class Launch:
    """The two rank processes of one launch and the events they print."""

    def __init__(
        self, number: int, env: dict[str, str], argv: list[str], log_dir: Path, *, nodes: bool = False,
        held: bool = False,
    ) -> None:
        """`nodes`: each rank is a node of its own (``GROUP_RANK`` = rank, one rank per node), else one node.
        `held`: the ranks start and import, then wait for `go` before they touch the process group, the tier or S3
        (the harness starts the next launch while the current one runs: start-up off the soak's clock)."""
        self.number = number
        self.log_dir = log_dir
        self.started = time.monotonic()
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.procs: list[subprocess.Popen[str]] = []
        # The rendezvous store's socket is bound and listening here, before any rank starts, and handed to rank 0
        # (``SOAK_STORE_FD``): a port picked free and bound later by rank 0 was taken meanwhile, now and then, by
        # another process's outgoing connection (EADDRINUSE at init_process_group on a busy machine).
        store = socket.create_server((env.get("MASTER_ADDR", "127.0.0.1"), 0), backlog=64)
        try:
            for rank in range(WORLD):
                rank_env = dict(
                    env,
                    RANK=str(rank),
                    LOCAL_RANK="0" if nodes else str(rank),
                    GROUP_RANK=str(rank) if nodes else "0",
                    NODE_RANK=str(rank) if nodes else "0",
                    WORLD_SIZE=str(WORLD),
                    LOCAL_WORLD_SIZE="1" if nodes else str(WORLD),
                    MASTER_PORT=str(store.getsockname()[1]),
                    TORCHELASTIC_RESTART_COUNT=str(number),
                )
                if rank == 0:
                    rank_env["SOAK_STORE_FD"] = str(store.fileno())
                if held:
                    rank_env["SOAK_HELD"] = "1"
                log = open(log_dir / f"launch{number}-rank{rank}.log", "wb")
                proc = subprocess.Popen(
                    [sys.executable, str(WORKER), *argv], stdout=subprocess.PIPE, stderr=log, env=rank_env,
                    text=True, cwd=REPO, pass_fds=(store.fileno(),) if rank == 0 else (),
                    stdin=subprocess.PIPE if held else subprocess.DEVNULL,
                )
                log.close()
                self.procs.append(proc)
                threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        finally:
            store.close()  # rank 0 holds its own copy of the socket

    def go(self) -> None:
        """Let a `held` launch's ranks run (from here on its clock runs)."""
        self.started = time.monotonic()
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):  # a rank that died while it waited: its errors tell
                    proc.stdin.write("go\n")
                    proc.stdin.close()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    event["t"] = time.monotonic()
                    self.events.put(event)

    def drain(self) -> list[dict[str, Any]]:
        while True:
            try:
                self.seen.append(self.events.get_nowait())
            except queue.Empty:
                return self.seen

    def wait_for(self, predicate: Any, timeout: float) -> dict[str, Any] | None:
        """The first event (seen or to come) matching `predicate`, or None after `timeout` or once both ranks exited."""
        deadline = time.monotonic() + timeout
        for event in self.drain():
            if predicate(event):
                return event
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.05)
            except queue.Empty:
                if all(proc.poll() is not None for proc in self.procs) and self.events.empty():
                    return None
                continue
            self.seen.append(event)
            if predicate(event):
                return event
        return None

    def signal(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def dump_stacks(self) -> None:
        """Have every live rank write all its threads' stacks into its log (a launch that hangs)."""
        self.signal(signal.SIGUSR1)
        time.sleep(1.0)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped process dies on SIGKILL too, but let it read nothing more
        self.signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=30)
        with open(self.log_dir / f"launch{self.number}-events.jsonl", "w") as out:  # seconds since `go` in "t"
            for event in self.drain():
                out.write(json.dumps(dict(event, t=round(event["t"] - self.started, 3))) + "\n")

    def newest(self, event: str) -> int:
        steps = [e["step"] for e in self.drain() if e.get("event") == event]
        return max(steps, default=0)


def launch_environment(server_env: dict[str, str], run_id: str, **extra: str) -> dict[str, str]:
    """The environment of a launch's ranks (`Launch` adds each rank's own): this process's without any launcher's
    variables, the store's keys, the repository on PYTHONPATH, torchrun's job id."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_VARIABLES) and k not in _RANK_VARIABLES}
    env.update(server_env)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",
        TORCHELASTIC_RUN_ID=run_id,
        S3CKPT_PACER_SHARING="0",
    )
    env.update(extra)
    return env


def _fault_rules(seed: int) -> list[FaultRule]:
    """503s, resets and stalled answers on uploads, commits and reads, at random (reproducibly)."""
    return [
        FaultRule(Fault.slow_down(), method="PUT", probability=0.03, seed=seed + 1),
        FaultRule(Fault.status(503, "ServiceUnavailable"), method="GET", probability=0.02, seed=seed + 2),
        FaultRule(Fault.reset_before_response(), method="PUT", query="partNumber=", probability=0.02, seed=seed + 3),
        FaultRule(Fault.reset_before_response(), method="POST", query="uploadId=", probability=0.05, seed=seed + 4),
        FaultRule(Fault.stall(0.3), method="HEAD", probability=0.02, seed=seed + 5),
        FaultRule(Fault.slow_down(), method="POST", query="delete", probability=0.05, seed=seed + 6),
    ]


def _sent_by(request: Any, agent: str) -> bool:
    """Whether `agent` (``soak-launch-N``) sent `request` and it succeeded (``soak-launch-1`` is not ``-12``)."""
    ok = request.status is not None and 200 <= request.status < 300
    return ok and re.search(re.escape(agent) + r"(?![0-9])", request.user_agent) is not None


def _commit_key(request: Any, agent: str) -> str | None:
    """The key a successful commit of `agent` made visible (a PUT of an object that is not a checksum record, or a
    CompleteMultipartUpload), else None."""
    if not _sent_by(request, agent):
        return None
    if request.method == "PUT" and "partNumber=" not in request.query:
        return None if request.path.endswith(".s3ckpt-checksum.json") else request.path
    if request.method == "POST" and "uploadId=" in request.query:
        return request.path
    return None


def _is_removal(request: Any, agent: str) -> bool:
    """A successful DeleteObjects / DeleteObject of `agent`."""
    if not _sent_by(request, agent):
        return False
    if request.method == "POST" and "delete" in request.query:
        return True
    return request.method == "DELETE" and "uploadId=" not in request.query


def _removed_keys(request: Any) -> list[str]:
    """The path-style keys (``/bucket/key``) a removal named (a DeleteObjects' body, as the proxy saw it)."""
    if request.method == "DELETE":
        return [request.path]
    bucket = request.path.strip("/").split("/")[0]
    return [f"/{bucket}/{key}" for key in getattr(request, "deleted_keys", ())]


@dataclass
class StragglerEffects:
    """What a straggler's requests did once it continued (`straggler_effects`)."""

    overwrites: list[Any] = field(default_factory=list)
    """Commits over a key the relaunch had committed before (an object, or the owner record): what must not be."""
    created: list[Any] = field(default_factory=list)
    """Commits of keys the relaunch had not written (yet): the gap fencing leaves (docs/fencing.md)."""
    removed: list[str] = field(default_factory=list)
    """Keys of the relaunch's objects (committed by it, not removed by it) that the straggler's successful
    DeleteObjects / DeleteObject named: removed unless the store refused that key's ETag condition (checked after)."""
    relaunch_removed: set[str] = field(default_factory=set)
    """Keys the relaunch's own removals named (its clean-up), at any time."""


def straggler_effects(requests: list[Any], straggler_agent: str, relaunch_agent: str) -> StragglerEffects:
    """Sort the straggler's successful mutations among `requests` (in the order the proxy saw them) by what they did
    to the relaunch's objects. A key the relaunch committed and then removed itself holds no object of the relaunch:
    a straggler's commit there is a new key, not an overwrite."""
    relaunch_keys: set[str] = set()
    effects = StragglerEffects()
    for request in requests:
        key = _commit_key(request, relaunch_agent)
        if key is not None:
            relaunch_keys.add(key)
            continue
        if _is_removal(request, relaunch_agent):
            named = _removed_keys(request)
            relaunch_keys.difference_update(named)
            effects.relaunch_removed.update(named)
            continue
        key = _commit_key(request, straggler_agent)
        if key is not None:
            (effects.overwrites if key in relaunch_keys else effects.created).append(request)
        elif _is_removal(request, straggler_agent):
            effects.removed += [key for key in _removed_keys(request) if key in relaunch_keys]
    return effects


def run_soak(
    server_env: dict[str, str], endpoint_url: str, bucket: str, prefix: str, config: SoakConfig, log_dir: Path
) -> SoakReport:
    """Run the soak against the store at `endpoint_url` (keys in `server_env`); see the module docstring."""
    import boto3  # only here: the helper module imports without the S3 extra

    import s3_checkpoint_cli

    started = time.monotonic()
    report = SoakReport(config.mode)
    rng = random.Random(config.seed)
    base = f"s3://{bucket}/{prefix.strip('/')}"
    env = launch_environment(server_env, f"soak-{config.mode}-{config.seed}")
    log_dir.mkdir(parents=True, exist_ok=True)
    tmpfs = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tier_root = Path(tempfile.mkdtemp(prefix="soak-tier-", dir=tmpfs)) if config.mode == "tier" else None
    env["SOAK_TIER_ROOT"] = str(tier_root)
    try:
        _run_launches(env, base, config, report, rng, log_dir, endpoint_url, tier_root)
    finally:
        if tier_root is not None:
            shutil.rmtree(tier_root, ignore_errors=True)
    client = boto3.client("s3", endpoint_url=endpoint_url)
    open_uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    report.uploads_left_open = len(open_uploads)
    report.straggler_keys_left = _straggler_keys_left(client, report.straggler_keys_created)
    time.sleep(1.1)  # gc aborts only what is older than --older-than (1 s), by the store's clock
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        code = s3_checkpoint_cli.main(["gc", base, "--older-than", "1s", "--yes", "--incomplete-dcp"])
    if code != 0:
        report.failures.append(f"gc exited {code}")
    left = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    report.uploads_after_gc = len(left)
    report.uploads_aborted_by_gc = report.uploads_left_open - len(left)
    if left:
        report.failures.append(f"gc left {len(left)} open upload(s): {[u['Key'] for u in left]}")
    report.seconds = time.monotonic() - started
    return report


def _run_launches(
    env: dict[str, str], base: str, config: SoakConfig, report: SoakReport, rng: random.Random, log_dir: Path,
    endpoint_url: str, tier_root: Path | None,
) -> None:
    """The launches, kills, node losses and checks of `run_soak`, through a fault-injecting proxy. Each launch is
    started (held) while the one before it runs, and let go once that one is killed."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint_url)  # the store itself, past the proxy
    with FaultProxy(endpoint_url) as proxy:
        fault_rules = _fault_rules(config.seed) if config.faults else []
        for rule in fault_rules:
            proxy.add_rule(rule)
        env["AWS_ENDPOINT_URL_S3"] = proxy.endpoint_url

        def start(number: int) -> Launch:
            argv = [base, config.mode, str(10**6), "--mib", str(config.mib), "--step-s", str(config.step_s)]
            argv += ["--drain-every", str(config.drain_every)]
            if number == config.kills:
                argv += ["--more", str(config.final_steps)]
            return Launch(number, env, argv, log_dir, nodes=config.mode == "tier", held=True)

        floor = 0  # the newest "-last" step any killed launch reported durable
        tier_floor = 0  # tier: the newest step every rank can load from memory or a replica (after the node loss)
        progress = 0  # the newest step any launch reached
        straggler: Launch | None = None
        following: Launch | None = start(0)
        try:
            for number in range(config.kills + 1):
                final = number == config.kills
                launch = following
                assert launch is not None
                launch.go()
                following = None if final else start(number + 1)  # imports while this one runs
                stays = (
                    number in config.straggler_launches
                    if config.straggler_launches is not None
                    else rng.random() < config.straggler_probability
                )
                early = not final and not stays and straggler is None and rng.random() < config.early_kill_probability
                if early:  # kill it while it loads: after discovery, at a random instant of the load
                    if launch.wait_for(lambda e: e.get("event") == "resuming", config.launch_timeout_s) is None:
                        report.failures.append(f"launch {number} did not start resuming: {_errors(launch)}")
                        launch.dump_stacks()
                    time.sleep(rng.uniform(0.0, 0.3))
                    report.early_kills += 1
                else:
                    _check_resume(launch, config, report, max(floor, tier_floor), progress, tier_floor)
                if straggler is not None:
                    _release_straggler(straggler, launch, proxy, config, report, client)
                    straggler = None
                if final:
                    done = launch.wait_for(
                        lambda e: e.get("event") == "done" and e["rank"] == 0, config.launch_timeout_s
                    )
                    if done is None:
                        report.failures.append(f"launch {number}: the final launch did not finish: {_errors(launch)}")
                        launch.dump_stacks()
                    launch.kill()
                    break
                if not early:
                    time.sleep(rng.uniform(*config.kill_window_s))
                errors = _errors(launch)
                if errors:
                    report.failures.append(f"launch {number} failed before its kill: {errors}")
                if stays:
                    launch.signal(signal.SIGSTOP)
                    straggler = launch
                    report.stragglers += 1
                else:
                    launch.kill()
                report.kills += 1
                floor = max(floor, launch.newest("durable"))
                progress = max(progress, launch.newest("step"), launch.newest("durable"))
                if tier_root is not None and config.node_loss_every and report.kills % config.node_loss_every == 0:
                    if straggler is None:  # a node lost: its own copies and the replicas it held are gone
                        shutil.rmtree(tier_root / f"node{report.node_losses % WORLD}", ignore_errors=True)
                        report.node_losses += 1
                if tier_root is not None:  # a straggler still writes: no floor
                    tier_floor = newest_replica_step(tier_root / "node1") if straggler is None else 0
        finally:
            for left in (following, straggler):
                if left is not None:
                    left.kill()
        report.faults_injected = sum(rule.fired for rule in fault_rules)
        for request in proxy.requests:
            if request.fault:
                kind = request.fault.split(":")[0]
                report.faults_by_kind[kind] = report.faults_by_kind.get(kind, 0) + 1
        report.requests = len(proxy.requests)


def _errors(launch: Launch) -> list[str]:
    return [f"rank {e['rank']}: {e['type']}: {e['message'][:300]}" for e in launch.drain() if e.get("event") == "error"]


def newest_replica_step(node: Path) -> int:
    """The newest step of the replicas that count on `node` (a manifest beside them; 0: none), read from their commit
    records. Node 1 holds node 0's replicas, so every rank can load that step from a tier: rank 1 its replica, rank 0
    its own memory copy or the replica fetched from node 1 (a replaced node)."""
    import s3_memory_tier
    import s3_tier_replication

    steps = [0]
    for manifest in node.glob(f"*/*/replicas/*/*{s3_tier_replication.MANIFEST_SUFFIX}"):
        with contextlib.suppress(OSError, ValueError):
            replica = json.loads(manifest.read_text())
            records = [name for name in replica["files"] if name.endswith(s3_memory_tier.COMMIT_RECORD_SUFFIX)]
            record = json.loads((manifest.parent / replica["name"] / records[0]).read_text())
            steps.append(int(record["step"]))
    return max(steps)


def _check_resume(
    launch: Launch, config: SoakConfig, report: SoakReport, floor: int, progress: int, tier_floor: int = 0
) -> None:
    """Wait for both ranks' "resumed" events and check them (`tier_floor`: the newest step every rank can load from
    a memory tier, read there from memory or a replica, never S3)."""
    resumed = []
    for rank in range(WORLD):
        event = launch.wait_for(
            lambda e, r=rank: e.get("event") == "resumed" and e["rank"] == r, config.launch_timeout_s
        )
        if event is None:
            report.failures.append(f"launch {launch.number}: rank {rank} did not resume: {_errors(launch)}")
            launch.dump_stacks()
            return
        resumed.append(event)
    report.resume_seconds.append(round(max(e["t"] for e in resumed) - launch.started, 2))
    steps = {e["step"] for e in resumed}
    urls = {e["url"] for e in resumed}
    step = resumed[0]["step"]
    if len(steps) > 1 or len(urls) > 1:
        report.failures.append(f"launch {launch.number}: the ranks resumed from different checkpoints: {resumed}")
    if not all(e["exact"] for e in resumed):
        report.failures.append(f"launch {launch.number}: resumed weights differ from the closed form at step {step}")
    if step < floor:
        report.failures.append(
            f"launch {launch.number}: resumed from step {step}, older than step {floor} a killed launch saw durable "
            f"or that survives in memory on both nodes (step {tier_floor})"
        )
    tiers = [str(e.get("tier")) for e in resumed]
    if tier_floor and step == tier_floor and (tiers[1] != "replica" or tiers[0] not in ("memory", "replica")):
        report.failures.append(
            f"launch {launch.number}: step {step} is in memory on both nodes, but the ranks read it from {tiers}"
        )
    if resumed[0]["url"] is None:
        report.fresh_starts += 1
    else:
        report.resumes += 1
    report.fallbacks += any(e["skipped"] for e in resumed)
    if resumed[0]["url"] is not None:
        for tier in tiers:
            report.resumed_from[tier] = report.resumed_from.get(tier, 0) + 1
        report.resume_tiers["/".join(tiers)] = report.resume_tiers.get("/".join(tiers), 0) + 1
    if launch.number:
        report.steps_lost.append(max(0, progress - step))


def _holds_object(client: Any, path: str) -> bool:
    """Whether ``/bucket/key`` holds an object (asked of the store itself, not through the proxy)."""
    bucket, key = path.lstrip("/").split("/", 1)
    try:
        client.head_object(Bucket=bucket, Key=key)
    except Exception as exc:
        if getattr(exc, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return True


def _straggler_keys_left(client: Any, created: list[tuple[str, int]]) -> list[str]:
    """The keys stragglers created that still hold a straggler's object (its metadata names that launch's run)."""
    left = []
    for path, number in dict.fromkeys(created):
        bucket, key = path.lstrip("/").split("/", 1)
        try:
            metadata = client.head_object(Bucket=bucket, Key=key).get("Metadata", {})
        except Exception as exc:
            if getattr(exc, "response", {}).get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                continue
            raise
        run = urllib.parse.unquote(metadata.get("s3ckpt-run", "")).rpartition(" ")[2]
        if run.endswith(f"#{number}"):
            left.append(path)
    return left


def _release_straggler(
    straggler: Launch, relaunch: Launch, proxy: FaultProxy, config: SoakConfig, report: SoakReport, client: Any
) -> None:
    """Once the relaunch has saved, let the straggler run for a while, then kill it; count what it changed."""
    saved = relaunch.wait_for(lambda e: e.get("event") == "durable", config.launch_timeout_s)
    if saved is None:
        report.failures.append(f"launch {relaunch.number} saved nothing while a straggler waited: {_errors(relaunch)}")
    mark = len(proxy.requests)
    straggler.signal(signal.SIGCONT)
    time.sleep(1.5)
    straggler.kill()
    straggler_agent, relaunch_agent = f"soak-launch-{straggler.number}", f"soak-launch-{relaunch.number}"
    seen = [r for i, r in enumerate(proxy.requests) if i >= mark or _sent_by(r, relaunch_agent)]
    effects = straggler_effects(seen, straggler_agent, relaunch_agent)
    report.straggler_created += len(effects.created)
    report.straggler_keys_created += [(request.path, straggler.number) for request in effects.created]
    gone = [key for key in effects.removed if key not in effects.relaunch_removed and not _holds_object(client, key)]
    report.straggler_removals += len(gone)
    report.straggler_removed_keys += gone
    if effects.overwrites:
        described = [f"{r.method} {r.path}?{r.query} -> {r.status}" for r in effects.overwrites[:5]]
        report.straggler_changes.append(f"straggler launch {straggler.number} overwrote: {described}")

"""The ``s3-checkpoint-io demo`` command: a small Lightning job checkpoints to S3, is killed part way, and a new job
resumes from the checkpoint global rank 0 finds; then a report of what was written, how fast, how long training was
blocked, and whether the resumed weights are the saved ones.

It measures through what the library exposes (`S3CheckpointIO.records`), and starts a local server from
`s3_local_servers` when no ``--dirpath`` is given. Imported by the CLI only when the demo runs, so the operator
commands never pay for torch and Lightning.

Package-internal (docs/api.md): the ``s3-checkpoint-io demo`` command is its interface.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

if __package__:
    from . import s3_checkpoint_admin as _admin
    from . import s3_checkpoint_cli as _cli
    from . import s3_dirpath_utils as _urls
    from . import s3_local_servers as _servers
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_checkpoint_admin as _admin
    import s3_checkpoint_cli as _cli
    import s3_dirpath_utils as _urls
    import s3_local_servers as _servers
    import s3_process as _process
    import s3_utils as _s3

__all__: list[str] = []  # no public names: see docs/api.md

logger = logging.getLogger(__name__)

PROG = _cli.PROG
CliError = _cli.CliError
DEMO_BUCKET = "s3ckpt-demo"


@dataclasses.dataclass
class _DemoStats:
    """What the demo measures while the Trainers run, besides the plugin's own `S3CheckpointIO.records`."""

    records: list[Any] = dataclasses.field(default_factory=list)  # TransferRecords of both jobs' plugins
    callback_s: float = 0.0  # time the training loop spent in the checkpoint callback's hooks
    resumed_state: dict[str, Any] | None = None  # state_dict of the checkpoint job 2 loaded (cloned)


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
        pl = _process.import_optional_dependency("pytorch_lightning", "the demo")
    return pl


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
    """A two-layer model learning ``y = sin(x)`` on fixed random data; records its weights when training starts and
    the weights of the checkpoint it was restored from."""

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
            self.loaded: dict[str, Any] | None = None

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, targets = batch
            loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
            self.log("train_loss", loss, prog_bar=False)
            self.losses[self.global_step + 1] = loss.detach().item()
            return loss

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            state = checkpoint.get("state_dict", {})
            self.loaded = {name: tensor.detach().clone() for name, tensor in state.items()}

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


def build_trainer(pl: Any, max_steps: int, **trainer_kwargs: Any) -> Any:
    """A quiet single-process CPU ``pl.Trainer`` (no logger, progress bar, model summary or sanity validation) for
    `max_steps` steps; `trainer_kwargs` add to or override these (``plugins``, ``callbacks``, ``strategy``...).
    The demo's jobs and the test suite's tiny Lightning runs are all built by it."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**settings, **trainer_kwargs})


def _start_server(name: str) -> contextlib.AbstractContextManager[_servers.LocalS3]:
    """The embedded server `name` on 127.0.0.1 with throw-away keys; SeaweedFS refuses to wait for another one."""
    if name == "seaweedfs":
        return _servers.seaweedfs_server(lock="fail")
    return _servers.moto_server()


def _run_demo(
    dirpath: str,
    plan: _DemoPlan,
    async_saves: bool,
    settings: _s3.S3ClientSettings,
    retry_policy: _s3.RetryPolicy | None,
) -> dict[str, Any]:
    """Job 1 (killed part way), then job 2 (resumed from S3 on rank 0); returns what the report needs."""
    torch = _process.import_optional_dependency("torch", "the demo")
    pl = _lightning()
    if __package__:
        from . import connector
        from . import s3_checkpoint_io as ckpt_io
    else:
        import connector
        import s3_checkpoint_io as ckpt_io
    stats = _DemoStats()
    s3 = _s3.S3Utils(settings, retry_policy)
    plugins: list[Any] = []
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
        plugin = ckpt_io.S3CheckpointIO(
            dirpath, chunk_size_MB=chunk_MB, async_checkpointing=async_saves, max_saves_in_flight=2, s3_utils=s3
        )
        plugins.append(plugin)
        return build_trainer(pl, max_steps, plugins=[plugin], callbacks=[*extra, checkpoint])

    snapshots: dict[int, dict[str, Any]] = {}
    job1 = model_class()
    weights = 2 * plan.width * (plan.width + 1) * 4
    print(
        f"job 1     trains a 2-layer MLP ({_cli.human_size(weights)} of weights, Adam) for {plan.steps} steps, "
        "saving to "
        f"{dirpath}/ every {plan.every} step(s) ({'async' if async_saves else 'sync'}, save_top_k=2, save_last) ...",
        flush=True,
    )
    started = time.perf_counter()
    try:
        trainer(plan.steps, [_kill_callback(pl, plan, snapshots)]).fit(job1)
    except _SimulatedKillError:
        pass
    else:
        raise CliError(_cli.EXIT_INTERNAL, "job 1 finished although it should have been killed")
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
        raise CliError(_cli.EXIT_INTERNAL, f"job 2 found no checkpoint to resume from under {dirpath}")
    print(f"job 2     a new Trainer: rank 0 found {resume_from}; resuming ...", flush=True)
    started = time.perf_counter()
    job2_trainer.fit(job2)
    job2_s = time.perf_counter() - started
    print(f"          ... finished at step {job2_trainer.global_step} after {job2_s:.1f} s", flush=True)

    for plugin in plugins:
        plugin.teardown()  # Lightning has by now; this only makes sure every record is in
        stats.records.extend(plugin.records)
    stats.resumed_state = job2.loaded
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
    uploads = [record for record in stats.records if record.kind == "save"]
    present = {entry.url: entry for entry in _admin.list_checkpoints(dirpath, s3_utils=s3)}
    by_url: dict[str, list[Any]] = {}
    for upload in uploads:
        by_url.setdefault(upload.url, []).append(upload)
    total = sum(u.size for u in uploads)
    print(f"\n== report ==\ncheckpoints written to {dirpath}/ ({len(uploads)} uploads, {_cli.human_size(total)}):")
    print(f"  {'KEY':22}  {'SIZE':>8}  {'CHECKSUM (last upload)':24}  {'UPLOADS':>7}  NOW")

    def order(url: str) -> tuple[int, int, datetime.datetime]:
        step, kind = _admin.classify_checkpoint(_urls.s3_url_name(url))
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
        size, checksum = _cli.human_size(latest.size), latest.checksum or "-"
        print(f"  {name:22}  {size:>8}  {checksum:24}  {len(by_url[url]):>7}  {now}")
    busy = sum(u.seconds for u in uploads)
    if uploads and busy > 0:
        fastest, slowest = min(u.seconds for u in uploads), max(u.seconds for u in uploads)
        where = "in the background" if async_saves else "in the training loop"
        _say(
            "save",
            f"{total / _s3.MB / busy:.1f} MiB/s per checkpoint, {where}: torch.save streams into a checksummed "
            f"multipart upload ({fastest:.2f}-{slowest:.2f} s each)",
        )
    for load in (record for record in stats.records if record.kind == "load"):
        _say(
            "load",
            f"{_urls.s3_url_name(load.url)}, {_cli.human_size(load.size)} in {load.seconds:.2f} s = "
            f"{load.size / _s3.MB / max(load.seconds, 1e-9):.1f} MiB/s: parallel ranged GETs, checksum verified, "
            "torch.load(mmap=True)",
        )
    calls = [upload.blocked_seconds for upload in uploads]
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
        raise CliError(_cli.EXIT_USAGE, "--endpoint-url and --create-bucket need --dirpath s3://BUCKET/PREFIX")
    if args.dirpath is not None and args.server is not None:
        raise CliError(_cli.EXIT_USAGE, "--server starts a local server: it cannot be combined with --dirpath")
    if args.steps < 4:
        raise CliError(_cli.EXIT_USAGE, f"--steps must be at least 4, got {args.steps}")
    if not 0 < args.size_mb <= 1024 * 1024:
        raise CliError(_cli.EXIT_USAGE, f"--size-mb must be positive (and at most 1 TiB), got {args.size_mb}")
    dirpath = _cli.s3_url_argument(args.dirpath, "--dirpath").rstrip("/") if args.dirpath else None
    if dirpath is not None and not _urls.parse_s3_url(dirpath)[1]:
        raise CliError(_cli.EXIT_USAGE, f"--dirpath needs a prefix inside the bucket, e.g. {dirpath}/demo")
    plan = _demo_plan(args.size_mb, args.steps)
    # Fail on a missing extra before starting anything; importing Lightning (both families the plugin registers
    # with) now also lets _quiet_training_output see all of its loggers.
    _process.import_optional_dependency("torch", "the demo")
    _lightning()
    _process.import_optional_dependency("boto3", "the demo")
    if __package__:
        from . import s3_checkpoint_io as ckpt_io
    else:
        import s3_checkpoint_io as ckpt_io
    ckpt_io.register_with_lightning(ckpt_io.S3CheckpointIO)
    server: _servers.LocalS3 | None = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_as_exit())
        stack.enter_context(_quiet_training_output(args.verbose))
        # Lightning's ModelCheckpoint gets an s3fs filesystem through fsspec, cached per process with the endpoint
        # and keys of the moment: the demo's must neither be a stale one nor outlive the demo's server.
        stack.enter_context(_s3.fresh_s3fs_instances())
        endpoint_url, region = args.endpoint_url, args.region
        if dirpath is None:
            server_name = args.server or "moto"
            started = time.perf_counter()
            stack.enter_context(_environment(None, _no_proxy_for_loopback()))
            server = stack.enter_context(_start_server(server_name))
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
        s3 = _s3.S3Utils(settings, _cli.retry_policy_argument(args))
        _prepare_bucket(s3, dirpath, create=args.create_bucket or args.dirpath is None)
        print(f"{PROG} demo: a training job checkpoints to S3, is killed part way, and a new job resumes", flush=True)
        if server is not None:
            print(started_line, flush=True)
        torch = _process.import_optional_dependency("torch", "the demo")
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(min(4, os.cpu_count() or 1))
            result = _run_demo(dirpath, plan, not args.sync, settings, _cli.retry_policy_argument(args))
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
        return _cli.EXIT_VERIFY_FAILED
    return _cli.EXIT_OK


def _prepare_bucket(s3: _s3.S3Utils, dirpath: str, *, create: bool) -> None:
    """Make sure the bucket exists (creating it if allowed) and the demo's prefix holds nothing yet."""
    bucket, _ = _urls.parse_s3_url(dirpath)
    bucket_url = _urls.build_s3_url(bucket)
    if not s3.s3_path_exists(bucket_url):
        if not create:
            raise CliError(_cli.EXIT_NOT_FOUND, f"No such bucket: {bucket_url} (create it, or pass --create-bucket)")
        kwargs: dict[str, Any] = {}
        region = s3.client.meta.region_name
        if s3.settings.endpoint_url is None and region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        s3.call("create_bucket", bucket_url, Bucket=bucket, **kwargs)
        logger.info("Created bucket %s", bucket)
    existing = s3.list_objects(dirpath)
    if existing:
        raise CliError(
            _cli.EXIT_USAGE,
            f"{dirpath}/ already holds {len(existing)} object(s); the demo needs an empty prefix, so that it "
            "resumes from its own checkpoints only: pick another --dirpath",
        )

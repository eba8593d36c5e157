"""One rank of a multi-node-on-one-host job that loads one s3:// checkpoint collectively; started once per rank by
test_load_sharing.py (and benchmarks/bench_resume.py).

The parent sets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT): GROUP_RANK is the "node", so 2 nodes x 2 local ranks run on one machine. Every S3 request carries
``rank/<N>`` in its User-Agent, so the fault proxy can attribute it.

Modes (``--mode``):
  load     init gloo, then ``with io.collective_load(): io.load_checkpoint(url)`` (the explicit collective call),
           once per ``--scenarios`` entry
  trainer  a Lightning DDP Trainer resumes from ``--url`` through the connector (``configure_s3_checkpointing``),
           once per mode of ``--sharing`` (comma-separated), each in a new Trainer in this one process (one launch
           instead of one per mode: each rank imports Lightning once); ``{sharing}`` in ``--url`` names the mode
  nemo     NeMo's load: download_fileobj into a BytesIO, then torch.load from it (no sharing); benchmark only
  save     one process trains ``--max-steps`` and saves a Lightning checkpoint with a ``--payload-mib`` tensor (to
           each URL ``--url`` names with ``{sharing}`` set to a mode of ``--sharing``)

Writes ``<out>/rank<N>.json``: outcome (or the error's type and message), seconds from the start of the load until
it returned, PSS before and while holding the state, what was loaded (sums of tensors), GETs and bytes it received.
In trainer mode the per-load entries are under ``"resumes"``, by mode.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other test helpers (tiny_lightning)


def pss() -> int:
    import psutil

    return psutil.Process().memory_full_info().pss


def fingerprint(checkpoint: Any) -> dict[str, float]:
    """Sums of every tensor (in float64) by its key path: what a rank holds, cheap to compare across ranks."""
    import torch

    out: dict[str, float] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            out[path] = float(value.double().sum())
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}/{index}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[path] = float(value)

    walk(checkpoint, "")
    return out


def write_report(args: argparse.Namespace, rank: int, report: dict[str, Any]) -> None:
    """``<out>/rank<N>.json``, replaced whole: the test may read it while this rank is being killed."""
    partial = Path(args.out, f".rank{rank}.json.partial")
    partial.write_text(json.dumps(report))
    os.replace(partial, Path(args.out, f"rank{rank}.json"))


def count_gets(client: Any, counters: dict[str, int]) -> None:
    """Count this process's GetObject calls and body bytes (client side, for the benchmark)."""

    def after_call(http_response: Any = None, parsed: Any = None, **_: Any) -> None:
        counters["gets"] += 1
        counters["bytes"] += int((parsed or {}).get("ContentLength", 0) or 0)

    client.meta.events.register("after-call.s3.GetObject", after_call)


def make_io(args: argparse.Namespace, rank: int, sharing: str, endpoint_url: str | None = None) -> Any:
    from s3_checkpoint_io import S3CheckpointIO
    from s3_utils import RetryPolicy, S3ClientSettings, S3Utils

    key = endpoint_url
    if key not in _S3_UTILS:  # one client per endpoint: building one costs a second of CPU
        settings = S3ClientSettings(
            endpoint_url=endpoint_url,
            user_agent_extra=f"rank/{rank}",
            read_timeout_s=args.read_timeout,
            connect_timeout_s=2,
            max_pool_connections=8,
        )
        policy = RetryPolicy(max_attempts=args.attempts, max_elapsed_s=args.retry_s, initial_backoff_s=0.2)
        _S3_UTILS[key] = S3Utils(settings, policy)
    return S3CheckpointIO(
        chunk_size_MB=args.chunk, max_read_concurrency=args.concurrency, load_sharing=sharing, s3_utils=_S3_UTILS[key]
    )


_S3_UTILS: dict[str | None, Any] = {}


def run_load(args: argparse.Namespace, rank: int, report: dict[str, Any]) -> None:
    """Each scenario of ``--scenarios`` (a JSON list of ``{"name", "sharing"[, "url"][, "endpoint"][, "solo_rank"]
    [, "shared_dir"]}``) in turn, in one process group: the ranks that fail report why and go on to the next one."""
    import torch.distributed as dist

    import s3_node_sharing

    scenarios = json.loads(args.scenarios) if args.scenarios else [{"name": "load", "sharing": args.sharing}]
    counters = {"gets": 0, "bytes": 0}
    count_gets(make_io(args, rank, "rank").s3.client, counters)  # built now: its memory is not the load's
    dist.init_process_group("gloo")
    report["scenarios"] = {}
    for scenario in scenarios:
        io = make_io(args, rank, scenario["sharing"], scenario.get("endpoint"))
        s3_node_sharing.SHARED_FILE_DIR = scenario.get("shared_dir", "/dev/shm")
        url = scenario.get("url", args.url)
        solo_rank = scenario.get("solo_rank")
        outcome: dict[str, Any] = {}
        dist.barrier()
        counters.update(gets=0, bytes=0)
        outcome["pss_before"] = pss()
        outcome["started"] = time.time()
        started = time.perf_counter()
        checkpoint = None
        try:
            if solo_rank is None:
                with io.collective_load():
                    checkpoint = io.load_checkpoint(url, weights_only=False)
            elif rank == solo_rank:  # a load on one rank alone, e.g. from a callback: must not wait for others
                checkpoint = io.load_checkpoint(url, weights_only=False)
        except Exception as exc:
            message = " ".join([str(exc), *getattr(exc, "__notes__", [])])
            outcome["error"] = {"type": type(exc).__name__, "message": message, "trace": traceback.format_exc()}
        outcome["load_s"] = time.perf_counter() - started
        outcome["loaded_at"] = time.time()
        if checkpoint is not None:
            outcome["fingerprint"] = fingerprint(checkpoint)  # reads every page
        outcome.update(counters)
        report["scenarios"][scenario["name"]] = outcome
        write_report(args, rank, report)  # before a collective a dead rank fails
        if solo_rank is None and "error" not in outcome:
            dist.barrier()  # PSS splits shared pages among the processes mapping them: read it once all have
            outcome["pss_during"] = pss()
            write_report(args, rank, report)
        dist.barrier()  # the others' PSS is read while this rank still holds the state
        del checkpoint
    dist.destroy_process_group()


def run_nemo(args: argparse.Namespace, rank: int, report: dict[str, Any]) -> None:
    import io

    import boto3
    import torch
    import torch.distributed as dist
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.client("s3", config=Config(s3={"addressing_style": "path"}, user_agent_extra=f"rank/{rank}"))
    counters = {"gets": 0, "bytes": 0}
    count_gets(client, counters)
    bucket, _, key = args.url.removeprefix("s3://").partition("/")
    dist.init_process_group("gloo")
    dist.barrier()
    report["pss_before"] = pss()
    report["started"] = time.time()
    started = time.perf_counter()
    buffer = io.BytesIO()
    client.download_fileobj(
        bucket, key, buffer, Config=TransferConfig(multipart_chunksize=64 << 20, max_concurrency=15)
    )
    buffer.seek(0)
    checkpoint = torch.load(buffer, map_location="cpu", weights_only=False)
    del buffer
    report["load_s"] = time.perf_counter() - started
    report["loaded_at"] = time.time()
    report["pss_during"] = pss()
    report["fingerprint"] = fingerprint(checkpoint)
    report.update(counters)
    write_report(args, rank, report)
    dist.barrier()
    dist.destroy_process_group()


def mode_urls(args: argparse.Namespace) -> dict[str, str]:
    """Each mode of ``--sharing`` and its checkpoint: ``--url`` with ``{sharing}`` set to the mode."""
    return {mode: args.url.replace("{sharing}", mode) for mode in args.sharing.split(",")}


def measured_module_class(base: type, resume: dict[str, Any]) -> type:
    """`base` recording into `resume` when the resume starts and while Lightning holds the loaded checkpoint."""

    class Module(base):  # type: ignore[misc, valid-type]
        def setup(self, stage: str) -> None:
            self.trainer.strategy.checkpoint_io.s3.client  # noqa: B018 - built before the PSS baseline
            resume["pss_before"] = pss()
            resume["started"] = time.time()

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            resume["loaded_at"] = time.time()
            resume["payload_sha256"] = hashlib.sha256(checkpoint["payload"].numpy()).hexdigest()  # reads every page
            self.trainer.strategy.barrier()  # PSS splits shared pages among the processes mapping them: all have now
            resume["pss_during"] = pss()  # Lightning holds the whole loaded checkpoint here

    return Module


def run_trainer(args: argparse.Namespace, rank: int, report: dict[str, Any]) -> None:
    import gc

    import lightning.pytorch as pl
    from tiny_lightning import close_process_group, tiny_module_class

    import connector
    from s3_utils import S3ClientSettings

    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    base = tiny_module_class(pl, outputs=2, seed=1234 + rank, samples=256, data_seed=7)
    report["resumes"] = {}
    for sharing, url in mode_urls(args).items():  # a new Trainer and module per mode, as a new launch would make
        resume: dict[str, Any] = {}
        Module = measured_module_class(base, resume)
        config = {
            "s3_checkpointing": {
                "max_write_concurrency": 2,
                "max_read_concurrency": args.concurrency,
                "chunk_size_MB": args.chunk,
                "enable_async_checkpointing": False,
                "load_sharing": sharing,
            },
            "exp_manager": {  # saves nothing: the test is about the load
                "checkpoint_callback_params": {"dirpath": url.rpartition("/")[0], "save_top_k": 0, "save_last": False}
            },
        }
        trainer = pl.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=local_world_size,
            num_nodes=world_size // local_world_size,
            max_steps=int(args.max_steps),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=True,
        )
        settings = S3ClientSettings(user_agent_extra=f"rank/{rank}", max_pool_connections=8)
        connector.configure_s3_checkpointing(trainer, config, client_settings=settings)
        model = Module()
        trainer.fit(model, ckpt_path=url)
        start = model.started_at
        assert start is not None
        resume["start"] = {
            "global_step": start["global_step"],
            "ckpt_path": start["ckpt_path"],
            "weights": {name: tensor.tolist() for name, tensor in start["weights"].items()},
            "exp_avg": {str(k): state["exp_avg"].tolist() for k, state in start["optimizer_state"].items()},
        }
        resume["node_rank"] = trainer.node_rank
        report["resumes"][sharing] = resume
        write_report(args, rank, report)
        del trainer, model, start
        gc.collect()  # the next mode's PSS baseline without this one's checkpoint
        trainer_barrier()
    close_process_group()  # Lightning leaves it open: alive at exit, it can abort a finished rank


def trainer_barrier() -> None:
    """Every rank done with one mode before any starts the next (the next Trainer reuses the process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_save(args: argparse.Namespace, rank: int, report: dict[str, Any]) -> None:
    """One process trains a few steps and saves a Lightning checkpoint carrying a ``--payload-mib`` tensor."""
    import lightning.pytorch as pl
    import torch
    from tiny_lightning import tiny_module_class

    from s3_checkpoint_io import S3CheckpointIO

    base = tiny_module_class(pl, outputs=2, seed=99, samples=256, data_seed=7)

    class Module(base):  # type: ignore[misc, valid-type]
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            generator = torch.Generator().manual_seed(5)
            checkpoint["payload"] = torch.randn(int(args.payload_mib * 2**18), generator=generator)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        plugins=[S3CheckpointIO(chunk_size_MB=args.chunk)],
    )
    trainer.fit(Module())
    for url in dict.fromkeys(mode_urls(args).values()):
        trainer.save_checkpoint(url)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["load", "trainer", "nemo", "save"], required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sharing", default="node")
    parser.add_argument("--chunk", type=float, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--retry-s", type=float, default=5.0)
    parser.add_argument("--read-timeout", type=float, default=20.0)
    parser.add_argument("--max-steps", type=int, default=1)
    parser.add_argument("--payload-mib", type=float, default=64)
    parser.add_argument("--scenarios", help="load mode: JSON list of loads to make in turn (see run_load)")
    args = parser.parse_args()
    if args.mode == "load":  # no Trainer: spare each rank the import of Lightning an S3CheckpointIO would make
        from lightning_stand_in import stand_in_for_lightning

        stand_in_for_lightning()
    rank = int(os.environ["RANK"])
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "node": int(os.environ["GROUP_RANK"])}
    modes = {"load": run_load, "trainer": run_trainer, "nemo": run_nemo, "save": run_save}
    modes[args.mode](args, rank, report)


if __name__ == "__main__":
    main()

"""The megatron-core checks on a GPU machine, without any CUDA stand-in (tests/gpu/run_gpu_checks.sh runs this).

The scenarios of tests/test_mcore.py (tests/helpers/mcore_worker.py) on CUDA tensors, against moto behind the fault
proxy, in up to three launches:

1. ``nccl``: NCCL, one rank per GPU (2 ranks with 2+ GPUs; 1 rank on a single GPU: NCCL refuses two ranks on one
   device), with megatron-core's ``FullyParallelLoadStrategyWrapper`` (NeMo's ``ckpt_parallel_load``);
2. ``gloo-cuda``: 2 gloo ranks sharing GPU 0 (CUDA tensors; megatron-core's async queue then synchronises CUDA and
   all-reduces CUDA tensors for real) -- only with a single GPU, where the NCCL launch has 1 rank;
3. ``reshard``: 1 NCCL rank loads what 2 ranks saved.

Writes ``$OUT/gpu-checks.json`` (every scenario's outcome per rank and a verdict) and prints a summary; exits 1 if a
check failed. Needs torch with CUDA, megatron-core, boto3 and moto (installed by the shell script).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "tests" / "helpers"
sys.path[:0] = [str(REPO), str(HELPERS)]

SCENARIOS = [
    "sync",
    "metadata",
    "fully_parallel",
    "async",
    "async_persistent",
    "fault_sync",
    "fault_async",
    "overwrite_fail",
    "overwrite_refused",
    "load_previous",
    "from_stock",
    "to_stock",
    "fencing",
    "throttled",
    "nemo_io",
    "default_strategy",
    "main_replica",
    "parallel_load",  # before `overwrite` replaces the checkpoint it loads
    "overwrite",
]
ON_CPU = os.environ.get("S3CKPT_GPU_CHECKS_ON_CPU") == "1"
"""Dry run on a CPU-only machine (gloo, CPU tensors; megatron-core's own CUDA calls stood in for by the worker):
checks this script, not CUDA; ``async_persistent`` and ``parallel_load`` need CUDA and fail there. Never set on the
GPU machine."""
EXPECTED_FAILURES = {"fault_sync", "fault_async", "overwrite_fail", "overwrite_refused", "fencing"}
"""Scenarios whose second save must fail on every rank with a CheckpointException."""


def _launch(name: str, world: int, backend: str, scenarios: list[str], base: str, server: Any, out: Path, extra=()):
    from fault_proxy import Fault, FaultProxy, FaultRule

    folder = base.split("/", 3)[3]
    with FaultProxy(server.endpoint_url) as proxy:
        last = world - 1  # the last rank's file fails (rank 0's alone with 1 rank)
        for failing in ("iter_0000040", "iter_0000041", "iter_0000050"):
            failing_file = rf"/{folder}/{failing}/__{last}_0\.distcp$"
            proxy.add_rule(FaultRule(Fault.status(500), method="PUT", path_regex=failing_file))
        throttled = rf"/{folder}/throttled/__\d_0\.distcp$"
        proxy.add_rule(FaultRule(Fault.slow_down(), method="PUT", path_regex=throttled, times=3))
        env = {**os.environ, **server.env()}
        env["PYTHONPATH"] = os.pathsep.join([str(HELPERS), str(REPO), env.get("PYTHONPATH", "")])
        command = [sys.executable, "-m", "mcore_worker", "--world-size", str(world), "--scenarios", ",".join(scenarios)]
        command += ["--base", base, "--endpoint", proxy.endpoint_url, "--direct-endpoint", server.endpoint_url]
        if ON_CPU:  # a dry run of this script on a machine without CUDA (with the test stand-in)
            backend, device = "gloo", "cpu"
        else:
            device = "cuda"
        command += ["--out", str(out), "--backend", backend, "--device", device, *extra]
        started = time.monotonic()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
        seconds = round(time.monotonic() - started, 1)
    print(f"== {name}: {world} rank(s), {backend}, rc {done.returncode}, {seconds} s", flush=True)
    outcomes: dict[str, Any] = {}
    for scenario in scenarios:
        ranks = []
        for rank in range(world):
            path = out / f"{scenario}-rank{rank}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "error": "no outcome"})
        outcomes[scenario] = {"ranks": ranks, "passed": _passed(scenario, ranks)}
        verdict = "PASS" if outcomes[scenario]["passed"] else "FAIL"
        detail = "" if outcomes[scenario]["passed"] else f" {[(r.get('error') or r.get('differences')) for r in ranks]}"
        print(f"   {verdict} {scenario}{detail[:1500]}", flush=True)
    return {"world": world, "backend": backend, "rc": done.returncode, "seconds": seconds, "scenarios": outcomes,
            "stderr_tail": done.stderr[-4000:] if done.returncode else ""}


def _passed(scenario: str, ranks: list[dict[str, Any]]) -> bool:
    if not all(r.get("ok") and r.get("differences") == [] for r in ranks):
        return False
    if scenario in EXPECTED_FAILURES:
        return all(str(r.get("error", "")).startswith("CheckpointException") for r in ranks)
    return True


def main() -> int:
    import torch

    import s3_local_servers

    out_dir = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-checks-"))
    gpus = 1 if ON_CPU else torch.cuda.device_count()
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (dry run on CPU)",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "launches": {},
    }
    try:
        import importlib.metadata

        from mcore_stub import stand_in_for_triton_leaf

        stand_in_for_triton_leaf()  # only where triton is missing (a dry run on CPU)

        import megatron.core

        report["megatron_core"] = importlib.metadata.version("megatron-core")
        del megatron
    except Exception as exc:  # reported; the launches will fail the same way
        report["megatron_core"] = f"import failed: {exc!r}"
    if not gpus:
        print("no CUDA device: nothing to check", flush=True)
        report["verdict"] = "no GPU"
        (out_dir / "gpu-checks.json").write_text(json.dumps(report, indent=2, default=str))
        return 1
    with s3_local_servers.moto_server() as server, tempfile.TemporaryDirectory() as scratch:
        client = server.client()
        client.create_bucket(Bucket="gpu-checks")
        runs = report["launches"]
        nccl_world = 2 if gpus >= 2 else 1
        if gpus == 1:
            runs["gloo-cuda"] = _launch(
                "gloo-cuda", 2, "gloo", SCENARIOS, "s3://gpu-checks/gloo", server, Path(scratch, "gloo")
            )
        runs["nccl"] = _launch(
            "nccl", nccl_world, "nccl", SCENARIOS, "s3://gpu-checks/nccl", server, Path(scratch, "nccl")
        )
        saved_by_two = "s3://gpu-checks/gloo" if gpus == 1 else "s3://gpu-checks/nccl"
        runs["reshard"] = _launch(
            "reshard", 1, "nccl", ["reshard"], "s3://gpu-checks/reshard", server, Path(scratch, "reshard"),
            ["--reshard-base", saved_by_two],
        )
    failed = [f"{name}:{scenario}" for name, run in runs.items() for scenario, o in run["scenarios"].items()
              if not o["passed"]]
    report["failed"] = failed
    report["verdict"] = "all passed" if not failed else f"{len(failed)} failed"
    (out_dir / "gpu-checks.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"verdict: {report['verdict']} {failed}", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())

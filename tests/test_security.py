"""Security: no secrets in our logs or errors, safe unpickling by default, no shell, servers on loopback only.

What botocore itself does (documented here, not asserted, since it is botocore's behaviour and varies by version): at
DEBUG level the ``botocore`` loggers print every request's headers, including the session token
(``X-Amz-Security-Token``) and the SigV4 ``Authorization`` header with its signature and access key id; they never
print the secret access key itself. So nobody should run botocore at DEBUG with real temporary credentials. The tests
below assert that *our* loggers (``s3_utils``, ``s3_checkpoint_io``, ``connector``, ``s3_checkpoint_cli``), our
exception messages and our CLI output never contain the secret key, the session token, a signature or a presigned
query, and that the secret key appears nowhere at all, botocore's DEBUG output included.
"""

from __future__ import annotations

import ast
import io
import logging
import os
import pickle
import re
import shlex
import subprocess
import sys
import traceback
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from fault_proxy import Fault, FaultProxy, FaultRule
from s3_servers import S3Endpoint, seaweedfs_process

import connector
import s3_checkpoint_cli as cli
from s3_checkpoint_io import S3CheckpointIO
from s3_local_servers import moto_server, weed_command
from s3_utils import RetryPolicy, S3ClientSettings

REPO = Path(__file__).resolve().parents[1]
PACKAGE_MODULES = [
    "s3_dirpath_utils.py",
    "s3_utils.py",
    "s3_checkpoint_io.py",
    "connector.py",
    "s3_node_sharing.py",
    "s3_tier_replication.py",
    "s3_local_servers.py",
    "s3_checkpoint_admin.py",
    "s3_checkpoint_cli.py",
    "s3_checkpoint_demo.py",
]
OUR_LOGGERS = (
    "s3_utils",
    "s3_checkpoint_io",
    "connector",
    "s3_node_sharing",
    "s3_tier_replication",
    "s3_checkpoint_admin",
    "s3_checkpoint_cli",
    "s3_dirpath_utils",
)
FAST = RetryPolicy(max_attempts=3, max_elapsed_s=5.0, initial_backoff_s=0.01, max_backoff_s=0.05)
MiB = 1024 * 1024

ACCESS_KEY = "AKIAS3CKPTLEAKTEST01"
SECRET_KEY = "s3ckpt/Secret+Key/NEVER-LOG-ME-Zq9Zq9Zq9Zq9Zq9Zq9"
SESSION_TOKEN = "FwoGZXIvYXdzEs3ckptSessionTokenNEVERLOGME" + "Kx7Qw2" * 12
SIGNATURE = re.compile(r"Signature=([0-9a-f]{64})")
PRESIGNED_QUERY = re.compile(r"X-Amz-(Signature|Credential|Security-Token)=", re.IGNORECASE)


def full_render(exc: BaseException) -> str:
    """Everything a traceback shows for `exc`: the chain, messages and notes."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


@pytest.fixture
def fake_credentials(s3_server: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Distinctive temporary credentials in the environment (moto accepts any; SeaweedFS checks signatures)."""
    if s3_server.name != "moto":
        pytest.skip("needs a server that accepts any credentials (moto)")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)


def test_secrets_never_reach_our_logs_errors_or_cli_output(
    fake_credentials: None,
    fault_proxy: FaultProxy,
    bucket: str,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)  # root, hence urllib3 and ours
    caplog.set_level(logging.DEBUG, logger="botocore")  # in case an earlier CLI run raised botocore's own level
    settings = S3ClientSettings(endpoint_url=fault_proxy.endpoint_url, user_agent_extra=f"sec-{uuid.uuid4().hex[:8]}")
    plugin = S3CheckpointIO(f"s3://{bucket}/run", chunk_size_MB=5, client_settings=settings, retry_policy=FAST)
    url = f"s3://{bucket}/run/model-step=3-last.ckpt"
    fault_proxy.add_rule(FaultRule(Fault.slow_down(), method="PUT", query="partNumber=", times=1))  # a retry log
    plugin.save_checkpoint({"w": torch.randn(6 * MiB // 4)}, url)
    plugin.load_checkpoint(url)

    errors: list[BaseException] = []
    fault_proxy.add_rule(FaultRule(Fault.status(403, "AccessDenied"), method="PUT", path_regex=r"denied"))
    fault_proxy.add_rule(FaultRule(Fault.status(400, "ExpiredToken"), method="HEAD", path_regex=r"expired"))
    failing = [
        lambda: plugin.save_checkpoint({"w": torch.zeros(3)}, f"s3://{bucket}/run/denied.ckpt"),
        lambda: plugin.load_checkpoint(f"s3://{bucket}/run/expired.ckpt"),
        lambda: plugin.load_checkpoint(f"s3://{bucket}/run/missing.ckpt"),
        lambda: connector.find_resume_checkpoint(f"s3://{bucket}/empty", s3_utils=plugin.s3),
    ]
    for call in failing:
        try:
            call()
        except Exception as exc:
            errors.append(exc)
    assert len(errors) == len(failing)
    endpoint = ["--endpoint-url", fault_proxy.endpoint_url]
    cli_codes = [cli.main(["-vv", *endpoint, "ls", f"s3://{bucket}/run"]), cli.main([*endpoint, "verify", url])]
    cli_codes.append(cli.main([*endpoint, "verify", f"s3://{bucket}/run/expired.ckpt"]))
    assert cli_codes == [cli.EXIT_OK, cli.EXIT_OK, cli.EXIT_S3_ERROR]
    plugin.teardown()

    out, err = capsys.readouterr()
    ours = "\n".join(
        caplog.handler.format(record) for record in caplog.records if record.name.split(".")[0] in OUR_LOGGERS
    )
    everything = caplog.text + out + err + "".join(full_render(exc) for exc in errors)
    signatures = set(SIGNATURE.findall(caplog.text))
    assert signatures, "botocore logged no request signature: the check below would prove nothing"
    assert "retrying" in ours, "our own DEBUG/WARNING logs were not captured"

    assert SECRET_KEY not in everything
    for name, text in {
        "our loggers": ours,
        "exception messages": "".join(full_render(exc) for exc in errors),
        "CLI stdout/stderr": out + err,
    }.items():
        assert SESSION_TOKEN not in text, f"session token in {name}"
        assert not any(signature in text for signature in signatures), f"request signature in {name}"
        assert not PRESIGNED_QUERY.search(text), f"presigned query parameters in {name}"
        assert "Authorization" not in text, f"an Authorization header in {name}"


def test_cli_debug_output_never_shows_the_session_token(fake_credentials: None, bucket: str) -> None:
    """Run as a subprocess: in-process, pytest's own logging handlers would swallow botocore's output."""
    url = f"s3://{bucket}/run"
    result = subprocess.run(
        [sys.executable, "-m", "s3_checkpoint_cli", "-vv", "ls", "--all", url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == cli.EXIT_NOT_FOUND, result.stderr[-2000:]  # an empty prefix
    output = result.stdout + result.stderr
    assert SECRET_KEY not in output
    assert SESSION_TOKEN not in output
    assert not SIGNATURE.search(output)


# ---- unpickling -----------------------------------------------------------------------------------------------------


class _ShellPayload:
    """Unpickling this calls os.system(command): what a malicious checkpoint would do."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


class _OpenPayload:
    """Unpickling this creates a file through builtins.open: code execution without a shell."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


@pytest.mark.parametrize("legacy_format", [False, True], ids=["zip", "legacy"])
def test_malicious_pickle_is_not_executed_by_a_default_load(
    legacy_format: bool, bucket: str, s3_server: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    shell_marker, open_marker = tmp_path / "pwned-by-os-system", tmp_path / "pwned-by-open"
    payload = {
        "state_dict": {"w": torch.ones(3)},
        "evil": [_ShellPayload(f"touch {shlex.quote(str(shell_marker))}"), _OpenPayload(str(open_marker))],
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer, _use_new_zipfile_serialization=not legacy_format)
    plugin = S3CheckpointIO(chunk_size_MB=5, retry_policy=FAST)
    url = f"s3://{bucket}/run/evil.ckpt"
    buffer.seek(0)
    plugin.s3.upload_file_stream_to_s3(buffer, url)  # verified upload, like any checkpoint

    for weights_only in (None, True):
        with pytest.raises(pickle.UnpicklingError, match=r"[Ww]eights only load failed"):
            plugin.load_checkpoint(url, weights_only=weights_only)
        assert not shell_marker.exists() and not open_marker.exists(), f"payload ran with weights_only={weights_only}"

    # The payload is live: only an explicit weights_only=False (trusted files only) runs it.
    loaded = plugin.load_checkpoint(url, weights_only=False)
    assert shell_marker.exists() and open_marker.exists()
    for handle in loaded["evil"][1:]:
        handle.close()


# ---- no shell, no unsafe calls in the package ------------------------------------------------------------------------


def _call_name(node: ast.Call) -> str:
    """Dotted name of the called function (``os.system``, ``subprocess.run``, ``eval``), or ""."""
    parts: list[str] = []
    func: ast.expr = node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


FORBIDDEN_CALLS = re.compile(
    r"(^|\.)(system|popen|execl|execle|execlp|execlpe|execv|execve|execvp|execvpe|spawnl|spawnle|spawnlp|spawnlpe|"
    r"spawnv|spawnve|spawnvp|spawnvpe|startfile|getoutput|getstatusoutput|eval|exec|generate_presigned_url|"
    r"generate_presigned_post)$"
)
SUBPROCESS_CALLS = {"Popen", "run", "call", "check_call", "check_output"}
UNPICKLING_CALLS = re.compile(r"(^|\.)(pickle|cPickle|marshal|dill|shelve)\.(load|loads|Unpickler|open)$")


@pytest.mark.parametrize("module", PACKAGE_MODULES)
def test_package_never_builds_a_shell_command_or_unpickles_by_itself(module: str) -> None:
    tree = ast.parse((REPO / module).read_text(encoding="utf-8"), filename=module)
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        where = f"{module}:{node.lineno} {name}"
        if FORBIDDEN_CALLS.search(name):
            problems.append(f"{where}: forbidden call")
        if UNPICKLING_CALLS.search(name):
            problems.append(f"{where}: unpickles without torch's weights_only guard")
        if name.split(".")[-1] in SUBPROCESS_CALLS and ("subprocess" in name or name in SUBPROCESS_CALLS):
            for keyword in node.keywords:
                if keyword.arg == "shell" and not (
                    isinstance(keyword.value, ast.Constant) and keyword.value.value is False
                ):
                    problems.append(f"{where}: shell={ast.unparse(keyword.value)}")
            command = node.args[0] if node.args else None
            if isinstance(command, (ast.Constant, ast.JoinedStr, ast.BinOp)):
                problems.append(f"{where}: command given as a string, not an argument list")
        if name.endswith("load") and name.split(".")[-1] == "load" and "torch" in name:
            for keyword in node.keywords:
                if keyword.arg == "weights_only" and isinstance(keyword.value, ast.Constant):
                    if keyword.value.value is False:
                        problems.append(f"{where}: torch.load(weights_only=False) hard-coded")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module", PACKAGE_MODULES)
def test_package_binds_nothing_to_all_interfaces(module: str) -> None:
    text = (REPO / module).read_text(encoding="utf-8")
    for literal in ('"0.0.0.0"', "'0.0.0.0'", '"::"', "'::'", "INADDR_ANY", "-ip.bind=0"):
        assert literal not in text, f"{module} mentions {literal}"


def test_weed_command_line_binds_loopback_only() -> None:
    """The one weed command line, shared by the demo, the tests and the benchmarks."""
    command = weed_command("weed", Path("/data"), 23456)
    assert "-ip.bind=127.0.0.1" in command and "-ip=127.0.0.1" in command
    assert "-master.telemetry=false" in command
    assert not any("0.0.0.0" in arg for arg in command)


def _listening_addresses(process: psutil.Process) -> set[str]:
    return {conn.laddr.ip for conn in process.net_connections(kind="inet") if conn.status == psutil.CONN_LISTEN}


def test_every_server_we_start_listens_on_loopback_only(s3_server: S3Endpoint, fault_proxy: FaultProxy) -> None:
    """This process (session moto server, fault proxy, the demo's embedded moto) and, on SeaweedFS, weed itself."""
    with moto_server() as embedded:
        assert embedded.endpoint_url.startswith("http://127.0.0.1:")
        addresses = _listening_addresses(psutil.Process())
    assert addresses, "no listening socket found: the check proves nothing"
    assert addresses <= {"127.0.0.1", "::1"}, addresses
    try:
        weed = seaweedfs_process(s3_server)
    except KeyError:
        return
    weed_addresses = set()
    for process in [psutil.Process(weed.proc.pid), *psutil.Process(weed.proc.pid).children(recursive=True)]:
        weed_addresses |= _listening_addresses(process)
    assert weed_addresses, "weed listens nowhere?"
    assert weed_addresses <= {"127.0.0.1", "::1"}, weed_addresses

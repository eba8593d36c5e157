"""The docs cannot drift: every ```python block of README.md and docs/*.md runs here, against a moto server the
suite starts, and every `s3-checkpoint-io` line of a ```bash block must parse.

How a page's blocks run: in page order, in one namespace per page (a later block may use what an earlier one
defined, as a reader would), in a fresh temporary working directory, with ``AWS_ENDPOINT_URL`` and test
credentials pointing at the server, and a fresh bucket made for the page: the docs say ``my-bucket``, and the test
puts the fresh bucket's name in its place (a process keeps what it learnt about a bucket, e.g. which run owns a
checkpoint directory, so pages do not share one).

Opting a block out: put ``<!-- docs-test: skip (why it cannot run here) -->`` on the line right before its fence.
The reason is required, and `EXPECTED_SKIPS` counts the skipped blocks, so a new skip is a visible change to this
file, not a silent one.
"""

from __future__ import annotations

import os
import re
import shlex
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from s3_servers import empty_and_delete_bucket

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED_PAGES = [*PAGES, REPO / "benchmarks" / "README.md", REPO / "CHANGELOG.md"]
"""Pages whose relative links must resolve (the python blocks run from `PAGES` only)."""
DOCS_BUCKET = "my-bucket"

EXPECTED_SKIPS = 6
"""How many python blocks carry a ``docs-test: skip`` comment. Change it together with the comment."""

PENDING_PAGES = {"docs/runs.md", "docs/crash-safety.md", "docs/megatron.md"}
"""Pages other work adds; links to them are allowed before they exist."""

_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*docs-test:(.*?)-->\s*$")
_SKIP = re.compile(r"^\s*skip\s*\((?P<reason>[^)]*\S[^)]*)\)\s*$")
_LINK = re.compile(r"\]\((?P<target>[^)#\s]*)(?:#(?P<anchor>[^)\s]*))?\)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced code blocks of a page, with the docs-test directive on the line before each (if any)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, language = i, match.group(1)
        end = start + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            if _FENCE.match(lines[end]) and lines[end].rstrip() != "```":
                raise AssertionError(f"{page.relative_to(REPO)}:{end + 1}: a code fence opens inside another")
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page.relative_to(REPO)}:{start + 1}: code fence never closed")
        skip_reason = None
        directive = _DIRECTIVE.match(lines[start - 1]) if start else None
        if directive:
            skip = _SKIP.match(directive.group(1))
            if not skip:
                raise AssertionError(
                    f"{page.relative_to(REPO)}:{start}: unknown docs-test directive {directive.group(1).strip()!r}; "
                    "the only one is 'skip (reason)'"
                )
            skip_reason = skip.group("reason").strip()
        code = "\n".join(lines[start + 1 : end]) + "\n"
        blocks.append(Block(page, start + 1, language, code, skip_reason))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]
PYTHON_PAGES = [page for page in PAGES if any(b.language == "python" for b in blocks_of(page))]


# ----------------------------------------------------------------------------------------------------------------
# Offline checks
# ----------------------------------------------------------------------------------------------------------------


def test_skipped_blocks_are_counted_and_explained() -> None:
    skipped = [b for b in ALL_BLOCKS if b.skip_reason is not None]
    assert all(b.language == "python" for b in skipped), [b.where for b in skipped if b.language != "python"]
    assert len(skipped) == EXPECTED_SKIPS, (
        f"{len(skipped)} python blocks are opted out of tests/test_docs.py, EXPECTED_SKIPS says {EXPECTED_SKIPS}: "
        + "; ".join(f"{b.where} ({b.skip_reason})" for b in skipped)
    )


def test_every_page_has_python_blocks_or_is_prose() -> None:
    """The collection found the pages (a rename of docs/ would otherwise make this file test nothing)."""
    assert (REPO / "README.md") in PYTHON_PAGES
    assert len(PAGES) > 1, "docs/*.md not found"


def test_tests_readme_maps_every_test_file() -> None:
    """tests/README.md's tables name every test file and folder of tests/, and only files that exist, so a reader
    finds where each feature and property is tested."""
    text = (REPO / "tests" / "README.md").read_text(encoding="utf-8")
    tables = text[text.index("## Where each feature is tested") : text.index("## Lightning's and torch's own tests")]
    named = set(re.findall(r"`(test_\w+\.py|\w+_own/)`", tables))
    present = {p.name for p in (REPO / "tests").glob("test_*.py")} | {
        f"{p.name}/" for p in (REPO / "tests").glob("*_own") if p.is_dir()
    }
    assert named == present, f"missing from tests/README.md: {sorted(present - named)}; gone: {sorted(named - present)}"


def heading_anchors(page: Path) -> set[str]:
    """The anchors a Markdown renderer (GitHub's rules) gives the headings of `page`."""
    anchors = set()
    in_fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link names a file that exists (or a page other work adds), and its #anchor a heading there."""
    text = page.read_text(encoding="utf-8")
    broken = []
    for match in _LINK.finditer(text):
        target, anchor = match.group("target"), match.group("anchor")
        if "://" in target or target.startswith("mailto:"):
            continue
        resolved = (page.parent / target).resolve() if target else page
        relative = resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else str(resolved)
        if relative in PENDING_PAGES:
            continue
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{page.relative_to(REPO)} has broken links: {broken}"


_OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")
_OPTION_GROUP = re.compile(r"\b[A-Z]+_OPTIONS\b")


def _synopsis() -> tuple[set[str], dict[str, str]]:
    """docs/cli.md's synopsis: the options before COMMAND, and each command's line with its option groups written
    out (``BUCKET_OPTIONS`` and the like are defined on lines of their own; a command's further lines describe it)."""
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    block = text[text.index("## Synopsis") :].split("```text\n", 1)[1].split("```", 1)[0]
    head, commands, groups, current = "", {}, {}, ("head", "")
    for line in block.splitlines():
        if command := re.match(r"^  ([a-z]+)\s+(.*)$", line):
            current = ("command", command.group(1))
            commands[command.group(1)] = command.group(2)
        elif group := re.match(r"^([A-Z]+_OPTIONS)\s+(.*)$", line):
            current = ("group", group.group(1))
            groups[group.group(1)] = group.group(2)
        elif current[0] == "head":
            head += " " + line
        elif current[0] == "group":
            groups[current[1]] += " " + line

    def expand(line: str) -> str:
        while _OPTION_GROUP.search(line):
            line = _OPTION_GROUP.sub(lambda match: groups[match.group(0)], line)
        return line

    return set(_OPTION.findall(head)), {name: expand(line) for name, line in commands.items()}


def test_cli_synopsis_matches_the_parser() -> None:
    """docs/cli.md's synopsis names every command and option of the CLI's parser, with every spelling (``-r`` and
    ``--recursive``), and every positional argument by its metavar; and it names nothing the parser lacks."""
    import argparse

    from s3_checkpoint_cli import build_parser

    def options(parser: argparse.ArgumentParser) -> set[str]:  # argparse has no public way to list its actions
        return {s for action in parser._actions for s in action.option_strings if s not in ("-h", "--help")}

    parser = build_parser()
    (commands,) = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    documented_head, documented = _synopsis()
    top = options(parser)
    assert documented_head == top, f"before COMMAND: docs only {documented_head - top}, parser {top - documented_head}"
    assert set(documented) == set(commands), f"commands: docs {sorted(documented)}, parser {sorted(commands)}"
    for name, sub in commands.items():
        line, wanted = documented[name], options(sub) - top  # the options before COMMAND are also taken after it
        written = set(_OPTION.findall(line))
        assert written == wanted, f"{name}: docs only {written - wanted}, parser only {wanted - written}"
        positionals = [a.metavar or a.dest for a in sub._actions if not a.option_strings]
        assert all(metavar in line for metavar in positionals), f"{name}: {positionals} not all in {line!r}"


def _cli_invocations() -> list[tuple[str, list[str]]]:
    found = []
    for block in ALL_BLOCKS:
        if block.language not in ("bash", "sh", "console"):
            continue
        for offset, raw in enumerate(block.code.splitlines()):
            line = raw.split(" #", 1)[0].strip()
            if line.startswith("$ "):
                line = line[2:]
            if line.startswith("s3-checkpoint-io "):
                found.append((f"{block.where}+{offset + 1}", shlex.split(line)[1:]))
    return found


@pytest.mark.parametrize(("where", "argv"), _cli_invocations() or [("none", [])], ids=lambda v: str(v)[:60])
def test_cli_lines_in_docs_parse(where: str, argv: list[str]) -> None:
    """Each `s3-checkpoint-io ...` line of a bash block is accepted by the CLI's parser (nothing runs)."""
    if where == "none":
        pytest.skip("no s3-checkpoint-io lines in the docs")
    from s3_checkpoint_cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on a usage error, 0 for --help
        assert exc.code == 0, f"{where}: s3-checkpoint-io {shlex.join(argv)} does not parse"


@pytest.mark.parametrize(
    "block", [b for b in ALL_BLOCKS if b.language == "yaml"] or [None], ids=lambda b: b.where if b else "none"
)
def test_yaml_blocks_parse_and_configs_build(block: Block | None) -> None:
    """Every yaml block parses; one with both `s3_checkpointing` and `exp_manager` is a config the one-call wiring
    accepts (the plugin and callback are built; nothing talks to S3)."""
    if block is None:
        pytest.skip("no yaml blocks in the docs")
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load(block.code)
    assert isinstance(config, dict), f"{block.where}: not a mapping"
    if {"s3_checkpointing", "exp_manager"} <= set(config):
        pytest.importorskip("lightning")
        from connector import build_s3_checkpointing

        parts = build_s3_checkpointing(config)
        assert parts.checkpoint_callback.dirpath == config["exp_manager"]["checkpoint_callback_params"]["dirpath"]


# ----------------------------------------------------------------------------------------------------------------
# The python blocks, against moto
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def docs_bucket(s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh bucket on the suite's moto, the environment a reader's shell would have, a fresh cwd."""
    if s3_server.name != "moto":
        pytest.skip("the docs' blocks run on moto only (CI time); they use nothing backend-specific")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.chdir(tmp_path)
    client = s3_server.client()
    name = f"docs-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=name)
    yield name
    try:
        empty_and_delete_bucket(client, name)
    except Exception as exc:  # cleanup must not mask the test result
        warnings.warn(f"could not clean up {name}: {exc!r}", stacklevel=1)


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run(page: Path, docs_bucket: str, s3_server: Any) -> None:
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    ran = 0
    for block in blocks_of(page):
        if block.language != "python" or block.skip_reason is not None:
            continue
        try:
            code = block.code.replace(DOCS_BUCKET, docs_bucket)
            exec(compile(code, block.where, "exec"), namespace)  # the docs' own code
        except Exception as exc:
            raise AssertionError(f"the python block at {block.where} failed: {exc!r}") from exc
        ran += 1
    assert ran, f"{page.relative_to(REPO)}: every python block is skipped"
    assert os.environ["AWS_ENDPOINT_URL"] == s3_server.endpoint_url

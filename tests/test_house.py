"""House rules that keep the package easy to carry on, checked on the source itself.

No module uses another first-party module's private (``_underscore``) names: what one module needs from another is
public and documented there, or it moves. Private names of other libraries are a different matter: each is pinned
by a test (tests/test_private_surface.py, tests/test_dcp.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(path.stem for path in ROOT.glob("*.py"))
"""The package's modules: every ``.py`` file at the repository root (flat modules, as pyproject's py-modules)."""

ALLOWED: set[tuple[str, str, str]] = set()
"""(module, other module, private name) uses that are known and owned elsewhere: none."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _first_party(dotted: str | None) -> str | None:
    """The first-party module a (possibly relative or package-qualified) import names, else None."""
    if not dotted:
        return None
    last = dotted.rsplit(".", 1)[-1]
    return last if last in MODULES else None


def _strings_in(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _module_aliases(tree: ast.Module) -> dict[str, str]:
    """Names bound to a first-party module anywhere in `tree`: ``import s3_utils as _s3``, ``from . import s3_dcp
    as _dcp``, and names assigned from a call that loads one (``_dcp = _sibling_s3_dcp()``,
    ``importlib.import_module(f"{__package__}.s3_checkpoint_demo" ...)``)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = _first_party(alias.name)
                if module:
                    aliases[alias.asname or alias.name] = module
        elif isinstance(node, ast.ImportFrom) and (node.module is None or node.level):
            for alias in node.names:  # from . import s3_utils as _s3
                module = _first_party(alias.name)
                if module and node.module is None:
                    aliases[alias.asname or alias.name] = module
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            callee = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "")
            loaded = [m for m in MODULES if callee.endswith(f"_{m}")]
            loaded += [m for text in _strings_in(call) for m in MODULES if text.endswith(m)]
            if loaded:
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        aliases[target.id] = loaded[0]
    return aliases


def private_uses(module: str, source: str) -> list[tuple[str, str, int]]:
    """``(other module, private name, line)`` for each use in `source` (module `module`) of another first-party
    module's private name: ``alias._name`` or ``from other import _name``."""
    tree = ast.parse(source)
    aliases = _module_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
            other = aliases.get(node.value.id)
            if other and other != module:
                found.append((other, node.attr, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            other = _first_party(node.module)
            if other and other != module:
                found += [(other, alias.name, node.lineno) for alias in node.names if _private(alias.name)]
    return found


@pytest.mark.parametrize("module", MODULES)
def test_no_module_uses_another_modules_private_names(module: str) -> None:
    uses = private_uses(module, (ROOT / f"{module}.py").read_text(encoding="utf-8"))
    allowed = {(other, name) for mod, other, name in ALLOWED if mod == module}
    unexpected = [f"{module}.py:{line}: {other}.{name}" for other, name, line in uses if (other, name) not in allowed]
    assert not unexpected, "private names of another module (make them public and documented, or move the code):\n" + (
        "\n".join(unexpected)
    )


def test_the_check_finds_each_way_of_reaching_in() -> None:
    """The checker itself: aliases from imports, relative imports and loader calls, and ``from ... import _x``."""
    source = (
        "if __package__:\n    from . import s3_utils as _s3\nelse:\n    import s3_utils as _s3\n"
        "import s3_dcp\n"
        "from s3_checkpoint_io import _secret, public\n"
        "_dcp = _sibling_s3_dcp()\n"
        "demo = importlib.import_module(f'{__package__}.s3_checkpoint_demo')\n"
        "_s3._a; s3_dcp._b; _dcp._c; demo._d; _s3.public; _s3.__doc__\n"
    )
    uses = sorted((other, name) for other, name, _ in private_uses("connector", source))
    assert uses == [
        ("s3_checkpoint_demo", "_d"),
        ("s3_checkpoint_io", "_secret"),
        ("s3_dcp", "_b"),
        ("s3_dcp", "_c"),
        ("s3_utils", "_a"),
    ]
    assert private_uses("s3_utils", "import s3_utils as _s3\n_s3._own") == []  # its own names are its business


def test_no_allowed_exception_is_stale() -> None:
    """An allow-list entry whose use is gone must go too, so the list only ever shrinks."""
    used = {
        (module, other, name)
        for module in MODULES
        for other, name, _ in private_uses(module, (ROOT / f"{module}.py").read_text(encoding="utf-8"))
    }
    assert ALLOWED <= used, f"stale entries: {sorted(ALLOWED - used)}"


CORE_CHAIN = ["s3_dirpath_utils", "s3_utils", "s3_fencing", "s3_checkpoint_io", "connector"]
"""The core files, in order: each imports (at its top) only first-party modules before it, so a fork copies them
alone and any prefix of the chain works without what follows (README.md, "Use in a NeMo 1.x fork")."""


def _top_level_imports(tree: ast.Module) -> set[str]:
    """First-party modules `tree` imports when it is imported: its statements at module level, ``if`` blocks
    included (the ``if __package__:`` pattern), not what functions import on first use."""
    found: set[str] = set()
    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.If):
            statements += node.body + node.orelse
        elif isinstance(node, ast.Import):
            found.update(m for alias in node.names if (m := _first_party(alias.name)))
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names] if node.module is None else [node.module]
            found.update(m for name in names if (m := _first_party(name)))
    return found


@pytest.mark.parametrize("position", range(len(CORE_CHAIN)))
def test_core_files_import_only_those_before_them(position: int) -> None:
    module = CORE_CHAIN[position]
    imported = _top_level_imports(ast.parse((ROOT / f"{module}.py").read_text(encoding="utf-8"))) - {module}
    assert imported <= set(CORE_CHAIN[:position]), f"{module}.py imports {sorted(imported)} at its top"


def test_the_import_check_sees_both_import_forms() -> None:
    source = "if __package__:\n    from . import s3_utils as _s3\nelse:\n    import s3_fencing\n"
    source += "def f():\n    import s3_dcp\n"
    assert _top_level_imports(ast.parse(source)) == {"s3_utils", "s3_fencing"}


MAX_LINES = {"s3_utils": 3500, "s3_dcp": 2300, "s3_checkpoint_cli": 880, "s3_checkpoint_io": 1500}
"""Line limits of modules that may be larger than `DEFAULT_MAX_LINES`, the limit of every other root-level module."""
DEFAULT_MAX_LINES = 1300

@pytest.mark.parametrize("module", MODULES)
def test_module_size(module: str) -> None:
    limit = MAX_LINES.get(module, DEFAULT_MAX_LINES)
    lines = len((ROOT / f"{module}.py").read_text(encoding="utf-8").splitlines())
    assert lines <= limit, f"{module}.py has {lines} lines, over its limit of {limit}: tighten it or split it"


def test_size_limits_name_existing_modules() -> None:
    assert set(MAX_LINES) <= set(MODULES)


CORE_CHAIN = ["s3_dirpath_utils", "s3_utils", "s3_checkpoint_io", "connector"]
"""The core files, each importing only those before it."""
BELOW = {"s3_node_sharing": "s3_utils"}
"""Optional siblings the core loads on first use, with the last core module they may import (more would be a cycle)."""


def runtime_imports(source: str) -> set[str]:
    """The first-party modules `source` imports anywhere (in functions too), except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(source)
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {m for alias in node.names if (m := _first_party(alias.name))}
        elif isinstance(node, ast.ImportFrom):
            found |= {m for alias in node.names if node.module is None and (m := _first_party(alias.name))}
            found |= {m for m in [_first_party(node.module)] if m}
    return found


@pytest.mark.parametrize("module", sorted(BELOW))
def test_a_sibling_below_the_core_imports_no_core_module_after_its_place(module: str) -> None:
    """s3_node_sharing sits between s3_utils and s3_checkpoint_io: the error it raises for a failed shared load
    (``SharedLoadError``) is s3_utils', which s3_checkpoint_io re-exports, so it never imports s3_checkpoint_io back."""
    allowed = set(CORE_CHAIN[: CORE_CHAIN.index(BELOW[module]) + 1])
    later = runtime_imports((ROOT / f"{module}.py").read_text(encoding="utf-8")) & set(CORE_CHAIN) - allowed
    assert not later, f"{module} imports {sorted(later)}, which come after {BELOW[module]} in the core chain"
    assert runtime_imports("if TYPE_CHECKING:\n    import s3_checkpoint_io\ndef f():\n    import connector\n") == {
        "connector"
    }
    import s3_checkpoint_io
    import s3_utils

    assert s3_checkpoint_io.SharedLoadError is s3_utils.SharedLoadError

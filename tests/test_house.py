"""House rules that keep the package easy to carry on, checked on the source itself.

No module uses another first-party module's private (``_underscore``) names: what one module needs from another is
public and documented there, or it moves. Private names of other libraries are a different matter: each is pinned
by a test (tests/test_private_surface.py, tests/test_dcp.py).
"""

from __future__ import annotations

import ast
import functools
import re
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


def _names_from_other_modules(module: str, tree: ast.Module) -> tuple[dict[str, str], dict[str, str]]:
    """Module aliases bound to other first-party modules, and names imported from them (``from s3_dcp import X``)."""
    aliases = {name: other for name, other in _module_aliases(tree).items() if other != module}
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (other := _first_party(node.module)) and other != module:
            imported.update({alias.asname or alias.name: other for alias in node.names})
    return aliases, imported


def foreign_private_writes(module: str, source: str) -> list[tuple[str, str, int]]:
    """``(other module, target, line)`` for each write in `source` to a private attribute of an object whose class
    another first-party module defines: ``obj._x = ...`` (also augmented, annotated, in a tuple, or by ``setattr``)
    where ``obj`` was built by ``other.Class(...)`` or annotated with one of its classes (a name, a parameter,
    ``self.attr``), or is a module-level object of the other module (``other.obj._x = ...``)."""
    tree = ast.parse(source)
    aliases, imported = _names_from_other_modules(module, tree)

    def class_module(expr: ast.AST) -> str | None:  # the other module a callee or an annotation names
        for node in ast.walk(expr):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                return aliases[node.value.id]
            if isinstance(node, ast.Name) and node.id in imported:
                return imported[node.id]
            if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
                try:
                    found = class_module(ast.parse(node.value, mode="eval"))
                except SyntaxError:
                    continue
                if found:
                    return found
        return None

    typed: dict[str, str] = {}  # the source text of an object -> the module of its class
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if other := class_module(node.value.func):
                typed.update({ast.unparse(target): other for target in node.targets})
        elif isinstance(node, ast.AnnAssign) and (other := class_module(node.annotation)):
            typed[ast.unparse(node.target)] = other
        elif isinstance(node, ast.arg) and node.annotation is not None and (other := class_module(node.annotation)):
            typed[node.arg] = other

    def owner_module(owner: ast.expr) -> str | None:
        if ast.unparse(owner) in typed:
            return typed[ast.unparse(owner)]
        if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name):  # other.obj._x
            return aliases.get(owner.value.id)
        return None

    found = []
    for node in ast.walk(tree):
        written: list[tuple[ast.expr, str]] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(element, ast.Attribute) and _private(element.attr):
                        written.append((element.value, element.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value)):
                written.append((node.args[0], str(node.args[1].value)))
        for owner, name in written:
            if other := owner_module(owner):
                found.append((other, f"{ast.unparse(owner)}.{name}", node.lineno))
    return found


@pytest.mark.parametrize("module", MODULES)
def test_no_module_writes_private_attributes_of_another_modules_objects(module: str) -> None:
    """What a module needs to set on another module's object is a public method or argument there."""
    writes = foreign_private_writes(module, (ROOT / f"{module}.py").read_text(encoding="utf-8"))
    assert not writes, "writes to another module's objects' private attributes (add a public way there):\n" + (
        "\n".join(f"{module}.py:{line}: {target} (an object of {other})" for other, target, line in writes)
    )


def test_the_write_check_finds_each_kind_of_object() -> None:
    """The checker itself: objects built by another module's class, annotated with one (a parameter, a string
    annotation, ``self.attr``), imported classes, another module's own objects, ``setattr``; not own objects."""
    source = (
        "import s3_dcp\nfrom s3_utils import S3Utils\n"
        "class Source:\n"
        "    def __init__(self, url):\n"
        "        self.reader = s3_dcp.S3StorageReader(url)\n"
        "        self.reader._records = {}\n"
        "        self._own = 1\n"
        "        self.reader.records = {}\n"
        "    def f(self, writer: 's3_dcp.S3StorageWriter', utils: S3Utils, mine: Source):\n"
        "        writer._a, other = 1, 2\n"
        "        utils._b += 1\n"
        "        mine._c = 1\n"
        "        setattr(utils, '_d', 1)\n"
        "        s3_dcp.SOME_OBJECT._e = 1\n"
    )
    writes = sorted((other, target) for other, target, _ in foreign_private_writes("s3_checkpoint_convert", source))
    assert writes == [
        ("s3_dcp", "s3_dcp.SOME_OBJECT._e"),
        ("s3_dcp", "self.reader._records"),
        ("s3_dcp", "writer._a"),
        ("s3_utils", "utils._b"),
        ("s3_utils", "utils._d"),
    ]


# ---- the stated API: docs/api.md, each module's __all__, and what siblings use besides ---------------------------

API_DOC = ROOT / "docs" / "api.md"


@functools.cache
def declared_all(module: str) -> list[str]:
    """The module's ``__all__``, read from its source (no import: a missing extra does not matter here)."""
    for node in ast.parse((ROOT / f"{module}.py").read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(target, ast.Name) and target.id == "__all__" for target in targets) and node.value:
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module}.py has no __all__")


def documented_api() -> dict[str, list[str]]:
    """docs/api.md's names per module: under each ``## `module` `` heading, the names an item (``- ``, continued by
    indented lines) lists before its colon: ``- `MB`, `GB`: ...``."""
    api: dict[str, list[str]] = {}
    module, item = None, ""
    for line in [*API_DOC.read_text(encoding="utf-8").splitlines(), ""]:
        if item and line.startswith("  "):
            item += " " + line.strip()
            continue
        if module and item:
            api[module] += re.findall(r"`(\w+)`", item.partition("`:")[0] + "`")
        item = line if line.startswith("- ") else ""
        if heading := re.match(r"^## `(\w+)`", line):
            module = heading.group(1)
            api[module] = []
    return api


def test_docs_api_lists_every_modules_all() -> None:
    """docs/api.md is the supported API: each module's ``__all__`` holds exactly the names listed there."""
    api = documented_api()
    assert sorted(api) == MODULES, f"docs/api.md sections: {sorted(api)}, modules: {MODULES}"
    for module in MODULES:
        declared = declared_all(module)
        assert len(declared) == len(set(declared)), f"{module}.__all__ repeats a name"
        assert set(declared) == set(api[module]), (
            f"{module}: in __all__ only {sorted(set(declared) - set(api[module]))}, "
            f"in docs/api.md only {sorted(set(api[module]) - set(declared))}"
        )


def _module_loaders(module: str, tree: ast.Module) -> dict[str, str]:
    """Functions of `tree` that import another first-party module on first use and return it (``importlib`` or
    ``s3_process.import_sibling`` with the module's name in a string, or in a module-level constant):
    ``function name -> module``."""
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    loaders = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("__"):
            continue
        if "import_module" not in ast.unparse(node) and "import_sibling" not in ast.unparse(node):
            continue
        names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in constants]
        texts = _strings_in(node) + [constants[name] for name in names]
        named = {m for text in texts for m in MODULES if m != module and (text == m or text.endswith(f".{m}"))}
        if len(named) == 1:
            loaders[node.name] = named.pop()
    return loaders


def sibling_uses(module: str, source: str) -> set[tuple[str, str]]:
    """``(other module, public name)`` that `source` (module `module`) takes from another first-party module: through
    an alias of it, ``from other import name``, or a loader function's result (``_memory_tier_module().X``)."""
    tree = ast.parse(source)
    aliases, imported = _names_from_other_modules(module, tree)
    loaders = _module_loaders(module, tree)

    def loaded(call: ast.expr) -> str | None:  # the module a loader call returns: _tier() or _s3.node_sharing()
        if not isinstance(call, ast.Call):
            return None
        if isinstance(call.func, ast.Name):
            return loaders.get(call.func.id)
        if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name):
            other = aliases.get(call.func.value.id)
            return _loaders_of(other).get(call.func.attr) if other else None
        return None

    for node in ast.walk(tree):  # rep = _replication_module()
        if isinstance(node, ast.Assign) and (other := loaded(node.value)) and other != module:
            aliases.update({t.id: other for t in node.targets if isinstance(t, ast.Name)})
    uses = {(other, name) for name, other in imported.items() if not _private(name)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or _private(node.attr) or node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in aliases:
            uses.add((aliases[node.value.id], node.attr))
        elif (other := loaded(node.value)) and other != module:
            uses.add((other, node.attr))
    return uses


@functools.cache
def _loaders_of(module: str) -> dict[str, str]:
    return _module_loaders(module, ast.parse((ROOT / f"{module}.py").read_text(encoding="utf-8")))


@functools.cache
def _definitions(module: str) -> dict[str, tuple[str | None, list[str]]]:
    """Names `module` defines at its top level: ``name -> (docstring, source lines of the definition and the line
    above it)``; names bound to another object by import or by ``name = other.name`` are left out."""
    source = (ROOT / f"{module}.py").read_text(encoding="utf-8")
    lines = source.splitlines()
    found: dict[str, tuple[str | None, list[str]]] = {}
    statements = list(ast.parse(source).body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.If | ast.Try):
            statements += node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found[node.name] = (ast.get_docstring(node), [])
        elif isinstance(node, ast.Assign | ast.AnnAssign) and not isinstance(node.value, ast.Name | ast.Attribute):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    found[target.id] = (None, lines[max(node.lineno - 2, 0) : node.end_lineno])
    return found


def test_the_use_check_finds_each_way_of_reaching_a_sibling() -> None:
    """The checker itself: an alias, ``from ... import``, a loader function's result (``importlib`` or
    ``import_sibling``; called, or kept in a name), and another module's loader (``s3_process.node_sharing`` returns
    `s3_node_sharing`); private names are left out."""
    source = (
        "import importlib\nimport s3_utils as _s3\nimport s3_process as _process\nfrom s3_dcp import METADATA_NAME\n"
        "TIER = 's3_memory_tier'\n"
        "def _tier():\n    return importlib.import_module(TIER)\n"
        "_s3.S3Utils; _s3._private\n"
        "_tier().copy_to_load\n"
        "rep = _tier()\nrep.TierReplication\n"
        "_process.node_sharing().download_shared\n"
        "def _convert():\n    return _urls.import_sibling('s3_checkpoint_convert', __package__)\n"
        "_convert().convert_checkpoint\n"
    )
    assert sibling_uses("s3_checkpoint_io", source) == {
        ("s3_checkpoint_convert", "convert_checkpoint"),
        ("s3_dcp", "METADATA_NAME"),
        ("s3_utils", "S3Utils"),
        ("s3_process", "node_sharing"),
        ("s3_memory_tier", "copy_to_load"),
        ("s3_memory_tier", "TierReplication"),
        ("s3_node_sharing", "download_shared"),
    }


def test_what_siblings_use_besides_the_api_is_marked_package_internal() -> None:
    """A name one module takes from another that is not in the other's ``__all__`` is package-internal: its
    docstring (or, for a constant, a comment on or above it) says so, so a reader knows users must not rely on it."""
    unmarked = []
    for module in MODULES:
        for other, name in sibling_uses(module, (ROOT / f"{module}.py").read_text(encoding="utf-8")):
            if name in declared_all(other) or name not in (defined := _definitions(other)):
                continue
            docstring, lines = defined[name]
            text = docstring if docstring is not None else "\n".join(lines)
            if "package-internal" not in (text or "").lower():
                unmarked.append(f"{other}.{name} (used by {module})")
    assert not unmarked, "mark these package-internal (docs/api.md) or list them there:\n" + (
        "\n".join(sorted(set(unmarked)))
    )


CORE_CHAIN = ["s3_dirpath_utils", "s3_process", "s3_pacing", "s3_utils", "s3_fencing", "s3_checkpoint_io", "connector"]
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


MAX_LINES = {
    "s3_utils": 3000, "s3_dcp": 2860, "s3_checkpoint_io": 1550, "s3_checkpoint_convert": 1400, "connector": 1460,
    "s3_mcore": 1430, "s3_memory_tier": 1350, "s3_checkpoint_cli": 900, "s3_tier_replication": 1120, "s3_fencing": 1230,
}
"""Line limits of modules that may be larger than `DEFAULT_MAX_LINES`, the limit of every other root-level module:
about 10% above each module's size when set, and never above 3,000 (a module that needs more is split by concept)."""
DEFAULT_MAX_LINES = 1000

@pytest.mark.parametrize("module", MODULES)
def test_module_size(module: str) -> None:
    limit = MAX_LINES.get(module, DEFAULT_MAX_LINES)
    lines = len((ROOT / f"{module}.py").read_text(encoding="utf-8").splitlines())
    assert lines <= limit, f"{module}.py has {lines} lines, over its limit of {limit}: tighten it or split it"


def test_size_limits_name_existing_modules() -> None:
    assert set(MAX_LINES) <= set(MODULES)


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

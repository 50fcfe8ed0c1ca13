"""The project's layout rules that no linter checks: a module's private names (a leading
underscore) stay its own. No module of the package, the tests, the benchmarks or the
experiments imports another module's private name (``from transformers_jax.x import _y``) or
reaches for one through a module it imported (``host_memory._glibc_version()``): a name that
other modules need is public, documented and kept working when its module changes."""

from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("transformers_jax", "tests", "benchmarks", "experiments")
# Uses in files being reworked elsewhere: to be made public there, then removed from here. An
# entry that no longer occurs fails the test, so the list only shrinks.
PENDING: set[str] = set()


def _module_name(path: Path) -> str:
    """``transformers_jax/nn/layers.py`` -> ``transformers_jax.nn.layers``; a test or
    benchmark helper (imported by its bare name from its folder) -> its bare name too."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    """Every module of the project by the names it is imported under: dotted from the
    repository root, and bare for the helpers tests and benchmarks import from their folder."""
    modules: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            modules[_module_name(path)] = path
            if folder in ("tests", "benchmarks") and path.parent == ROOT / folder:
                modules[path.stem] = path
    return modules


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The module an ``ImportFrom`` names, relative imports resolved against ``module``."""
    if not node.level:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(source: str, module: str, modules: dict[str, Path],
                 is_package: bool = False) -> list[str]:
    """``line: what`` for each use, in ``source`` (the module ``module``), of another project
    module's private name: imported from it, or read as an attribute of a name bound to it."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the project module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in modules or alias.name in modules:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:  # `import a.b` binds a; a.b._x is reached through attributes
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source_module = _absolute(node, module, is_package)
            if source_module not in modules or source_module == module:
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.lineno}: from {source_module} import {alias.name}")
                elif f"{source_module}.{alias.name}" in modules:  # a submodule
                    bound[alias.asname or alias.name] = f"{source_module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        dotted, inner = [], node.value
        while isinstance(inner, ast.Attribute):
            dotted.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in bound:
            continue
        target = ".".join([bound[inner.id], *reversed(dotted)])
        if target in modules and target != module:
            found.append(f"{node.lineno}: {target}.{node.attr}")
    return sorted(found, key=lambda use: int(use.split(":")[0]))


def test_no_module_uses_another_modules_private_names():
    modules = project_modules()
    offences = []
    for path in sorted(set(modules.values())):
        uses = private_uses(path.read_text(), _module_name(path), modules,
                            path.name == "__init__.py")
        offences += [f"{path.relative_to(ROOT)}:{use}" for use in uses]
    pending = {o for o in offences if o.split(":")[0] + ":" + o.split(":", 2)[2] in PENDING}
    new = [o for o in offences if o not in pending]
    assert not new, "private names used across modules:\n" + "\n".join(new)
    gone = PENDING - {o.split(":")[0] + ":" + o.split(":", 2)[2] for o in pending}
    assert not gone, f"no longer used: remove from PENDING: {sorted(gone)}"


def test_the_check_sees_both_kinds_of_use():
    modules = {"pkg": Path("pkg/__init__.py"), "pkg.a": Path("pkg/a.py"),
               "pkg.b": Path("pkg/b.py"), "helper": Path("tests/helper.py")}
    source = textwrap.dedent("""
        import pkg.a
        import pkg.b as bee
        from pkg import a
        from pkg.a import public, _hidden
        from helper import _thing
        from . import _sibling
        import os

        pkg.a._x()
        bee._y
        a._z
        a.public
        os._exit
        self._own
    """)
    uses = private_uses(source, "pkg.c", modules)
    assert [use.split(": ", 1)[1] for use in uses] == [
        "from pkg.a import _hidden", "from helper import _thing", "from pkg import _sibling",
        "pkg.a._x", "pkg.b._y", "pkg.a._z"]
    assert private_uses("from pkg.a import _own", "pkg.a", modules) == []  # its own names


def test_the_walk_covers_every_folder():
    modules = project_modules()
    for folder in FOLDERS:
        assert any(str(p).startswith(os.path.join(ROOT, folder)) for p in modules.values())


# The registries of the config's switches: declared empty in registry.py (which loads nothing
# by name), filled from the one catalogue, builtins.py --------------------------------------

SWITCH_REGISTRIES = ("POSITIONS", "ROPE_SCALINGS", "MASKS", "ATTENTION", "NORMS",
                     "NORM_PLACEMENTS", "MLPS", "FAMILIES", "TOKENIZERS")


def _registers(tree: ast.AST) -> set[str]:
    """The switch registries a module adds entries to (``@MASKS.register(...)``, ``.add``)."""
    return {node.func.value.id for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("register", "add") and isinstance(node.func.value, ast.Name)
            and node.func.value.id in SWITCH_REGISTRIES}


def _catalogue() -> dict[str, set[str]]:
    """``{registry: modules its loader in builtins.py imports}``."""
    tree = ast.parse((ROOT / "transformers_jax" / "builtins.py").read_text())
    loaders = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            loaders[node.name] = {
                f"{inner.module}.{alias.name}" for inner in ast.walk(node)
                if isinstance(inner, ast.ImportFrom) for alias in inner.names}
    filled = {}
    for node in tree.body:  # REGISTRY.fill_from(loader)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            filled[call.func.value.id] = loaders[call.args[0].id]
    return filled


def test_every_built_in_entry_is_in_the_catalogue():
    """A module registering an entry into a switch registry is imported by that registry's
    loader in builtins.py (else its entry would exist only once something imported it); the
    catalogue names nothing that registers nothing; registry.py loads nothing by name."""
    catalogue = _catalogue()
    assert sorted(catalogue) == sorted(SWITCH_REGISTRIES)
    found: dict[str, set[str]] = {name: set() for name in SWITCH_REGISTRIES}
    for module, path in project_modules().items():
        if module.startswith("transformers_jax."):
            for registry in _registers(ast.parse(path.read_text())):
                found[registry].add(module)
    assert found == catalogue
    registry_source = (ROOT / "transformers_jax" / "registry.py").read_text()
    assert "importlib" not in registry_source and "__import__" not in registry_source

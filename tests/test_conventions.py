"""House conventions of the ``ucmagic`` package, checked on its source (AST only, nothing imported).

1. No import cycles between modules, counting lazy (function-level) imports; imports under
   ``if TYPE_CHECKING:`` are left out because they never run.
2. No ``from .x import _name`` across modules: a private name stays in its module (importing a
   private *module* such as ``_util`` is fine).
3. No access to another module's private names: ``module._name`` (``volume._is_url``), and
   ``obj._name`` or ``getattr(obj, "_name")`` on anything but ``self``/``cls``/``super()`` when
   another ucmagic module defines ``_name`` (``ds._fresh`` in the loader reaches into the
   dataset's state). Types are not inferred, so this is by name: a private attribute of a
   module's own class read on another instance (``other._x``) passes when no other module
   defines ``_x``.
4. No ``sys.modules`` probing for ucmagic's own modules (``sys.modules.get("ucmagic.x")``).
5. Dependencies point one way (``LAYERS``): the engine (the top-level modules) imports no
   subpackage; ``checkpoints``, ``tables`` and ``testing`` import the engine and themselves;
   ``ucmagic.api`` (``ucmagic.load``) adds ``tables``; the ``notebook`` layer may import all of
   those; ``ucmagic`` and ``ucmagic.__main__`` anything. The engine imports no display module, not
   even lazily: ``monitor()``, ``plot()`` and ``explore()`` reach the notebook layer through the
   presenters it registers (``ucmagic.presenters``), whose ``PROVIDER`` is the one place the engine
   names it (``test_only_the_presenter_hook_names_the_notebook_layer``).

The code predates these checks, so today's violations are listed in ``KNOWN_VIOLATIONS``: the
suite fails on any violation that is not listed, and on any listed one that no longer occurs, so
the list only shrinks. The architecture step (issue 17) fixes them and empties it.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "ucmagic"
PACKAGE = "ucmagic"
TORCH_COMPAT = "._torch_compat"  # may touch torch's private attributes (that is its job), by name

# The layers, lowest first: a module may import its own layer and those listed for it.
SUBPACKAGES = ("checkpoints", "tables", "shards", "notebook", "testing")
LAYERS: dict[str, set[str]] = {
    "engine": set(),
    "checkpoints": {"engine"},
    "tables": {"engine"},
    "shards": {"engine", "tables"},                                 # samples of big files (tables.rows: windows)
    "testing": {"engine"},
    "api": {"engine", "tables", "shards"},                          # ucmagic.load
    "notebook": {"engine", "checkpoints", "tables", "shards", "api"},
    "top": {"engine", "checkpoints", "tables", "shards", "testing", "api", "notebook"},  # ucmagic, __main__
}

# Inside the engine, the file engine (volumes to datasets) sits below loading (the DataLoader, its stats).
FILES_GROUP, LOADING_GROUP = f"{PACKAGE}.files.", f"{PACKAGE}.loading."

# The engine's one way into the notebook layer: ucmagic.presenters imports PROVIDER by name when a
# presenter is asked for before the notebook layer registered it.
PRESENTER_HOOK = "ucmagic.presenters"

# Each entry is "<check>: <module> <what>": an accepted exception, with its reason. Empty since the
# architecture step (issue 17); test_known_violations_still_occur keeps it from going stale.
KNOWN_VIOLATIONS: frozenset[str] = frozenset()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@dataclass
class Module:
    name: str                 # dotted: ucmagic.files.cache
    path: Path
    is_package: bool
    tree: ast.Module
    imports: set[str] = field(default_factory=set)          # ucmagic modules it imports
    eager: set[str] = field(default_factory=set)            # ... of those, outside any function
    defined_private: set[str] = field(default_factory=set)  # _names it defines (any scope, self._x too)


def _module_name(path: Path, package_dir: Path) -> tuple[str, bool]:
    rel = path.relative_to(package_dir.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _load_modules(package_dir: Path) -> dict[str, Module]:
    mods = {}
    for path in sorted(package_dir.rglob("*.py")):
        name, is_pkg = _module_name(path, package_dir)
        mods[name] = Module(name, path, is_pkg, ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return mods


def _resolve(mod: Module, level: int, target: str | None) -> str:
    """Absolute name of a (possibly relative) import target seen in ``mod``."""
    if level == 0:
        return target or ""
    base = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of nodes under ``if TYPE_CHECKING:`` (never executed)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def _defined_private_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)      # self._x = ... (ds._x = ... elsewhere defines nothing)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Assign) and any(_dotted(t) == "__slots__" for t in node.targets):
            names.update(c.value for c in ast.walk(node.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in names if _is_private(n)}


def _violations(package_dir: Path = PACKAGE_DIR) -> set[str]:
    """Every violation found under ``package_dir``, as KNOWN_VIOLATIONS spells them."""
    mods = _load_modules(package_dir)
    for mod in mods.values():
        mod.defined_private = _defined_private_names(mod.tree)
    found: set[str] = set()

    def is_module(name: str) -> bool:
        return name in mods

    for mod in mods.values():
        skip = _type_checking_nodes(mod.tree)
        parents = {id(c): p for p in ast.walk(mod.tree) for c in ast.iter_child_nodes(p)}
        aliases: dict[str, str] = {}   # local name -> ucmagic module it is bound to

        def in_function(node: ast.AST) -> bool:
            while id(node) in parents:
                node = parents[id(node)]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    return True
            return False

        for node in ast.walk(mod.tree):
            if id(node) in skip:
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not in_function(node):
                before = set(mod.imports)
            else:
                before = None
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        mod.imports.add(alias.name)
                        if alias.asname:
                            aliases[alias.asname] = alias.name
                        else:
                            aliases[PACKAGE] = PACKAGE
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(mod, node.level, node.module)
                if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
                    continue
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if is_module(sub):          # from . import volume: the submodule itself
                        mod.imports.add(sub)
                        aliases[alias.asname or alias.name] = sub
                        continue
                    mod.imports.add(source)
                    if _is_private(alias.name) and source != mod.name:
                        found.add(f"private import: {mod.name} imports {alias.name} from {source}")
            if before is not None:
                mod.eager.update(mod.imports - before)

        # module._name; obj._name / getattr(obj, "_name") where _name belongs to another module
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                obj, attr = node.value, node.attr
            elif isinstance(node, ast.Call) and _dotted(node.func) in ("getattr", "setattr", "hasattr", "delattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) and _is_private(node.args[1].value):
                obj, attr = node.args[0], node.args[1].value
            else:
                continue
            target = _dotted(obj)
            owner = aliases.get(target.split(".")[0]) if target else None
            if owner is not None:
                owner = ".".join([owner, *target.split(".")[1:]])
                if is_module(f"{owner}.{attr}"):
                    continue                # a private submodule, e.g. ucmagic._util
                if is_module(owner) and owner != mod.name:
                    found.add(f"private attribute: {mod.name} uses {owner}.{attr}")
                continue
            if target in ("self", "cls") or (isinstance(obj, ast.Call) and _dotted(obj.func) == "super"):
                continue                    # its own (or an inherited) attribute
            if mod.name.endswith(TORCH_COMPAT):
                continue                    # the one home of torch's private DataLoader/DCP attributes
            if any(attr in m.defined_private for m in mods.values() if m is not mod):
                found.add(f"private attribute: {mod.name} uses .{attr} of another module")

        # sys.modules probing for ucmagic's own modules
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith(PACKAGE + ".") and is_module(node.value):
                parent = parents.get(id(node))
                call = parent if isinstance(parent, ast.Call) else None
                sub = parent if isinstance(parent, ast.Subscript) else None
                probed = (call is not None and _dotted(call.func).startswith("sys.modules")) or \
                         (sub is not None and _dotted(sub.value) == "sys.modules")
                if probed:
                    found.add(f"sys.modules probe: {mod.name} looks up {node.value}")

    found.update(_cycle_violations(mods))
    found.update(_layer_violations(mods))
    return found


def _layer(name: str) -> str:
    """The layer of a module: engine, api, top, or the subpackage it is in."""
    if name in (PACKAGE, f"{PACKAGE}.__main__"):
        return "top"
    if name == f"{PACKAGE}.api":
        return "api"
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else "engine"


def _layer_violations(mods: dict[str, Module]) -> set[str]:
    """'layer: a (its layer) imports b (b's layer)' for each import against ``LAYERS``."""
    found = set()
    for mod in mods.values():
        mine = _layer(mod.name)
        for target in sorted(mod.imports):
            if target not in mods or target == PACKAGE:
                continue        # the package itself runs first anyway (see _cycle_violations)
            theirs = _layer(target)
            when = " at import time" if target in mod.eager else ""
            if mod.name.startswith(FILES_GROUP) and target.startswith(LOADING_GROUP):
                found.add(f"layer: {mod.name} (files) imports {target} (loading){when}")
                continue
            if theirs == mine or theirs in LAYERS[mine]:
                continue
            found.add(f"layer: {mod.name} ({mine}) imports {target} ({theirs}){when}")
    return found


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _cycle_violations(mods: dict[str, Module]) -> set[str]:
    """Every import edge that lies on a cycle, as 'import cycle: a -> b' (Tarjan's SCCs).

    Importing ``ucmagic.x`` also runs the package ``__init__``; that implicit edge is not counted,
    so a facade that lazily re-exports its submodules is not a cycle by itself.
    """
    graph = {m.name: {i for i in m.imports if i in mods and i != m.name} for m in mods.values()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comp: dict[str, int] = {}
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp[w] = index[v]
                if w == v:
                    break

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return {f"import cycle: {a} -> {b}" for a, targets in graph.items() for b in targets if comp[a] == comp[b]}


def test_no_new_convention_violations():
    new = _violations() - KNOWN_VIOLATIONS
    assert not new, (
        "new import cycles or private cross-module access (add a public function, or move the import):\n  "
        + "\n  ".join(sorted(new)))


def test_known_violations_still_occur():
    gone = KNOWN_VIOLATIONS - _violations()
    assert not gone, "fixed: remove these entries of KNOWN_VIOLATIONS in tests/test_conventions.py:\n  " + "\n  ".join(
        sorted(gone))


# ------------------------------------------------------------------ the checker catches what it should

def _check_sources(tmp_path: Path, files: dict[str, str]) -> set[str]:
    pkg = tmp_path / PACKAGE
    for rel, text in files.items():
        p = pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return _violations(pkg)


def test_checker_finds_imports_against_the_layers(tmp_path):
    found = _check_sources(tmp_path, {
        "__init__.py": "from . import volume\n",
        "api.py": "from .tables import api\n",
        "units.py": "",
        "volume.py": "def show():\n    from .notebook import plots\n",
        "loader.py": "def monitor():\n    from .notebook.panel import attach\n",
        "loader_stats.py": "from .notebook import plots\ndef explore():\n    from .tables.api import load\n",
        "checkpoints/__init__.py": "",
        "checkpoints/api.py": "from ..units import x\nfrom ..tables import api\n",
        "tables/__init__.py": "",
        "tables/api.py": "from ..units import x\n",
        "testing/__init__.py": "from ..notebook import panel\n",
        "notebook/__init__.py": "",
        "notebook/panel.py": ("from ..tables.api import load\nfrom ..checkpoints import api\n"
                              "from .. import api as top\n"),
        "notebook/plots.py": "",
        "files/__init__.py": "",
        "files/cache.py": "from ..loading import stats\n",
        "files/dataset.py": "from . import cache\n",
        "loading/__init__.py": "",
        "loading/stats.py": "from ..units import x\n",
    })
    assert found == {
        "layer: ucmagic.volume (engine) imports ucmagic.notebook.plots (notebook)",
        "layer: ucmagic.loader (engine) imports ucmagic.notebook.panel (notebook)",
        "layer: ucmagic.loader_stats (engine) imports ucmagic.notebook.plots (notebook) at import time",
        "layer: ucmagic.loader_stats (engine) imports ucmagic.tables.api (tables)",
        "layer: ucmagic.files.cache (files) imports ucmagic.loading.stats (loading) at import time",
        "layer: ucmagic.checkpoints.api (checkpoints) imports ucmagic.tables.api (tables) at import time",
        "layer: ucmagic.testing (testing) imports ucmagic.notebook.panel (notebook) at import time",
    }


def test_only_the_presenter_hook_names_the_notebook_layer():
    """No engine module but the hook names ``ucmagic.notebook`` (an importlib call by name would
    slip past the import checks), and the hook names it once, as its ``PROVIDER``."""
    named = {}
    for mod in _load_modules(PACKAGE_DIR).values():
        if _layer(mod.name) != "engine":
            continue
        hits = [n.value for n in ast.walk(mod.tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                and n.value.startswith(f"{PACKAGE}.notebook")]
        if hits:
            named[mod.name] = hits
    assert named == {PRESENTER_HOOK: [f"{PACKAGE}.notebook"]}


def test_no_engine_module_imports_a_display_library():
    """IPython, ipywidgets and matplotlib are the notebook layer's (the engine shows through presenters)."""
    display = ("IPython", "ipywidgets", "matplotlib")
    found = set()
    for mod in _load_modules(PACKAGE_DIR).values():
        if _layer(mod.name) != "engine":
            continue
        for node in ast.walk(mod.tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found.update(f"{mod.name} imports {n}" for n in names if n.split(".")[0] in display)
    assert not found, sorted(found)


def test_checker_finds_a_lazy_import_cycle_and_private_access(tmp_path):
    found = _check_sources(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import helper\n_secret = 1\n",
        "b.py": ("def helper():\n    from . import a\n    return a._secret\n"
                 "def other(ds):\n    from .c import _hidden\n    return ds._state\n"),
        "c.py": ("import sys\nclass C:\n    def __init__(self):\n        self._state = 0\n_hidden = 2\n"
                 "def probe():\n    return sys.modules.get('ucmagic.a')\n"),
        "d.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import E\n"
                 "from . import _priv\nimport ucmagic.c as cm\n"
                 "def f(x):\n    return getattr(x, '_state', None), cm._hidden, x._unknown_elsewhere\n"),
        "e.py": "from . import d\n",
        "_priv.py": "",
    })
    assert found == {
        "import cycle: ucmagic.a -> ucmagic.b",
        "import cycle: ucmagic.b -> ucmagic.a",
        "private attribute: ucmagic.b uses ucmagic.a._secret",
        "private import: ucmagic.b imports _hidden from ucmagic.c",
        "private attribute: ucmagic.b uses ._state of another module",
        "sys.modules probe: ucmagic.c looks up ucmagic.a",
        "private attribute: ucmagic.d uses ._state of another module",
        "private attribute: ucmagic.d uses ucmagic.c._hidden",
    }

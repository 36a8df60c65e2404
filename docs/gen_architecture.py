"""Generate docs/architecture.md from the code and docs/architecture.template.md.

The template holds the hand-written prose (the data flow, "where do I change X", the contracts); this
script fills its markers from the source, read with :mod:`ast` (nothing is imported), so the counts
cannot go stale:

- ``<!-- generated: modules -->``: every module of ``ucmagic/`` with its lines, classes, the class with
  the most methods, top-level functions, its longest function and the first line of its docstring;
- ``<!-- generated: sizes -->``: what is over the size targets of the architecture (modules over
  :data:`MODULE_LINES` lines, classes over :data:`CLASS_METHODS` methods);
- ``<!-- generated: layers -->``: the dependency rules, from ``LAYERS`` in tests/test_conventions.py.

Usage::

    python docs/gen_architecture.py          # rewrite docs/architecture.md
    python docs/gen_architecture.py --check  # exit 1 (and say so) when it is stale
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ucmagic"
TEMPLATE = ROOT / "docs" / "architecture.template.md"
OUTPUT = ROOT / "docs" / "architecture.md"
CONVENTIONS = ROOT / "tests" / "test_conventions.py"
FIX = "python docs/gen_architecture.py"

MODULE_LINES = 650   # the architecture's targets (issue 43): no module over ~650 lines,
CLASS_METHODS = 25   # no class over ~25 methods (public read-API classes may reach ~30)
SUMMARY_CHARS = 100


@dataclass(frozen=True)
class ModuleFacts:
    """What the tables say about one module."""

    path: str            # relative to ucmagic/, POSIX
    lines: int
    classes: int
    widest: tuple[str, int] | None    # (class, methods) of the class with the most methods
    functions: int       # top-level functions
    longest: tuple[str, int] | None   # (function or Class.method, lines)
    summary: str


def _summary(tree: ast.Module) -> str:
    doc = ast.get_docstring(tree) or ""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    first = first.split(". ")[0].rstrip(".") if first else ""
    return first if len(first) <= SUMMARY_CHARS else first[:SUMMARY_CHARS - 3].rstrip() + "..."


def _span(node: ast.AST) -> int:
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])  # type: ignore[attr-defined]
    return int(node.end_lineno) - start + 1  # type: ignore[attr-defined]


def module_facts(path: Path, package: Path = PACKAGE) -> ModuleFacts:
    """Counts for one source file, by :mod:`ast`."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    widest: tuple[str, int] | None = None
    for c in classes:
        n = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in c.body)
        if n and (widest is None or n > widest[1]):
            widest = (c.name, n)
    longest: tuple[str, int] | None = None
    for node in tree.body:
        inner = [(node.name, node)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        if isinstance(node, ast.ClassDef):
            inner = [(f"{node.name}.{b.name}", b) for b in node.body
                     if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for name, fn in inner:
            if longest is None or _span(fn) > longest[1]:
                longest = (name, _span(fn))
    return ModuleFacts(
        path=path.relative_to(package).as_posix(),
        lines=len(text.splitlines()),
        classes=len(classes),
        widest=widest,
        functions=sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in tree.body),
        longest=longest,
        summary=_summary(tree),
    )


def all_facts(package: Path = PACKAGE) -> list[ModuleFacts]:
    """Every module under ``package``, sorted: top-level modules first, then each subpackage's."""
    paths = sorted(package.rglob("*.py"), key=lambda p: (len(p.relative_to(package).parts) > 1,
                                                         p.relative_to(package).as_posix()))
    return [module_facts(p, package) for p in paths if "__pycache__" not in p.parts]


def modules_table(facts: list[ModuleFacts]) -> str:
    rows = ["| module | lines | classes | most methods | functions | longest function | what it is |",
            "|---|---:|---:|---|---:|---|---|"]
    for f in facts:
        widest = f"`{f.widest[0]}` {f.widest[1]}" if f.widest else ""
        longest = f"`{f.longest[0]}` {f.longest[1]}" if f.longest else ""
        summary = f.summary.replace("|", "\\|")
        rows.append(f"| `{f.path}` | {f.lines} | {f.classes} | {widest} | {f.functions} | {longest} | {summary} |")
    total = sum(f.lines for f in facts)
    rows.append(f"| **{len(facts)} modules** | **{total}** | | | | | |")
    return "\n".join(rows)


def sizes_section(facts: list[ModuleFacts]) -> str:
    big = [f for f in facts if f.lines > MODULE_LINES]
    wide = [f for f in facts if f.widest and f.widest[1] > CLASS_METHODS]
    longest = max((f for f in facts if f.longest), key=lambda f: f.longest[1] if f.longest else 0, default=None)
    out = [f"Targets: no module over {MODULE_LINES} lines, no class over {CLASS_METHODS} methods "
           "(public read-API classes, `LoaderStats` and `DataLoader`, may reach about 30 by delegating)."]
    out.append("")
    out.append("- Modules over the line target: " + (", ".join(f"`{f.path}` ({f.lines})" for f in big) or "none") + ".")
    out.append("- Classes over the method target: "
               + (", ".join(f"`{f.widest[0]}` in `{f.path}` ({f.widest[1]})" for f in wide if f.widest) or "none")
               + ".")
    if longest is not None and longest.longest is not None:
        out.append(f"- Longest function: `{longest.longest[0]}` in `{longest.path}` ({longest.longest[1]} lines).")
    return "\n".join(out)


def layers_section(conventions: Path = CONVENTIONS) -> str:
    """The ``LAYERS`` table of tests/test_conventions.py as a list (read with ast, never imported)."""
    tree = ast.parse(conventions.read_text(encoding="utf-8"))
    layers: dict[str, set[str]] | None = None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "LAYERS" and node.value is not None:  # type: ignore[union-attr]
            layers = {k: set(v) for k, v in _literal_layers(node.value).items()}  # type: ignore[union-attr]
    if layers is None:
        raise SystemExit(f"no LAYERS table in {conventions}: the layer rules moved; update {__file__}")
    rows = ["| layer | may import (besides itself) |", "|---|---|"]
    for name, allowed in layers.items():
        may = ", ".join(f"`{a}`" for a in sorted(allowed)) or "no other layer"
        rows.append(f"| `{name}` | {may} |")
    return "\n".join(rows)


def _literal_layers(node: ast.expr) -> dict[str, list[str]]:
    if not isinstance(node, ast.Dict):
        raise SystemExit(f"LAYERS in {CONVENTIONS} is not a dict literal")
    out: dict[str, list[str]] = {}
    for k, v in zip(node.keys, node.values):
        key = ast.literal_eval(k) if k is not None else None
        if isinstance(v, ast.Call) and getattr(v.func, "id", "") == "set" and not v.args:
            out[str(key)] = []
        else:
            out[str(key)] = sorted(ast.literal_eval(v))
    return out


def render(template: Path = TEMPLATE) -> str:
    """docs/architecture.md as it should be now."""
    facts = all_facts()
    text = template.read_text(encoding="utf-8")
    parts = {
        "<!-- generated: modules -->": modules_table(facts),
        "<!-- generated: sizes -->": sizes_section(facts),
        "<!-- generated: layers -->": layers_section(),
    }
    for marker, body in parts.items():
        if marker not in text:
            raise SystemExit(f"{template} lacks the marker {marker}: put it back where that table goes")
        text = text.replace(marker, body)
    header = (f"<!-- Generated by {FIX} from docs/architecture.template.md: edit the template, then run it. -->\n")
    return header + text


def main(argv: list[str]) -> int:
    want = render()
    if "--check" in argv:
        have = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if have != want:
            print(f"docs/architecture.md is stale: run {FIX}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(want, encoding="utf-8")
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

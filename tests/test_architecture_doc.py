"""docs/architecture.md is generated from the code (docs/gen_architecture.py fills the template's tables by
ast), so its counts cannot go stale unnoticed; its hand-written "where do I change" names files that exist."""
from __future__ import annotations

import importlib.util
import dataclasses
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
FIX = "python docs/gen_architecture.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_architecture", ROOT / "docs" / "gen_architecture.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_architecture"] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules["gen_architecture"]
    return mod


def test_architecture_doc_is_current():
    want = _generator().render()
    have = DOC.read_text(encoding="utf-8")
    assert have == want, f"docs/architecture.md is stale (module counts or the template changed): run {FIX}"


def test_where_do_i_change_names_files_that_exist():
    text = (ROOT / "docs" / "architecture.template.md").read_text(encoding="utf-8")
    section = text.split("## Where do I change", 1)[1].split("\n## ", 1)[0]
    paths = set(re.findall(r"`((?:files|loading|shards|tables|checkpoints|notebook)/[\w/]+\.py|tests/[\w/]+\.py)`",
                           section))
    assert len(paths) >= 10, paths
    missing = sorted(p for p in paths if not ((ROOT / "ucmagic" / p).exists() or (ROOT / p).exists()))
    assert not missing, (f"docs/architecture.template.md names {missing} under 'Where do I change', which no longer "
                         f"exist: point it at the modules that now hold that code, then run {FIX}")
    for topic in ("**Eviction.**", "**Protection**", "**Read-ahead.**", "**A backend**", "**A dataset kind.**"):
        assert topic in section, f"the 'Where do I change' section lost its {topic} entry"


def test_the_generator_counts_lines_classes_methods_and_the_longest_function(tmp_path):
    gen = _generator()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "mod.py").write_text(textwrap.dedent('''\
        """Two classes and a function. More text."""


        class A:
            def one(self):
                return 1

            def two(self):
                x = 1
                y = 2
                return x + y


        class B:
            def only(self):
                pass


        def free():
            pass
        '''))
    [facts] = gen.all_facts(pkg)
    assert (facts.path, facts.lines, facts.classes, facts.functions) == ("mod.py", 20, 2, 1)
    assert facts.widest == ("A", 2) and facts.longest == ("A.two", 4)
    assert facts.summary == "Two classes and a function"
    table = gen.modules_table([facts])
    assert "| `mod.py` | 20 | 2 | `A` 2 | 1 | `A.two` 4 | Two classes and a function |" in table
    sizes = gen.sizes_section([dataclasses.replace(facts, lines=gen.MODULE_LINES + 1)])
    assert f"`mod.py` ({gen.MODULE_LINES + 1})" in sizes

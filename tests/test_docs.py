"""The documentation says what the code does: docs/notebook.md against the magics' own help,
and relative links in README.md and docs/ against the files they point to."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_MD = ROOT / "docs" / "notebook.md"
MAGICS = ("ucload", "ucstage", "ucckpt")

_OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")
_CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)


def _help(magic: str) -> str:
    """What ``%magic?`` shows: the help text IPython's magic_arguments builds from the parser."""
    pytest.importorskip("IPython")
    from ucmagic.notebook.magics import UcMagics

    return getattr(UcMagics, magic).__doc__


def help_options(text: str) -> set[str]:
    """Option strings (``-b``, ``--batch-size``) of an argparse help text's option entries."""
    found = set()
    for line in text.splitlines():
        if re.match(r"^ {2}-", line):            # "  -b BATCH, --batch-size BATCH   batch size ..."
            names = re.split(r" {2,}", line.strip())[0]
            found.update(_OPTION.findall(names))
    return found


def help_choices(text: str) -> set[str]:
    """Choices of positional arguments, from ``{save,load,list}`` in the usage line."""
    usage = text.split("\n\n")[1] if text.startswith("::") else text
    return {c for group in re.findall(r"\{([\w,]+)\}", usage) for c in group.split(",")}


def doc_section(magic: str) -> str:
    """The ``## `%magic` `` section of docs/notebook.md, up to the next ``## `` heading."""
    text = NOTEBOOK_MD.read_text(encoding="utf-8")
    m = re.search(rf"^## `%{magic}`\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/notebook.md has no '## `%{magic}`' section"
    return m.group(1)


def doc_options(section: str) -> set[str]:
    """Option strings written in code (spans and blocks) of a doc section."""
    return {o for code in _CODE.findall(section) for o in _OPTION.findall(code)}


def test_help_parsing_reads_option_entries_only():
    text = """::

  %demo [-o VAR] [--fast] {a,b} source

Does things, see --not-an-entry.

positional arguments:
  {a,b}                 what to do
  source                where

options:
  -o VAR, --out VAR     bind the result
  --fast                go fast; like --not-an-entry
  --long-name-for-a-very-long-option LONG
                        wrapped description mentioning -x
"""
    assert help_options(text) == {"-o", "--out", "--fast", "--long-name-for-a-very-long-option"}
    assert help_choices(text) == {"a", "b"}
    assert doc_options("`-o VAR`, see `--fast` and the non-blocking\n```\n%demo -b 3 x\n```") == \
        {"-o", "--fast", "-b"}


@pytest.mark.parametrize("magic", MAGICS)
def test_every_magic_option_is_documented_and_no_other(magic):
    text = _help(magic)
    parser_opts, documented = help_options(text), doc_options(doc_section(magic))
    assert parser_opts, f"found no options in %{magic}'s help; has its format changed?"
    assert not parser_opts - documented, (
        f"%{magic} options missing from docs/notebook.md (add a row to its table): {sorted(parser_opts - documented)}")
    assert not documented - parser_opts, (
        f"docs/notebook.md documents %{magic} options it does not have: {sorted(documented - parser_opts)}")


@pytest.mark.parametrize("magic", MAGICS)
def test_every_action_of_a_magic_is_documented(magic):
    section = doc_section(magic)
    for choice in help_choices(_help(magic)):
        assert f"%{magic} {choice}" in section, f"docs/notebook.md shows no '%{magic} {choice}'"


def test_every_magic_setting_is_documented_and_no_other():
    pytest.importorskip("IPython")
    from ucmagic.notebook.magics import UcMagics

    settings = set(UcMagics.class_own_traits(config=True))
    documented = set(re.findall(r"UcMagics\.(\w+)", NOTEBOOK_MD.read_text(encoding="utf-8")))
    assert settings == documented, f"settings {sorted(settings)} vs docs/notebook.md {sorted(documented)}"


# ------------------------------------------------------------------ links

# Pages other branches add; their links may dangle until those branches are merged.


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files_and_headings(page):
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"^[a-z]+:", target):
            continue                              # http(s)://, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        assert dest.exists(), f"{page.name}: link to {target} -> {rel} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest.read_text(encoding="utf-8")), \
                f"{page.name}: link to {target}: no heading #{anchor} in {rel}"

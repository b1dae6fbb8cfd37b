"""Pointers in the prose stay true: every ``[Note: X]`` cited anywhere in the repository is defined somewhere, in
the file the citation names when it names one, and every repository path named in a docstring, comment or doc
exists.

A Note is defined where a line (after comment markers and docstring quotes) starts with ``[Note: X]`` followed by
nothing or by the Note's text; a citation is any other ``[Note: X]`` ("see [Note: X]", "[Note: X] in path"). A
path is a token such as ``zero_strategy/...py``, ``core/init/materialize.py``, ``tests/...py`` or ``docs/...md``;
a relative one (``runtime/hooks.py``, ``rng.py`` after "in") is found from the citing file's folder or any folder
above it, or from zero_strategy/ and zero_strategy/core/."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("zero_strategy", "tests", "examples", "benchmarks", "docs")
PACKAGE_BASES = (REPO / "zero_strategy", REPO / "zero_strategy" / "core")
# files whose paths are made-up examples (a checker's own fixtures), not pointers
EXAMPLES = (Path(__file__).resolve(), REPO / "tests" / "unit" / "test_mutation_check.py")


# a Note's name may wrap onto the next line of a comment
_GAP = r"(?:\s*\n\s*(?:#+\s*)?|\s+)"
NOTE = re.compile(r"\[Note:" + _GAP + r"((?:[^\]\n]|\n\s*(?:#+\s*)?)+?)\]")
IN_PATH = re.compile(_GAP + r"in" + _GAP + r"(?:``)?([\w./-]+\.(?:py|md))\b")
DEFINITION_LINE = re.compile(r"^\s*(?:#+\s*|[rRbB]?\"\"\"|[rRbB]?''')?\[Note:")
# repository paths: a folder of ours, then more path, ending in a source or doc suffix; not part of a longer path
ROOTS = ("zero_strategy", "core", "tests", "docs", "examples", "benchmarks", "checkpoint", "lightning", "fabric",
         "estimate", "adapter_plumbing", "deepspeed_import", "comm", "flat", "init", "plan", "runtime", "engine",
         "conf")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(ROOTS) + r")/[\w./-]*?\.(?:py|md|yaml))(?![\w/-])")


def _name(raw: str) -> str:
    return " ".join(re.sub(r"\n\s*#*", " ", raw).split())


@dataclass(frozen=True)
class Citation:
    file: Path
    line: int
    note: str
    named_file: str | None  # "[Note: X] in core/runtime/hooks.py"


def scanned_files() -> list[Path]:
    files = [REPO / "README.md"]
    for top in SCANNED:
        files += sorted(p for p in (REPO / top).rglob("*") if p.suffix in (".py", ".md") and p.is_file())
    return [p for p in files if p.exists() and "__pycache__" not in p.parts and p.resolve() not in EXAMPLES]


def notes_in(text: str) -> tuple[set[str], list[tuple[int, str, str | None]]]:
    """The Notes ``text`` defines, and its citations as (line, note, named file or None)."""
    definitions: set[str] = set()
    citations = []
    for match in NOTE.finditer(text):
        name = _name(match.group(1))
        line_start = text.rfind("\n", 0, match.start()) + 1
        after = text[match.end():text.find("\n", match.end()) if "\n" in text[match.end():] else len(text)]
        named = IN_PATH.match(text, match.end())
        at_line_start = DEFINITION_LINE.match(text[line_start:match.end()]) is not None
        # a definition's line holds nothing more, or the Note's own text; a citation goes on with ")", ".", ...
        text_follows = after.startswith(" ") and not after.lstrip().startswith((")", ".", ",", ";"))
        if at_line_start and named is None and (after.strip() == "" or text_follows):
            definitions.add(name)
        else:
            citations.append((text.count("\n", 0, match.start()) + 1, name, named.group(1) if named else None))
    return definitions, citations


def resolve(path: str, citing: Path) -> list[Path]:
    """Existing files ``path`` may mean, seen from ``citing``."""
    bases = [*citing.parents, *PACKAGE_BASES]
    return [base / path for base in bases if REPO in (base, *base.parents) and (base / path).is_file()]


def collect() -> tuple[dict[Path, set[str]], list[Citation]]:
    defined: dict[Path, set[str]] = {}
    citations: list[Citation] = []
    for file in scanned_files():
        definitions, cited = notes_in(file.read_text(encoding="utf-8"))
        defined[file] = definitions
        citations += [Citation(file, line, note, named) for line, note, named in cited]
    return defined, citations


def stale_citations(defined: dict[Path, set[str]], citations: list[Citation]) -> list[str]:
    everywhere = {note for notes in defined.values() for note in notes}
    stale = []
    for cite in citations:
        where = f"{cite.file.relative_to(REPO)}:{cite.line}"
        if cite.note not in everywhere:
            stale.append(f"{where}: [Note: {cite.note}] is defined nowhere")
        elif cite.named_file is not None:
            candidates = resolve(cite.named_file, cite.file)
            if not any(cite.note in defined.get(c, set()) for c in candidates):
                homes = sorted(str(f.relative_to(REPO)) for f, notes in defined.items() if cite.note in notes)
                stale.append(f"{where}: [Note: {cite.note}] is not in {cite.named_file} but in {homes}")
    return stale


def stale_paths(files: list[Path]) -> list[str]:
    stale = []
    for file in files:
        text = file.read_text(encoding="utf-8")
        for match in PATH.finditer(text):
            if not resolve(match.group(1), file):
                stale.append(f"{file.relative_to(REPO)}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(1)}")
    return stale


@pytest.mark.timeout(60)
def test_every_cited_note_is_defined_where_the_citation_says():
    defined, citations = collect()
    assert len(citations) > 50 and sum(map(len, defined.values())) > 50, "the scanner found almost nothing"
    assert stale_citations(defined, citations) == []


@pytest.mark.timeout(60)
def test_no_note_is_defined_twice():
    defined, _ = collect()
    homes: dict[str, list[str]] = {}
    for file, notes in defined.items():
        for note in notes:
            homes.setdefault(note, []).append(str(file.relative_to(REPO)))
    assert {note: where for note, where in homes.items() if len(where) > 1} == {}


@pytest.mark.timeout(60)
def test_every_repository_path_in_the_prose_exists():
    assert stale_paths(scanned_files()) == []


# ------------------------------------------------------------------------------- the checks can fail
def test_a_planted_stale_pointer_is_found(tmp_path, monkeypatch):
    package = tmp_path / "zero_strategy" / "core" / "runtime"
    package.mkdir(parents=True)
    (package / "hooks.py").write_text('"""Hooks.\n\n[Note: prefetch]\nWhy we prefetch.\n"""\n')
    (package / "other.py").write_text(
        "# see [Note: prefetch] in runtime/hooks.py, [Note: prefetch] in core/runtime/other.py,\n"
        "# see [Note: gone] and [Note: a name that\n# wraps] in hooks.py; also core/runtime/gather_watch.py\n"
    )
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGE_BASES", (tmp_path / "zero_strategy",
                                                                  tmp_path / "zero_strategy" / "core"))
    defined, cited = {}, []
    for file in (package / "hooks.py", package / "other.py"):
        notes, found = notes_in(file.read_text())
        defined[file] = notes
        cited += [Citation(file, line, note, named) for line, note, named in found]
    assert defined[package / "hooks.py"] == {"prefetch"} and defined[package / "other.py"] == set()
    assert [c.note for c in cited] == ["prefetch", "prefetch", "gone", "a name that wraps"]
    stale = stale_citations(defined, cited)
    assert len(stale) == 3, stale
    assert "is not in core/runtime/other.py" in stale[0] and "defined nowhere" in stale[1] and "wraps" in stale[2]
    assert stale_paths([package / "other.py"]) == [
        "zero_strategy/core/runtime/other.py:3: core/runtime/gather_watch.py"]


def test_definitions_and_citations_are_told_apart():
    definitions, citations = notes_in(
        '"""[Note: a]\ntext\n"""\n# [Note: b] Text on the same line.\n#   [Note: c]\n'
        "x = 1  # see [Note: a]\n[Note: b] in here.py)\n[Note: c]). More\n"
    )
    assert definitions == {"a", "b", "c"}
    assert [(note, named) for _, note, named in citations] == [("a", None), ("b", "here.py"), ("c", None)]

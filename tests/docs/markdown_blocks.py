"""Reading the repository's Markdown the way a reader follows it: the anchors its headings make, the relative links
it holds, and the fenced code blocks marked runnable (``<!-- runnable -->`` on the line before the opening fence).

Only what GitHub renders counts: headings, links and markers inside fenced code blocks are code, not Markdown, and
a link inside an inline code span is not a link."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

RUNNABLE_MARKER = "<!-- runnable -->"
RUNNABLE_LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) or [text](target "title"); the text may run over a line break, as wrapped prose does
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`[^`]*`")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


@dataclass(frozen=True)
class Block:
    """A fenced code block: the file, the line of its opening fence, its language and its text."""

    path: Path
    line: int
    language: str
    code: str
    runnable: bool

    @property
    def name(self) -> str:
        return f"{self.path.name}:{self.line}"


@dataclass(frozen=True)
class Link:
    path: Path
    line: int
    target: str


@dataclass
class MarkdownFile:
    path: Path
    anchors: set[str]
    links: list[Link]
    blocks: list[Block]
    errors: list[str]  # markers that mark no code block, fences left open


def github_anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (word characters, spaces and hyphens kept),
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _fence(line: str) -> str | None:
    """The language of an opening fence (``""`` for none), or None when the line is not a fence."""
    stripped = line.strip()
    return stripped[3:].strip() if stripped.startswith("```") else None


def read_markdown(path: Path) -> MarkdownFile:
    lines = path.read_text().splitlines()
    anchors: Counter[str] = Counter()
    anchor_set: set[str] = set()
    blocks: list[Block] = []
    errors: list[str] = []
    prose = list(lines)  # the lines with fenced code blanked out (line numbers kept), for the link search
    marker_line: int | None = None  # 1-based line of a runnable marker still waiting for its fence
    index = 0
    while index < len(lines):
        line = lines[index]
        language = _fence(line)
        if language is not None:
            start = index
            index += 1
            while index < len(lines) and _fence(lines[index]) is None:
                index += 1
            if index == len(lines):
                errors.append(f"{path.name}:{start + 1}: a code fence is never closed")
            body = lines[start + 1 : index]
            indent = len(line) - len(line.lstrip())
            code = "\n".join(body_line[indent:] if body_line[:indent].isspace() else body_line for body_line in body)
            blocks.append(Block(path, start + 1, language, code + "\n", marker_line is not None))
            marker_line = None
            for blanked in range(start, min(index + 1, len(lines))):
                prose[blanked] = ""
            index += 1
            continue
        if marker_line is not None and line.strip():
            errors.append(f"{path.name}:{marker_line}: {RUNNABLE_MARKER} is not followed by a fenced code block")
            marker_line = None
        if line.strip() == RUNNABLE_MARKER:
            marker_line = index + 1
        heading = HEADING.match(line)
        if heading:
            anchor = github_anchor(heading.group(2))
            anchor_set.add(anchor if anchors[anchor] == 0 else f"{anchor}-{anchors[anchor]}")
            anchors[anchor] += 1
        index += 1
    if marker_line is not None:
        errors.append(f"{path.name}:{marker_line}: {RUNNABLE_MARKER} is not followed by a fenced code block")
    text = CODE_SPAN.sub(lambda span: "\n" * span.group(0).count("\n"), "\n".join(prose))
    links = [Link(path, text.count("\n", 0, found.start()) + 1, found.group(1)) for found in LINK.finditer(text)]
    return MarkdownFile(path, anchor_set, links, blocks, errors)


def broken_links(files: list[MarkdownFile]) -> list[str]:
    """Every relative link that names a missing file or directory, or an anchor the Markdown file it names lacks."""
    by_path = {markdown.path.resolve(): markdown for markdown in files}
    problems = []
    for markdown in files:
        for link in markdown.links:
            if EXTERNAL.match(link.target):
                continue
            file_part, _, anchor = link.target.partition("#")
            target = (markdown.path.parent / file_part).resolve() if file_part else markdown.path.resolve()
            where = f"{markdown.path.name}:{link.line}: ({link.target})"
            if not target.exists():
                problems.append(f"{where} names {target}, which does not exist")
                continue
            if not anchor:
                continue
            if target.suffix != ".md":
                problems.append(f"{where} has an anchor into {target.name}, which is not Markdown")
                continue
            named = by_path.get(target) or read_markdown(target)
            if anchor not in named.anchors:
                problems.append(f"{where}: {target.name} has no heading with the anchor #{anchor}")
    return problems

"""The README and docs/ stay true to the repository: every relative link resolves (the file or directory, and the
heading an ``#anchor`` names), and every fenced block marked ``<!-- runnable -->`` runs and exits 0.

Runnable shell blocks run with ``bash -e -o pipefail`` from a copy of a directory holding what the docs' commands
read (``checkpoints/last.ckpt``, a small sharded checkpoint of a Hugging Face GPT-2 trained under zero3 by the
Trainer, and ``base-model/config.json``; see docs_workspace.py); python blocks run as a script there. ``python``
and the console scripts are this interpreter's, and the repository root is on PYTHONPATH (``python -m
benchmarks...``). The blocks run two at a time, each in its own copy of the directory.

Mark only blocks that run in seconds on a CPU; ``make train`` and the benchmarks are not marked."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from markdown_blocks import RUNNABLE_LANGUAGES, RUNNABLE_MARKER, Block, broken_links, read_markdown

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CLEARED_ENV = {"LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "RANK", "MASTER_ADDR", "PL_GLOBAL_SEED"}
BLOCK_TIMEOUT_S = 240  # each block takes seconds on a quiet machine; a loaded one runs them several times slower


def runnable_blocks() -> list[Block]:
    return [block for path in DOC_FILES for block in read_markdown(path).blocks if block.runnable]


def block_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in CLEARED_ENV}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def run_block(block: Block, directory: Path) -> subprocess.CompletedProcess[str]:
    """Run ``block`` from ``directory``; its exit status and output."""
    if block.language not in RUNNABLE_LANGUAGES:
        raise ValueError(f"{block.name}: a block marked {RUNNABLE_MARKER} must be one of "
                         f"{sorted(RUNNABLE_LANGUAGES)}, not {block.language!r}")
    interpreter = RUNNABLE_LANGUAGES[block.language]
    script = directory / ("block.py" if interpreter == "python" else "block.sh")
    script.write_text(block.code)
    command = [sys.executable, script.name] if interpreter == "python" else ["bash", "-e", "-o", "pipefail",
                                                                           script.name]
    # a session of its own, so that a block that runs too long is ended with everything it started
    with subprocess.Popen(command, cwd=directory, env=block_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # this block fails; the others still run and report
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            return subprocess.CompletedProcess(command, -1, stdout, f"{stderr}\ntimed out after {BLOCK_TIMEOUT_S} s")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def check_ran(block: Block, done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, (
        f"{block.name}: the block marked runnable exited with {done.returncode}\n--- block\n{block.code}"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-5000:]}")


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every runnable block's result, run two at a time after the shared directory is made."""
    workspace = tmp_path_factory.mktemp("docs_workspace")
    made = subprocess.run([sys.executable, str(Path(__file__).with_name("docs_workspace.py")), str(workspace)],
                          env=block_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-5000:]
    assert (workspace / "checkpoints" / "last.ckpt").is_dir()

    def run_in_copy(block: Block) -> tuple[str, subprocess.CompletedProcess[str]]:
        directory = tmp_path_factory.mktemp("block")
        shutil.copytree(workspace, directory, dirs_exist_ok=True)
        return block.name, run_block(block, directory)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run_in_copy, runnable_blocks()))


# -------------------------------------------------------------------------------------------- the repository's docs
def test_every_relative_link_resolves() -> None:
    files = [read_markdown(path) for path in DOC_FILES]
    assert sum(len(markdown.links) for markdown in files) > 0
    assert broken_links(files) == []


def test_every_runnable_marker_marks_a_runnable_block() -> None:
    errors = [error for path in DOC_FILES for error in read_markdown(path).errors]
    assert errors == []
    wrong = [block.name for block in runnable_blocks() if block.language not in RUNNABLE_LANGUAGES]
    assert wrong == [], f"marked runnable but neither shell nor python: {wrong}"
    marked_in = {block.path.name for block in runnable_blocks()}
    assert "README.md" in marked_in and len(marked_in) > 1, f"runnable blocks only in {marked_in}"


@pytest.mark.timeout(1200)  # the first case waits for the shared directory and every block, two at a time
@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda block: block.name)
def test_runnable_block_runs(block: Block, block_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    check_ran(block, block_runs[block.name])


# ------------------------------------------------------------------------------------- the checker can fail at all
CHECKED = """# Title

## Second `part`: here

[good](#title) [good too](#second-part-here) [wrapped
text](other.md#other) [file](other.md) `[in code](missing.md)`

[missing file](nowhere.md) [missing anchor](#nowhere) [missing there](other.md#title)

```bash
[in a fence](missing-too.md)
# not a heading
```
"""


def test_broken_links_are_found_and_only_those(tmp_path: Path) -> None:
    (tmp_path / "doc.md").write_text(CHECKED)
    (tmp_path / "other.md").write_text("# Other\n\n```\n# Title\n```\n")
    problems = broken_links([read_markdown(tmp_path / "doc.md")])
    assert len(problems) == 3, problems
    assert [problem.split(":")[1] for problem in problems] == ["8", "8", "8"], problems
    for target in ("nowhere.md", "#nowhere", "other.md#title"):
        assert any(f"({target})" in problem for problem in problems), (target, problems)


def test_markers_and_blocks_are_read_as_written(tmp_path: Path) -> None:
    (tmp_path / "doc.md").write_text(f"{RUNNABLE_MARKER}\n```bash\necho hi\n```\n\n```python\nx = 1\n```\n\n"
                                     f"- item\n\n  {RUNNABLE_MARKER}\n  ```python\n  print(1)\n  ```\n\n"
                                     f"{RUNNABLE_MARKER}\nsome prose\n")
    markdown = read_markdown(tmp_path / "doc.md")
    assert [(b.language, b.code, b.runnable) for b in markdown.blocks] == [
        ("bash", "echo hi\n", True), ("python", "x = 1\n", False), ("python", "print(1)\n", True)]
    assert markdown.errors == [f"doc.md:17: {RUNNABLE_MARKER} is not followed by a fenced code block"]


def test_a_failing_runnable_block_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for language, code in (("bash", "false\necho never reached\n"), ("bash", "false | cat\n"),
                           ("python", "raise SystemExit(3)\n")):
        block = Block(tmp_path / "doc.md", 1, language, code, True)
        with pytest.raises(AssertionError, match="exited with"):
            check_ran(block, run_block(block, tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "BLOCK_TIMEOUT_S", 1)
    hanging = Block(tmp_path / "doc.md", 1, "bash", "sleep 30\n", True)
    with pytest.raises(AssertionError, match="timed out after 1 s"):
        check_ran(hanging, run_block(hanging, tmp_path))
    monkeypatch.undo()
    passing = Block(tmp_path / "doc.md", 1, "bash", "true\n", True)
    check_ran(passing, run_block(passing, tmp_path))
    with pytest.raises(ValueError, match="must be one of"):
        run_block(Block(tmp_path / "doc.md", 1, "text", "$ zero-estimate\n", True), tmp_path)

"""Everything the README and the docs pages show runs as written, so pages and code cannot drift.

The pages are README.md and every ``docs/*.md`` (a page added later is picked up by itself). Their
conventions, implemented here (any section added later is picked up by itself too):

- A ```python block runs in a fresh interpreter (its own subprocess), in a scratch directory.
- ``<!-- run: gloo N -->`` on the line right before a block: the block runs on each of N spawned
  processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) and
  nothing else: it initialises ``torch.distributed`` and reads its rank itself, so it runs as
  pasted into a ``torchrun`` script. The blocks of one page needing the same N share one spawned
  job, in page order, each in a fresh namespace.
- ``<!-- run: skip (reason) -->``: not run; the reason is required.
- In any fenced block, a line starting with ``$ `` is a shell command, run with the venv's
  ``python``/``meshgroups`` first on PATH. The lines after it, up to the next ``$ `` or the fence,
  are its expected output (stdout and stderr together), ``...`` matching any text, line breaks
  included (doctest's ELLIPSIS); a command shown without output must exit 0.
- A top-level expression whose trailing comment starts with a Python literal (up to two spaces)
  is checked: ``lay.coords(13)  # {'pp': 1, ...}`` asserts the value equals the literal.

A test's id names the page and line (``docs/faults.md:42``), and so do failures and tracebacks.
Commands and blocks run in a scratch directory holding a copy of the repository's top level
(packages aside), so ``-o docs/layout.png`` writes there, never into the checkout.
"""

from __future__ import annotations

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..support.dist import PortTaken, free_port, run, scaled

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(\s*)```(.*)$")
DIRECTIVE = re.compile(r"^<!--\s*run:\s*(.*?)\s*-->\s*$")


def _name(path: Path) -> str:
    """The page as the repository names it: ``README.md``, ``docs/faults.md``."""
    return path.relative_to(ROOT).as_posix()


@dataclass(frozen=True)
class Block:
    line: int  # page line of the first line of code (1-based)
    lang: str
    code: str
    directive: str | None  # "gloo N", "skip (reason)" or None
    page: str = "README.md"  # the page, as the repository names it

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(text: str, page: str = "README.md") -> list[Block]:
    """Every fenced block of a markdown text, with the run directive on the line before it."""
    lines = text.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = len(opening.group(1)), opening.group(2).strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: fence never closed")
        before = DIRECTIVE.match(lines[i - 1].strip()) if i > 0 else None
        code = "\n".join(line[indent:] for line in lines[i + 1 : end])
        blocks.append(Block(i + 2, lang, code, before.group(1) if before else None, page))
        i = end + 1
    return blocks


def directives(text: str) -> list[tuple[int, str, str]]:
    """(line, directive, the line after it) for every run directive."""
    lines = text.split("\n")
    return [
        (n + 1, m.group(1), lines[n + 1] if n + 1 < len(lines) else "")
        for n, line in enumerate(lines)
        if (m := DIRECTIVE.match(line.strip()))
    ]


BLOCKS = [block for path in PAGES for block in parse(path.read_text(), _name(path))]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def _kind(block: Block) -> tuple[str, int | str | None]:
    if block.directive is None:
        return "process", None
    if m := re.fullmatch(r"gloo\s+(\d+)", block.directive):
        return "gloo", int(m.group(1))
    if m := re.fullmatch(r"skip\s*\((.*)\)", block.directive):
        return "skip", m.group(1).strip()
    return "unknown", block.directive


# --- checked comments ---------------------------------------------------------------------------


def _claim(comment: str) -> str | None:
    """The literal a comment states (``# [0, 4]  (a flattened group)`` -> ``[0, 4]``), or None."""
    text = comment.lstrip("#").strip()
    for candidate in (text.split("  ")[0], text):
        try:
            ast.literal_eval(candidate)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        return candidate
    return None


def with_checks(code: str, first_line: int, page: str = "README.md") -> str:
    """``code`` with every top-level expression whose comment states a literal turned into an
    assertion of it; line numbers unchanged (the edits stay on the expression's own lines)."""
    tree = ast.parse(code)
    comments = {
        tok.start[0]: tok.string
        for tok in tokenize.generate_tokens(io.StringIO(code).readline)
        if tok.type == tokenize.COMMENT
    }
    lines = code.split("\n")
    for node in tree.body:
        if not isinstance(node, ast.Expr) or node.end_lineno not in comments:
            continue
        claim = _claim(comments[node.end_lineno])
        if claim is None:
            continue
        last, end = node.end_lineno - 1, node.end_col_offset
        where = first_line + node.end_lineno - 1
        lines[last] = f"{lines[last][:end]}), {claim!r}){lines[last][end:]}"
        lines[node.lineno - 1] = f"__readme_check__({page!r}, {where}, ({lines[node.lineno - 1]}"
    return "\n".join(lines)


CHECK = (
    "def __readme_check__(page, line, value, claim):\n"
    "    assert value == __import__('ast').literal_eval(claim), "
    "f'{page}:{line}: the page says {claim}, the code gives {value!r}'\n"
)


def runnable(block: Block) -> str:
    """The block as a script whose line numbers are the page's (tracebacks point there), with
    the checking helper in the blank lines before it."""
    assert block.line > CHECK.count("\n"), f"{block.where}: a block starts after the page's first lines"
    return (
        CHECK + "\n" * (block.line - 1 - CHECK.count("\n")) + with_checks(block.code, block.line, block.page)
    )


SKIP_IN_SCRATCH = {
    ".git",
    ".venv",
    ".venv214",
    ".venv215",  # CI's other venvs, by name too: .ci/run makes .venv-vllm while this suite runs
    ".venv-vllm",
    "__pycache__",
    "build",
    "dist",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
}


def _scratch(tmp_path: Path) -> Path:
    """A working directory holding a copy of the repository's top-level files and folders
    (Python packages left out: a copy of ``meshgroups/`` there would shadow the installed one
    for ``python -m``), so a command reads ``notebooks/...`` and writes ``docs/...`` in the copy."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for child in ROOT.iterdir():
        if child.name in SKIP_IN_SCRATCH or child.name.endswith(".egg-info"):
            continue
        if (child / "pyvenv.cfg").is_file():  # any virtual env (.venv214 of docs/index.md): GBs
            continue
        if child.is_file():
            shutil.copy2(child, cwd / child.name)
        elif child.is_dir() and not (child / "__init__.py").exists():
            shutil.copytree(
                child, cwd / child.name, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints")
            )
    return cwd


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("MPLBACKEND", None)
    return env


# --- python blocks ------------------------------------------------------------------------------


def test_the_pages_have_blocks_of_every_kind():
    kinds = {_kind(b)[0] for b in PYTHON}
    assert {"process", "gloo"} <= kinds, kinds
    readme = [b for b in PYTHON if b.page == "README.md"]
    assert len(readme) >= 7 and len(PYTHON) >= 20 and COMMANDS
    assert len(PAGES) >= 10, [_name(p) for p in PAGES]


def test_every_directive_is_known_and_sits_on_a_python_block():
    for path in PAGES:
        for line, directive, after in directives(path.read_text()):
            assert after.strip() == "```python", (
                f"{_name(path)}:{line}: <!-- run: {directive} --> must sit right before a ```python block"
            )
    for block in PYTHON:
        kind, arg = _kind(block)
        assert kind != "unknown", f"{block.where}: unknown directive {arg!r} (gloo N | skip (reason))"
        if kind == "skip":
            assert arg, f"{block.where}: `skip` needs a reason: <!-- run: skip (why) -->"
        if kind == "gloo":
            assert 1 <= int(str(arg)) <= 16, f"{block.where}: gloo {arg}: 1..16 processes"


PROCESS = [b for b in PYTHON if _kind(b)[0] == "process"]


@pytest.mark.processes
@pytest.mark.parametrize("block", PROCESS, ids=[b.where for b in PROCESS])
def test_python_block_runs_in_a_fresh_interpreter(block, tmp_path):
    scratch = _scratch(tmp_path)
    script = tmp_path / f"page_block_{block.line}.py"
    script.write_text(runnable(block))
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=scratch,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=scaled(180),
    )
    assert out.returncode == 0, f"{block.where} failed:\n{out.stdout}\n{out.stderr}"


def _run_blocks(rank: int, world: int, blocks: list[tuple[str, int, str, bool]], ports: list[int]) -> int:
    """In one spawned process: every block of one page and world size, in page order (see the
    module docstring); torchrun's variables set, a fresh default group for a block that makes its
    own."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
    )
    for (page, line, code, _), port in zip(blocks, ports):
        os.environ["MASTER_PORT"] = str(port)
        if dist.is_initialized():  # a block that did not destroy its default group
            dist.destroy_process_group()
        namespace = {"__name__": "__main__"}  # as in a torchrun script: no harness names
        try:
            exec(compile(code, str(ROOT / page), "exec"), namespace)
        except BaseException as exc:
            raise AssertionError(f"{page}:{line}: the block failed on rank {rank}: {exc!r}") from exc
        if dist.is_initialized():
            # Rank 0 hosts this block's store (tcp://, where torchrun's agent would outlive the
            # workers): every rank done with the block before rank 0 moves on and drops it; a
            # rank still in its last call would otherwise lose the store under it.
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return len(blocks)


GLOO: dict[tuple[str, int], list[Block]] = {}  # (page, N): one spawned job each
for _b in PYTHON:
    if _kind(_b)[0] == "gloo":
        GLOO.setdefault((_b.page, int(str(_kind(_b)[1]))), []).append(_b)


def test_every_block_run_on_processes_stands_alone_in_a_torchrun_script():
    """Nothing is injected: a block that uses ``rank`` defines it, and it initialises the
    default group itself."""
    lacking = []
    for blocks in GLOO.values():
        for b in blocks:
            tree = ast.parse(b.code)
            stored = {
                n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
            }
            loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            if "init_process_group(" not in b.code:
                lacking.append(f"{b.where}: does not call init_process_group")
            lacking += [
                f"{b.where}: uses {name} without defining it"
                for name in ("rank", "world_size")
                if name in loaded - stored
            ]
    assert not lacking, "\n".join(lacking)


@pytest.mark.processes
@pytest.mark.parametrize("job", list(GLOO), ids=[f"{page}-gloo{world}" for page, world in GLOO])
def test_gloo_blocks_run_on_real_processes(job):
    world = job[1]
    blocks = [(b.page, b.line, runnable(b), "init_process_group(" in b.code) for b in GLOO[job]]
    for attempt in range(3):
        ports = [free_port() for _ in blocks]  # fresh ones if another process took one meanwhile
        try:
            done = run(
                _run_blocks,
                world,
                blocks,
                ports,
                backend=None,
                timeout=120 + 60 * len(blocks),
                port_retries=0,
            )
            break
        except PortTaken:
            if attempt == 2:
                raise
    assert done == [len(blocks)] * world


def test_skipped_blocks_give_a_reason_and_compile():
    """``<!-- run: skip (reason) -->`` blocks are not run, but they are valid Python."""
    for block in PYTHON:
        kind, reason = _kind(block)
        if kind == "skip":
            assert reason, f"{block.where}: `skip` needs a reason"
            compile(runnable(block), str(ROOT / block.page), "exec")


# --- shell commands -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    line: int
    command: str
    output: str | None  # None: nothing shown, the command must succeed
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def commands(blocks: list[Block]) -> list[Command]:
    found = []
    for block in blocks:
        if block.lang == "python":
            continue
        lines = block.code.split("\n")
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
        for k, i in enumerate(starts):
            stop = starts[k + 1] if k + 1 < len(starts) else len(lines)
            shown = [line.rstrip() for line in lines[i + 1 : stop]]
            while shown and not shown[-1]:
                shown.pop()
            found.append(
                Command(block.line + i, lines[i][2:], "\n".join(shown) if shown else None, block.page)
            )
    return found


def matches(shown: str, actual: str) -> bool:
    """``actual`` equals ``shown``, where ``...`` in ``shown`` stands for any text (newlines too);
    trailing spaces of lines and of the whole output are ignored."""
    actual = "\n".join(line.rstrip() for line in actual.strip("\n").split("\n"))
    pattern = ".*?".join(re.escape(part) for part in shown.split("..."))
    return re.fullmatch(pattern, actual, flags=re.DOTALL) is not None


COMMANDS = commands(BLOCKS)


def test_output_matching():
    assert matches("usage: x ...\nerror: bad", "usage: x [-h]\n  [dims ...]\nerror: bad\n")
    assert not matches("error: bad", "usage: x\nerror: bad")
    assert not matches("a\nb", "a\nc")


@pytest.mark.processes
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_shell_command_gives_the_output_shown(cmd, tmp_path):
    out = subprocess.run(
        ["bash", "-c", cmd.command],
        cwd=_scratch(tmp_path),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=scaled(300),
    )
    if cmd.output is None:
        assert out.returncode == 0, f"{cmd.where}: `{cmd.command}` exited {out.returncode}:\n{out.stdout}"
    else:
        assert matches(cmd.output, out.stdout), (
            f"{cmd.where}: `{cmd.command}`\n--- the page shows:\n{cmd.output}\n--- it prints:\n{out.stdout}"
        )


# --- what the pages say about the extras -------------------------------------------------------


@pytest.mark.processes
def test_plot_without_matplotlib_says_what_the_docs_say(tmp_path):
    """Without the plot extra, `plot` prints an install hint; the CLI page quotes that hint."""
    hide = (
        "import sys; sys.modules['matplotlib'] = None; from meshgroups.cli._app import main; sys.exit(main())"
    )
    out = subprocess.run(
        [sys.executable, "-c", hide, "plot", "tp=2", "-o", "x.png"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert out.returncode != 0 and not (tmp_path / "x.png").exists()
    hint = re.search(r"pip install \S+", out.stderr)
    assert hint, out.stderr
    flat = " ".join((ROOT / "docs" / "cli.md").read_text().split())  # a quote may wrap across lines
    assert " ".join(out.stderr.split()) in flat, (out.stderr, "is not quoted in docs/cli.md")

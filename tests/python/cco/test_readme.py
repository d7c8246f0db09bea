"""The code in the README and the guide runs as written, so it cannot rot unnoticed.

The convention the README states: a fenced ``python`` block is a whole program, started with
``torchrun --nproc-per-node 2 file.py``; it runs on CPU ranks as written and takes a GPU per rank
where CUDA is present. Shell commands sit in fenced ``sh`` blocks, each saying in a comment what
hardware it needs; most need a GPU or minutes, so each command's module or script is checked to
exist in this tree and every flag it passes to be one the module defines. No indented (4-space)
code block is left, so no command escapes both checks.

Guards: the README of before this test (seven undefined names, an NCCL process group on a CPU
build of torch, ``w_shard`` / ``x_shard`` never made) fails ``test_python_block_runs_on_two_cpu_ranks``.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from tests.python.cco.cpu_ranks import torchrun_two_ranks

ROOT = Path(__file__).resolve().parents[3]
DOCS = ("README.md", "docs/guide.md")
_FENCE = re.compile(r"^```(\w*)\s*$")
BLOCK_TIMEOUT_S = 120  # one block: torchrun, two ranks importing torch, a small op (~5-15 s here)


def fenced_blocks(path: Path, lang: str) -> list[tuple[int, str]]:
    """(first line number, text) of every fenced block of ``lang`` in ``path``."""
    out, current, start = [], None, 0
    for no, line in enumerate(path.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if fence and current is None:
            current, start, block_lang = [], no + 1, fence.group(1)
        elif line.startswith("```") and current is not None:
            if block_lang == lang:
                out.append((start, "\n".join(current) + "\n"))
            current = None
        elif current is not None:
            current.append(line)
    return out


def indented_code_blocks(path: Path) -> list[int]:
    """Line numbers where an indented (4-space) code block starts outside a fence: a line indented
    by 4 spaces after a blank line (list continuations in these docs indent by 2)."""
    starts, in_fence, prev_blank = [], False, True
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_fence = not in_fence
        elif not in_fence and prev_blank and line.startswith("    ") and line.strip():
            starts.append(no)
        prev_blank = not line.strip()
    return starts


def _cases(lang):
    return [pytest.param(doc, start, text, id=f"{doc}:{start}")
            for doc in DOCS if (ROOT / doc).exists() for start, text in fenced_blocks(ROOT / doc, lang)]


def _commands(block: str):
    """Each command of a shell block, as tokens: comments dropped, continuations joined, ``&&`` split."""
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        for command in filter(None, (c.strip() for c in line.split("&&"))):
            yield shlex.split(command)


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def _repo_module(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) where ``tokens`` run a module of this tree with ``-m``, else None."""
    runners = {"python", "python3", "torchrun", "mpiexec", "mpirun"}
    if not tokens or os.path.basename(tokens[0]) not in runners or "-m" not in tokens:
        return None
    i = tokens.index("-m")
    module = tokens[i + 1]
    if not (ROOT / module.split(".")[0]).is_dir():
        return None  # pytest, torch.distributed.run, ...: not this tree's
    return module, tokens[i + 2:]


@pytest.mark.host
@pytest.mark.parametrize("doc", DOCS)
def test_no_indented_code_block(doc):
    """Code sits in fenced blocks, where the tests below find it."""
    path = ROOT / doc
    if not path.exists():
        pytest.fail(f"{doc} is missing")
    assert indented_code_blocks(path) == [], f"{doc}: indented code blocks at lines {indented_code_blocks(path)}; " \
                                             "fence them as ```sh (commands) or ```python (a program)"


@pytest.mark.host
def test_readme_has_python_and_shell_blocks():
    """The extraction finds the README's blocks (a renamed fence would otherwise check nothing)."""
    assert len(fenced_blocks(ROOT / "README.md", "python")) >= 2
    assert len(fenced_blocks(ROOT / "README.md", "sh")) >= 3


@pytest.mark.host
@pytest.mark.parametrize("doc,start,text", _cases("sh"))
def test_shell_block_names_real_modules_and_flags(doc, start, text):
    """Every module a shell command runs exists here and defines every flag the command passes;
    every script it runs with bash exists."""
    problems = []
    for tokens in _commands(text):
        if tokens[0] in ("bash", "sh") and len(tokens) > 1 and not (ROOT / tokens[1]).is_file():
            problems.append(f"{tokens[1]}: no such script")
        found = _repo_module(tokens)
        if found is None:
            continue
        module, args = found
        path = _module_file(module)
        if path is None:
            problems.append(f"-m {module}: no such module")
            continue
        source = path.read_text()
        for flag in (a.split("=")[0] for a in args if a.startswith("-")):
            if f'"{flag}"' not in source and f"'{flag}'" not in source:
                problems.append(f"-m {module} {flag}: {path.relative_to(ROOT)} defines no such flag")
    assert not problems, f"{doc}, block at line {start}: " + "; ".join(problems)


@pytest.mark.multirank
@pytest.mark.parametrize("doc,start,text", _cases("python"))
def test_python_block_runs_on_two_cpu_ranks(doc, start, text, tmp_path):
    """The block, saved as a file, runs under ``torchrun --nproc-per-node 2`` on CPU ranks and
    exits 0 on both (its own asserts check its results)."""
    script = tmp_path / f"block_{start}.py"
    script.write_text(text)
    torchrun_two_ranks(script, timeout_s=BLOCK_TIMEOUT_S, env={"CUDA_VISIBLE_DEVICES": ""}, cwd=tmp_path,
                       what=f"{doc}, python block at line {start} failed:\n")

"""Compile environment for the gfx950 FlyDSL kernels on a machine without an AMD GPU.

FlyDSL compiles for gfx950 on a CPU when four things hold:

1. ``FLYDSL_GPU_ARCH=gfx950``: without it the target silently defaults to gfx942 (``ARCH`` alone
   gives a mixed build);
2. ``COMPILE_ONLY=1``: ``flyc.compile`` returns after codegen instead of loading a HIP runtime;
3. ``$ROCM_PATH/llvm/bin/ld.lld`` exists: the last pass links the code object with it. flydsl 0.5
   emits code object v6 (``abi=600``), which only lld >= 18 links (lld 14 stops with
   "unknown abi version"), so a system lld of that age is symlinked into a private root;
4. ``FLYDSL_DEBUG_DUMP_ASM=1`` + ``FLYDSL_DUMP_DIR``: the final ISA is written as a ``.s`` file.

The kernel cache is switched off inside :func:`compile_env` so every compile produces its ISA.
The private root lives in a cache folder (``$CCO_CACHE_DIR`` or ``~/.cache/cco``), never in the
source tree. CALLING a kernel compiled this way without a gfx950 device aborts the process.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ARCH = "gfx950"
MIN_LLD_MAJOR = 18  # first lld that links AMDGPU code object v6
_LLD_CANDIDATES = (
    *(f"/usr/bin/ld.lld-{v}" for v in range(22, MIN_LLD_MAJOR - 1, -1)),
    *(f"/usr/lib/llvm-{v}/bin/ld.lld" for v in range(22, MIN_LLD_MAJOR - 1, -1)),
    "/usr/bin/ld.lld",
)


class ToolchainError(RuntimeError):
    """The machine lacks what a CPU compile for gfx950 needs; the message says what to install."""


def cache_dir() -> Path:
    root = os.environ.get("CCO_CACHE_DIR") or os.path.join(Path.home(), ".cache", "cco")
    return Path(root)


def _lld_major(path: str) -> int | None:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"LLD (\d+)\.", out)
    return int(m.group(1)) if m else None


def find_lld() -> str:
    """Path of an ld.lld able to link gfx950 code object v6 (``$CCO_LD_LLD`` wins)."""
    explicit = os.environ.get("CCO_LD_LLD")
    candidates = (explicit,) if explicit else (*_LLD_CANDIDATES, shutil.which("ld.lld"))
    seen = []
    for path in candidates:
        if not path or not os.path.exists(path):
            continue
        major = _lld_major(path)
        seen.append(f"{path} (LLD {major})")
        if major is not None and major >= MIN_LLD_MAJOR:
            return path
    raise ToolchainError(
        f"no ld.lld >= {MIN_LLD_MAJOR} found (checked: {', '.join(seen) or 'none'}); flydsl emits code "
        f"object v6, which older lld cannot link. Fix: `apt-get install lld-19` (Debian 12 ships it), "
        f"or point CCO_LD_LLD at an ld.lld >= {MIN_LLD_MAJOR}"
    )


def rocm_root() -> Path:
    """A private ROCM_PATH holding only ``llvm/bin/ld.lld``, created on first use."""
    lld = find_lld()
    root = cache_dir() / f"rocm-lld-{_lld_major(lld)}"
    link = root / "llvm" / "bin" / "ld.lld"
    if not (link.is_symlink() and os.readlink(link) == lld):
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f"ld.lld.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(lld)
        os.replace(tmp, link)  # atomic: concurrent test workers see the old or the new link
    return root


def flydsl_available() -> str | None:
    """None when the CPU compile path is usable, else the reason it is not."""
    try:
        importlib.import_module("flydsl.compiler")  # needs torch and numpy: the import is the probe
    except Exception as exc:  # ImportError, or a broken install
        return f"flydsl is not importable ({exc.__class__.__name__}: {exc}); pip install 'flydsl>=0.5'"
    try:
        find_lld()
    except ToolchainError as exc:
        return str(exc)
    return None


def cli_unavailable(prog: str) -> int | None:
    """For a command line tool: None when it can compile here, else exit status 2 after saying why."""
    why = flydsl_available()
    if why is None:
        return None
    print(f"{prog}: cannot compile for gfx950 here: {why}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def compile_env(dump_dir: str | os.PathLike):
    """Environment for one compile-only gfx950 build that dumps its ISA under ``dump_dir``."""
    env = {
        "FLYDSL_GPU_ARCH": ARCH,
        "ROCM_PATH": str(rocm_root()),
        "COMPILE_ONLY": "1",
        "FLYDSL_DEBUG_DUMP_ASM": "1",
        "FLYDSL_DUMP_DIR": str(dump_dir),
        "FLYDSL_RUNTIME_ENABLE_CACHE": "0",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield Path(dump_dir)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def find_isa(dump_dir: str | os.PathLike) -> Path:
    """The final-ISA ``.s`` file a compile under :func:`compile_env` wrote."""
    found = sorted(Path(dump_dir).rglob("*final_isa.s"))
    if len(found) != 1:
        raise ToolchainError(f"expected one *final_isa.s under {dump_dir}, found {[str(p) for p in found]}")
    return found[0]

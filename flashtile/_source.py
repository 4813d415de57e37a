"""The source lines of flashtile's kernel functions, found without tokenizing, while the kernel modules are defined.

Each `@triton.jit` / `@gluon.jit` function reads its own source when it is decorated (`inspect.getsourcelines`),
and inspect finds where a function ends by running Python's tokenizer over it. The attention kernels' modules define
~170 such functions, so every process's first call spent ~0.1 s of its import of them in the tokenizer, with a warm
Triton cache too (docs/design-record.md, "Cold start").

`kernel_sources()` stands in for `inspect.getsourcelines` while the kernel modules import (kernels/__init__.py, and
the stand-ins of flashtile/_lazy.py): a function defined in a file of this package ends at the last line of code
before the first line of code indented no deeper than its `def`; anything else goes to inspect. That reading is
only right for code written as this package writes it (no continuation line or string line indented back to the
`def`'s level inside a function), and `tests/test_source.py` checks that it returns what inspect returns for every
kernel function of the package.
"""
import contextlib
import functools
import hashlib
import inspect
import linecache
import os
import pathlib
import threading

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_lock = threading.Lock()
_depth = 0
_original = inspect.getsourcelines


def getsourcelines(obj):
    """(lines, first line number) of a function defined in this package, as inspect.getsourcelines gives them;
    None for anything else (no code object, or a file outside the package)."""
    code = getattr(obj, "__code__", None)
    if code is None or not code.co_filename.startswith(_PACKAGE_DIR):
        return None
    lines = linecache.getlines(code.co_filename)
    first = code.co_firstlineno  # (the first decorator's line, as inspect starts there)
    if not (0 < first <= len(lines)) or not lines[first - 1].lstrip().startswith(("@", "def ", "async def ")):
        return None  # (a lambda, or a line that is not a function's own: inspect's)
    i = first - 1
    while i < len(lines) and not lines[i].lstrip().startswith(("def ", "async def ")):
        i += 1
    if i == len(lines):
        return None
    indent = len(lines[i]) - len(lines[i].lstrip())
    last = i + 1
    for j in range(i + 1, len(lines)):
        text = lines[j].strip()
        if not text or text.startswith("#"):  # (blank and comment lines neither end the block nor close it)
            continue
        if len(lines[j]) - len(lines[j].lstrip()) <= indent:
            break
        last = j + 1
    return lines[first - 1:last], first


def _getsourcelines(obj):
    found = getsourcelines(obj)
    return _original(obj) if found is None else found


@contextlib.contextmanager
def kernel_sources():
    """Within it, inspect.getsourcelines takes this module's reading for the package's functions (reentrant; the
    original is restored when the outermost one exits)."""
    global _depth
    with _lock:
        if _depth == 0:
            inspect.getsourcelines = _getsourcelines
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                inspect.getsourcelines = _original


@functools.lru_cache(maxsize=None)
def package_digest():
    """SHA-256 (hex) of this package's Python sources, each file's path within the package and its bytes in path
    order: what the kernel index's salt holds (kernels/_index.py), and what `python -m flashtile bench` records,
    so that two trees timed against each other show which one each process ran."""
    package = pathlib.Path(_PACKAGE_DIR)
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()

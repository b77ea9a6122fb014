"""The commands and Python snippets shown in the docs, so tests run exactly what the docs show.

A doc command is a line of a ```bash block (continuation lines joined) in one of DOCS. Tests fetch one
with `doc_command("unique prefix")` and run it, adding flags that shrink the work (argparse takes the
last value of a repeated flag) or point outputs at a temporary directory. `tests/docs/test_docs.py` checks
that every doc command is fetched by some test, so a command added to the docs without a test fails CI.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "train/README.md", "serve/README.md", "notebooks/README.md"]


def blocks(lang: str, doc: str | None = None) -> list[tuple[str, str]]:
    """(doc, block text) of every fenced block in `lang`."""
    out = []
    for name in [doc] if doc else DOCS:
        text = (ROOT / name).read_text()
        out += [(name, m.group(1)) for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)]
    return out


def commands() -> list[tuple[str, str]]:
    """(doc, command) of every command line in a bash block."""
    out = []
    for doc, text in blocks("bash"):
        for line in text.replace("\\\n", " ").splitlines():
            line = " ".join(line.split())
            if line and not line.startswith("#"):
                out.append((doc, line))
    return out


def doc_command(prefix: str) -> str:
    """The one doc command that starts with `prefix`."""
    found = [c for _, c in commands() if c.startswith(prefix)]
    if len(found) != 1:
        raise AssertionError(f"{len(found)} doc commands start with {prefix!r}: {found}")
    return found[0]


def argv(command: str, *extra: str) -> list[str]:
    """A `python ...` doc command as argv for this interpreter, with extra flags appended."""
    words = shlex.split(command)
    assert words[0] == "python", command
    return [sys.executable, *words[1:], *extra]


def run(command: str, *extra: str, timeout: int = 900, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv(command, *extra), capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)
    assert out.returncode == 0, f"{command} {' '.join(extra)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


def start_server(command: str, *extra: str, log, env=None):
    """Starts a documented `python -m eagle_jax.serve ...` command (plus --port 0 --json and `extra`; env:
    the process's environment); returns (process, the ready line as a dict with its "url")."""
    import json

    proc = subprocess.Popen(argv(command, "--port", "0", "--json", *extra), stdout=subprocess.PIPE, stderr=log,
                            text=True, cwd=ROOT, env=env)
    for line in proc.stdout:
        if line.startswith("{"):
            return proc, json.loads(line)
    proc.wait(10)
    log.seek(0)
    raise AssertionError(f"{command} exited with {proc.returncode}:\n{log.read()[-3000:]}")

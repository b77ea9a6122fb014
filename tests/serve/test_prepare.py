"""The server's process-wide memory settings (`eagle_jax.serve.prepare.map_large_blocks`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from eagle_jax.serve.prepare import map_large_blocks

    def rss():
        return int(dict(l.split(":", 1) for l in open("/proc/self/status"))["VmRSS"].split()[0]) // 1024

    applied = map_large_blocks() if sys.argv[1] == "map" else None
    x = np.ones(3_000_000); del x  # a freed 24 MB block: glibc now keeps blocks up to that size on its heap
    base = rss(); blocks, pins = [], []
    for _ in range(40):  # 8 MB buffers come and go, as KV caches and step buffers do
        blocks.append(np.ones(1_000_000))
        pins.append(np.ones(1000))
    del blocks
    print(applied, rss() - base)
''')


def retained(mode: str, **env) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr[-2000:]
    applied, mb = out.stdout.split()
    return applied, int(mb)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_freed_large_buffers_go_back_to_the_os_and_an_explicit_setting_is_kept():
    _, before = retained("plain")
    if before < 16:
        pytest.skip(f"this C library gave back the freed buffers by itself ({before} MB kept)")
    applied, after = retained("map")
    assert applied == "True" and after <= before // 4, (before, after)
    applied, _ = retained("map", MALLOC_MMAP_THRESHOLD_="65536")  # the user's own setting wins
    assert applied == "False"

"""Compiled step programs kept on disk as executables, so a restart loads them without tracing.

JAX's persistent compilation cache already saves XLA's work, but a cache hit still traces the Python
function and lowers it to find the key: for SmolLM2's 30 unrolled layers that is about 0.6-0.9 s of a
1.4-1.7 s load per program, on the GIL. A `ProgramStore` keys each program by what determines it
(the engine's fingerprint and the program's shapes and static arguments) and stores the serialized
executable (`jax.experimental.serialize_executable`), which loads in about 0.5 s and is called
directly (donation included). The server keeps its background preparation's programs here.

The fingerprint covers everything a program depends on besides its shapes: jax and jaxlib versions,
the device and its platform version, the host CPU (on CPU, executables are compiled for its features),
XLA_FLAGS, the source of the step's modules (`profiles.step_code_hash`), the target and head
configurations and their parameter shapes and dtypes. Weights are arguments, never part of a program.
A file that fails to load (another version, a truncated write) is removed and its program built again
(and stored again when that build is a fresh compile). Files are
pickles of the executable: keep the store where only you write, as for any cache of code.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
from pathlib import Path

import jax

from eagle_jax.profiles import cache_root, step_code_hash

log = logging.getLogger("eagle_jax.programs")


def default_store_dir() -> Path:
    return cache_root() / "programs"


def _host_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return hashlib.sha256("".join(lines).encode()).hexdigest()[:16]
    except OSError:
        import platform

        return platform.processor() or platform.machine()


def fingerprint(*states, configs=()) -> str:
    """What every program of an engine depends on besides its own shapes (see the module doc).
    states: the nnx states passed to its programs (None for none); configs: the model and head configs."""
    dev = jax.devices()[0]
    parts = [jax.__version__, getattr(jax.lib, "__version__", ""), dev.platform, getattr(dev, "device_kind", ""),
             getattr(dev.client, "platform_version", ""), _host_cpu() if dev.platform == "cpu" else "",
             os.environ.get("XLA_FLAGS", ""), step_code_hash(), *map(repr, configs)]
    for st in states:
        leaves, tree = jax.tree_util.tree_flatten(st)
        parts.append(str(tree))
        parts.append(repr([(tuple(x.shape), str(x.dtype)) for x in leaves]))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class _Builds(threading.local):
    """Per thread: XLA builds and persistent-cache hits seen (JAX's monitoring events are reported on the
    compiling thread)."""

    builds = 0
    hits = 0


_BUILDS = _Builds()
_BUILD_EVENT = "/jax/core/compile/backend_compile_duration"  # every backend build, cache hits included
_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_watching = False


def _watch() -> None:
    global _watching
    with ProgramStore._lock:
        if not _watching:
            import jax.monitoring

            def on_duration(event, duration, **kwargs):
                if event == _BUILD_EVENT:
                    _BUILDS.builds += 1

            def on_event(event, **kwargs):
                if event == _HIT_EVENT:
                    _BUILDS.hits += 1

            jax.monitoring.register_event_duration_secs_listener(on_duration)
            jax.monitoring.register_event_listener(on_event)
            _watching = True


class ProgramStore:
    """A directory of serialized executables, one file per (fingerprint, program name)."""

    _lock = threading.Lock()
    loaded = 0  # programs this process loaded from a store
    built = 0  # programs this process compiled and wrote to a store

    def __init__(self, directory: str | os.PathLike, fingerprint: str):
        self.dir = Path(directory)
        self.fingerprint = fingerprint

    def path(self, name: str) -> Path:
        return self.dir / (hashlib.sha256(f"{self.fingerprint}\n{name}".encode()).hexdigest()[:32] + ".exe")

    def load_or_build(self, name: str, build):
        """The executable of program `name`: loaded from the store, else `build()` (a jax Compiled),
        which is then written to the store. A store that cannot be read or written only costs time."""
        from jax.experimental import serialize_executable

        path = self.path(name)
        if path.exists():
            try:
                compiled = serialize_executable.deserialize_and_load(*pickle.loads(path.read_bytes()))
                with ProgramStore._lock:
                    ProgramStore.loaded += 1
                return compiled
            except Exception as e:  # another jax, a truncated file: build it again
                log.warning("program store: %s (%s) does not load (%s: %s); compiling it again", path.name, name,
                            type(e).__name__, e)
                path.unlink(missing_ok=True)
        _watch()
        builds, hits = _BUILDS.builds, _BUILDS.hits
        compiled = build()
        if _BUILDS.builds == builds or _BUILDS.hits != hits:
            # Read from JAX's persistent cache or its in-memory one: XLA:CPU serializes such an executable into
            # a file whose kernels are missing when it is loaded again ("Function ... not found" at run time),
            # so only a program compiled here and now is stored.
            log.debug("program store: %s came from a compilation cache; not stored", name)
            return compiled
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(pickle.dumps(serialize_executable.serialize(compiled)))
            os.replace(tmp, path)
            with ProgramStore._lock:
                ProgramStore.built += 1
        except Exception as e:  # a read-only or full disk: serve from memory
            log.warning("program store: cannot write %s (%s: %s)", path, type(e).__name__, e)
        return compiled

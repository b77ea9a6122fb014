"""`python -m eagle_jax.serve`: an OpenAI-compatible server with continuous batching and the
load-aware speculation harness.

    python -m eagle_jax.serve --preset serve/smollm2-135m-instruct.toml
    python -m eagle_jax.serve --draft random --speculation fixed:4,4,16 --port 8001 --api-key secret

Settings come from ServeConfig's defaults, then the preset (if any), then the flags given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time

from eagle_jax.quant import SCHEMES
from eagle_jax.serve.config import DEFAULT_MAX_MODEL_LEN, ConfigError, ServeConfig, load_preset


def build_parser() -> argparse.ArgumentParser:
    d = ServeConfig()
    p = argparse.ArgumentParser(prog="python -m eagle_jax.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--preset", help="TOML file of settings (keys = the long flags with '_' for '-'); flags override it")
    a("--model", help=f"built-in name, Hugging Face directory or .gguf file (default: {d.model})")
    a("--draft", help="draft head: auto (the shipped head if there is one, else none), default, random "
                      f"(untrained, for tests), none, or a head directory (default: {d.draft})")
    a("--host", help=f"address to listen on (default: {d.host}, loopback only)")
    a("--port", type=int, help=f"port (default: {d.port}; 0 picks a free one)")
    a("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests")
    a("--served-model-name", help="the model id clients send and /v1/models lists (default: the model's name)")
    a("--max-batch", type=int, help=f"most requests decoded together (default: {d.max_batch})")
    a("--max-model-len", type=int, help="most tokens per request, prompt + completion (default: the model's context, "
                                         f"at most {DEFAULT_MAX_MODEL_LEN})")
    a("--speculation", help=f"auto (the harness picks a tree or none each step), off, or fixed:D,K,N "
                            f"(default: {d.speculation})")
    a("--candidates", nargs="+", help=f"trees the harness chooses from, as D,K,N or 'off' "
                                      f"(default: {' '.join(d.candidates)})")
    a("--max-queue", type=int, help=f"waiting requests beyond max_batch before 503 (default: {d.max_queue})")
    a("--batch-buckets", type=int, nargs="+", help="static batch sizes (default: powers of two up to --max-batch)")
    a("--prefill-batches", type=int, nargs="+", help="batch buckets of one prefill; the largest caps newcomers per "
                                                     f"prefill (default: {' '.join(map(str, d.prefill_batches))})")
    a("--prefill-tokens", type=int, help=f"padded prompt tokens per prefill (default: {d.prefill_tokens})")
    a("--prefill-chunk", type=int, help="a longer prompt is prefilled alone in chunks of this many tokens, running "
                                        f"requests stepping between them (default: {d.prefill_chunk})")
    a("--kv-cache-tokens", type=int, help="KV cache slots the running requests share; each request takes the blocks "
                                          "its prompt + max_tokens need, and waits while too few are free (default: "
                                          "8 rows of --max-model-len; 0: --max-batch rows of it)")
    a("--block-size", type=int, help=f"slots per KV cache block (default: {d.block_size}; 0: contiguous rows, a batch "
                                     "of b rows then holding requests of up to --kv-cache-tokens / b tokens each)")
    a("--resident-tree-buckets", type=int, help="batch buckets whose speculation programs stay loaded; others are "
                                                "loaded again when stepped (default: "
                                                f"{d.resident_tree_buckets}; 0: all)")
    a("--profile-dir", help="where harness cost profiles are cached (default: ~/.cache/eagle_jax/harness)")
    a("--reprofile", action="store_true", default=None, help="measure the harness cost profile again")
    a("--profile-reps", type=int, help=f"timed repetitions per profiled step (default: {d.profile_reps})")
    a("--no-warmup", dest="warmup", action="store_false", default=None,
      help="compile each program the first time a request needs it, inside the serving loop, instead of "
           "in the background from start-up")
    a("--warmup-prompt-len", type=int, help="the background preparation compiles prefills for prompts up to "
                                            "this many tokens (default: all up to max_model_len); longer ones "
                                            "compile when a request needs one, outside the serving loop")
    a("--compile-cache", help="persistent XLA compilation cache directory; '' disables it "
                              "(default: ~/.cache/eagle_jax/xla)")
    a("--log-level", choices=["debug", "info", "warning", "error"], help=f"(default: {d.log_level})")
    a("--json", action="store_true", help="print one JSON line with the address and settings once serving")
    a("--tensor-parallel", type=int, metavar="N", help="shard the target over N devices: attention heads, MLP width, "
                                                        f"vocabulary and KV cache (default: {d.tensor_parallel})")
    a("--data-parallel", type=int, metavar="M", help="split batch rows over M groups of --tensor-parallel devices "
                                                      f"(needs --block-size 0; default: {d.data_parallel})")
    a("--quantize", choices=[*SCHEMES, "none"],
      help="store the target's matrices weight-only quantized; gguf keeps a GGUF file's own blocks (default: none)")
    a("--expert-parallel", type=int, metavar="E", help="MoE targets: split each layer's experts over E groups of "
                                                        f"--tensor-parallel devices (default: {d.expert_parallel})")
    a("--distributed", action="store_true", default=None,
      help="join the other processes with jax.distributed.initialize() (coordinator from JAX_COORDINATOR_ADDRESS, "
           "JAX_NUM_PROCESSES, JAX_PROCESS_ID, or the platform's); process 0 serves HTTP and schedules, every "
           "process runs the same steps on its shards")
    return p


def build_config(args) -> ServeConfig:
    values = {}
    if args.preset:
        values.update(load_preset(args.preset))
    for f in dataclasses.fields(ServeConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = tuple(v) if isinstance(v, list) else v
    return ServeConfig(**values)


def _socket(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = build_config(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("eagle_jax.serve")

    from eagle_jax import sharding

    if config.distributed or sharding.distributed_requested():
        sharding.initialize()  # before anything touches JAX's devices
    import jax

    from eagle_jax.serve.memory import map_large_blocks

    map_large_blocks()  # large buffers go back to the OS when freed (see its doc): a lower peak
    cache_dir = config.compile_cache
    if cache_dir is None:
        from eagle_jax.profiles import cache_root

        cache_dir = str(cache_root() / "xla")
        config = dataclasses.replace(config, compile_cache=cache_dir)
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:  # tiny programs are quicker to compile
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    import uvicorn

    import eagle_jax
    from eagle_jax.loader import resolve_draft
    from eagle_jax.serve.app import create_app

    leader = sharding.is_leader()
    try:
        sock = _socket(config.host, config.port) if leader else None
    except OSError as e:
        print(f"error: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 2
    try:
        t0 = time.perf_counter()
        target = eagle_jax.load_target(config.model, tensor_parallel=config.tensor_parallel,
                                       data_parallel=config.data_parallel, expert_parallel=config.expert_parallel,
                                       quantize=None if config.quantize in (None, "none") else config.quantize)
        mode, _ = config.speculation_mode()
        head = None if mode == "off" else resolve_draft(config.draft, target)

        log.info("loaded %s%s in %.1f s", target.name, "" if head is None else f" + {head.cfg.kind} head",
                 time.perf_counter() - t0)
        app = create_app(target, head, config)
    except (ValueError, FileNotFoundError) as e:  # LoadError, DraftLoadError, ConfigError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not leader:  # the same scheduler loop, kept in step with process 0's (`serve.replica`), until it stops
        log.info("process %d of %d: serving with process 0", jax.process_index(), jax.process_count())
        scheduler = app.state.api.scheduler
        scheduler.start()
        scheduler.thread.join()
        scheduler.replica.close()
        return 1 if scheduler.failure is not None else 0
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, access_log=config.log_level == "debug",
                                           timeout_graceful_shutdown=5))

    def announce():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            api = app.state.api
            info = {"event": "ready", "url": f"http://{host}:{port}", "model": api.model_name,
                    "speculation": config.speculation if api.scheduler.head is not None else "off",
                    "max_batch": config.max_batch, "max_model_len": api.max_model_len,
                    "mesh": sharding.mesh_shape(target.model.mesh), "processes": jax.process_count(),
                    "auth": config.api_key is not None}
            if args.json:
                print(json.dumps(info), flush=True)
            else:
                log.info("serving %s on %s (speculation %s)", info["model"], info["url"], info["speculation"])

    threading.Thread(target=announce, daemon=True).start()
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())

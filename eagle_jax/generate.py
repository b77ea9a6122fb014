"""`python -m eagle_jax.generate`: generate text from the command line.

    python -m eagle_jax.generate --prompt "Write a haiku about JAX."
    python -m eagle_jax.generate --prompt "a" --prompt "b" --temperature 0.7 --seed 1 --json

The module is also callable (`eagle_jax.generate(...)` is the library function even after
`import eagle_jax.generate`).
"""

from __future__ import annotations

import argparse
import json
import sys
import types

from eagle_jax.bench import candidate_arg, tree_arg
from eagle_jax.quant import add_quantize_args, scheme_from_arg
from eagle_jax.sharding import add_mesh_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eagle_jax.generate",
        description="Generate text with a target model: plain decoding, or EAGLE speculative decoding with --draft.",
    )
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="built-in model name, Hugging Face directory, or .gguf file (default: %(default)s)")
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text; repeat the flag to generate for a batch of prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="maximum new tokens per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]; 1 = off (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed; prompt i uses seed + i (default: %(default)s)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable); the text is cut before it")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text instead of applying the chat template")
    p.add_argument("--draft", default="none",
                   help="EAGLE draft head: 'none' for plain decoding, 'default' (the head shipped for --model; "
                        "an error if none), 'auto' (the shipped head if there is one, else plain decoding), a head "
                        "directory (official EAGLE / EAGLE-3 layout) or 'random' (an untrained EAGLE-3 head: same "
                        "output, not faster) (default: %(default)s; on CPU the shipped SmolLM2 head is about as "
                        "fast as plain decoding with a fixed tree, see README.md; --tree auto speculates only where "
                        "it pays)")
    p.add_argument("--tree", type=tree_arg, default=None,
                   help="the draft tree, DEPTH,TOPK,TOKENS (default: 4,4,16), or 'auto': the load-aware harness "
                        "picks, every step, a draft tree or plain decoding from step costs measured on this "
                        "device (measured once, cached under ~/.cache/eagle_jax) and the acceptance seen so far, "
                        "so speculation that does not pay is switched off")
    p.add_argument("--candidates", type=candidate_arg, nargs="+", default=None,
                   help="the trees --tree auto chooses from, as DEPTH,TOPK,TOKENS (plain decoding is always one; "
                        "default: the harness's, see python -m eagle_jax.bench --help)")
    p.add_argument("--json", action="store_true", help="print one JSON object (texts, token ids, stats) instead of text")
    add_mesh_args(p)
    add_quantize_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.candidates is not None and args.tree != "auto":
        print("error: --candidates are the trees --tree auto chooses from: pass --tree auto with them", file=sys.stderr)
        return 2
    from eagle_jax import sharding

    sharding.setup_from_args(args)
    import eagle_jax
    from eagle_jax.engine import generate

    try:
        target = eagle_jax.load_target(args.model, tensor_parallel=args.tensor_parallel,
                                       data_parallel=args.data_parallel, expert_parallel=args.expert_parallel,
                                       quantize=scheme_from_arg(args.quantize))
    except (eagle_jax.LoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from eagle_jax.loader import resolve_draft

    try:
        draft = resolve_draft(args.draft, target)
        tree = args.tree if draft is not None else None
        if args.tree is not None and draft is None:
            raise ValueError("--tree needs a draft head (--draft default, auto, random or a head directory)")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stream = not args.json and len(args.prompt) == 1 and sys.stdout.isatty()
    printed = [""]

    def on_token(row, token):
        # Stream a single prompt to a terminal: print the newly decodable text.
        ids.append(token)
        text = target.tokenizer.decode(ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed[0]):])
            sys.stdout.flush()
            printed[0] = text

    ids: list[int] = []
    try:
        result = generate(
            target, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed, chat=not args.no_chat, stop=args.stop,
            on_token=on_token if stream else None, draft=draft, tree=tree,
            candidates=args.candidates if tree == "auto" else None,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not sharding.is_leader():  # every process ran the same steps; process 0 reports
        return 0
    if args.json:
        print(json.dumps({
            "model": target.name,
            "prompts": args.prompt,
            "texts": result.texts,
            "token_ids": result.token_ids,
            "finish_reasons": result.finish_reasons,
            "stats": result.stats,
        }))
        return 0
    if stream:
        print()
    else:
        for i, text in enumerate(result.texts):
            if len(result.texts) > 1:
                print(f"--- [{i}] {args.prompt[i]}")
            print(text)
    s = result.stats
    print(f"[{s['generated_tokens']} tokens in {s['wall_s']:.2f}s, {s['tokens_per_s']:.1f} tok/s, "
          f"{s['steps']} steps, tau {s['tau']:.2f}]", file=sys.stderr)
    return 0


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from eagle_jax.engine import generate

        return generate(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule

"""Quantized SmolLM2-135M-Instruct (`--quantize`): size, quality, speed and the shipped head's acceptance.

    python benchmarks/quantized.py [--prompts 8] [--new-tokens 64] [--json results/quantized.json]

For full precision (f32 on CPU) and each scheme (int8 and fp8 per output channel, int4 in groups of 32, and
gguf: the file's own Q4_1 / Q8_0 blocks kept), in one process:
* weight_bytes: bytes of the target's parameters in memory, and the ratio to full precision;
* perplexity of MT-bench's GPT-4 reference answers (held text: neither SmolLM2's writing nor training
  data) under the chat template, over their answer tokens (up to 256 a conversation, `--ppl-texts` of them);
* greedy agreement with full precision over `--new-tokens` tokens on `--prompts` MT-bench prompts: the
  share of positions with the same token, and of prompts whose whole output is the same;
* tokens/s of plain decoding and of EAGLE-3 3,4,8 with the shipped head, one prompt at a time (batch 1),
  with the head's tau, and whether speculative output equals the quantized model's own plain output;
* one matmul, 1 x 576 @ 576 x 1536 (an MLP projection), jitted: ms per call for each scheme.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def reference_answers(limit: int) -> list[tuple[str, str]]:
    """(question, GPT-4 reference answer) pairs of MT-bench's first turns."""
    from eagle_jax.datasets import eval_set_path

    path = eval_set_path("mt_bench").parent / "reference_answer" / "gpt-4.jsonl"
    questions = {json.loads(x)["question_id"]: json.loads(x)["turns"][0]
                 for x in eval_set_path("mt_bench").read_text().splitlines() if x.strip()}
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        answer = rec["choices"][0]["turns"][0]
        if rec["question_id"] in questions and len(answer) > 200:
            out.append((questions[rec["question_id"]], answer))
    return out[:limit]


def perplexity(target, pairs, max_answer: int = 256) -> float:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    @nnx.jit
    def logprobs(model, ids):
        logits = model(ids, model.init_cache(1, ids.shape[1])).logits[0]
        return jax.nn.log_softmax(logits, axis=-1)

    total, count = 0.0, 0
    tok = target.tokenizer
    for question, answer in pairs:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True)
        prompt = list(prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt)
        ans = tok(answer, add_special_tokens=False)["input_ids"][:max_answer]
        ids = prompt + ans
        padded = ids + [0] * (-len(ids) % 128)  # few distinct lengths: few compiles
        lp = np.asarray(logprobs(target.model, jnp.asarray([padded], jnp.int32)))
        pos = np.arange(len(prompt) - 1, len(ids) - 1)
        total -= float(lp[pos, np.asarray(ids)[pos + 1]].sum())
        count += len(pos)
    return float(np.exp(total / count))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ppl-texts", type=int, default=20)
    ap.add_argument("--schemes", default="none,int8,fp8,int4,gguf")
    ap.add_argument("--json", default="results/quantized.json")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import eagle_jax
    from eagle_jax import quant
    from eagle_jax.datasets import load_dataset
    from eagle_jax.loader import resolve_draft

    prompts = load_dataset("mt_bench")[: args.prompts]
    pairs = reference_answers(args.ppl_texts)
    rows, reference = [], None
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 576)), jnp.float32)
    w = np.random.default_rng(1).normal(size=(576, 1536)).astype(np.float32) * 0.05
    for scheme in args.schemes.split(","):
        s = None if scheme == "none" else scheme
        target = eagle_jax.load_target("smollm2-135m-instruct", quantize=s)
        head = resolve_draft("default", target)
        row = {"scheme": scheme, "weight_bytes": quant.weight_bytes(nnx.state(target.model))}
        row["perplexity"] = perplexity(target, pairs)
        plain_ids, plain_s, spec_s, taus, same = [], 0.0, 0.0, [], True
        for i, p in enumerate(prompts):
            for attempt in range(2 if i == 0 else 1):  # the first prompt compiles: time its second run
                t0 = time.perf_counter()
                plain = eagle_jax.generate(target, p, max_new_tokens=args.new_tokens, ignore_eos=True)
                t1 = time.perf_counter()
                spec = eagle_jax.generate(target, p, head, tree="3,4,8", max_new_tokens=args.new_tokens,
                                          ignore_eos=True)
                t2 = time.perf_counter()
            plain_s, spec_s = plain_s + (t1 - t0), spec_s + (t2 - t1)
            plain_ids.append(plain.token_ids[0])
            taus.append(spec.stats["tau"])
            same = same and spec.token_ids == plain.token_ids
        n_tokens = args.new_tokens * len(prompts)
        row.update(plain_tok_s=n_tokens / plain_s, spec_tok_s=n_tokens / spec_s, tau=float(np.mean(taus)),
                   spec_equals_plain=same)
        if reference is None:
            reference = plain_ids
        flat = [a == b for x_, y_ in zip(plain_ids, reference) for a, b in zip(x_, y_)]
        row["agreement"] = float(np.mean(flat))
        row["same_outputs"] = sum(a == b for a, b in zip(plain_ids, reference))
        mm = jax.jit(quant.matmul)
        wq = w if s is None else quant.quantize(w, "int4" if s == "gguf" else s)  # (gguf: Q4_1's int4 product)
        mm(x, wq).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(200):
            mm(x, wq).block_until_ready()
        row["matmul_ms"] = (time.perf_counter() - t0) / 200 * 1e3
        rows.append(row)
        print(f"{scheme}: {row}", flush=True)
    full = rows[0]["weight_bytes"]
    print(f"\nSmolLM2-135M-Instruct, {len(prompts)} MT-bench prompts x {args.new_tokens} tokens, batch 1 "
          f"({platform.processor() or platform.machine()}, jax {jax.__version__})")
    print(f"{'scheme':>6} {'MB':>7} {'x f32':>6} {'ppl':>7} {'agree':>6} {'same':>5} {'plain tok/s':>12} "
          f"{'3,4,8 tok/s':>12} {'tau':>5} {'spec=plain':>10} {'matmul ms':>9}")
    for r in rows:
        print(f"{r['scheme']:>6} {r['weight_bytes'] / 1e6:>7.1f} {r['weight_bytes'] / full:>6.3f} "
              f"{r['perplexity']:>7.3f} {r['agreement']:>6.3f} {r['same_outputs']:>5} {r['plain_tok_s']:>12.1f} "
              f"{r['spec_tok_s']:>12.1f} {r['tau']:>5.2f} {str(r['spec_equals_plain']):>10} {r['matmul_ms']:>9.3f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "quantized", "date": datetime.datetime.now().isoformat(timespec="seconds"),
                               "host": platform.node(), "jax": jax.__version__, "settings": vars(args),
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

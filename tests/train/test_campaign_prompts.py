"""train/prompts/make_campaign_prompts.py: the R data reader, the generator, and the committed file."""

import collections
import gzip
import importlib.util
import json
import struct
import sys
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "train" / "prompts" / "campaign-prompts.jsonl"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("make_campaign_prompts",
                                                  REPO / "train" / "prompts" / "make_campaign_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_campaign_prompts"] = mod
    spec.loader.exec_module(mod)
    return mod


# A minimal writer of R's XDR serialization (version 3), enough for named character vectors.
def _i(v):
    return struct.pack(">i", v)


def _chars(s):
    if s is None:
        return _i(9) + _i(-1)  # NA
    b = s.encode()
    return _i(9 | (1 << 15)) + _i(len(b)) + b  # CHARSXP (UTF-8 flag set)


def _strvec(xs, names=None):
    out = _i(16 | ((1 << 9) if names else 0)) + _i(len(xs)) + b"".join(_chars(x) for x in xs)
    if names:  # attributes: pairlist(names = c(...))
        out += _i(2 | (1 << 10)) + _i(1) + _chars("names") + _strvec(names) + _i(254)
    return out


def _header():
    return b"X\n" + _i(3) + _i(0x40201) + _i(0x30500) + _i(5) + b"UTF-8"


def test_r_reader_reads_rda_files_and_lazyload_databases(gen, tmp_path):
    data = tmp_path / "pkg" / "data"
    data.mkdir(parents=True)
    # An .rda: "RDX3\n", then a pairlist of (symbol tag, value); the second tag is a back-reference.
    body = (_i(2 | (1 << 10)) + _i(1) + _chars("novel") + _strvec(["It was a dark", "", "and stormy night."])
            + _i(2 | (1 << 10)) + _i(255 | (1 << 8)) + _strvec(["again"]) + _i(254))
    (data / "novel.rda").write_bytes(gzip.compress(b"RDX3\n" + _header() + body))
    assert gen.read_r_data(tmp_path / "pkg") == {"novel": ["again"]}  # the same name twice: the last wins
    # A lazy-load database: Rdata.rdx (index) and Rdata.rdb (one compressed object per variable).
    (data / "novel.rda").unlink()
    obj = _header() + _strvec(["First line.", None, "Second line."])
    chunk = struct.pack(">I", len(obj)) + zlib.compress(obj)
    offsets = _i(14) + _i(2) + struct.pack(">2d", 0, len(chunk))  # REALSXP c(offset, length)
    variables = _i(19 | (1 << 9)) + _i(1) + offsets + _i(2 | (1 << 10)) + _i(1) + _chars("names") \
        + _strvec(["book"]) + _i(254)
    index = _i(19 | (1 << 9)) + _i(2) + variables + _i(10) + _i(1) + _i(1) + _i(2 | (1 << 10)) + _i(1) \
        + _chars("names") + _strvec(["variables", "compressed"]) + _i(254)
    (data / "Rdata.rdx").write_bytes(gzip.compress(_header() + index))
    (data / "Rdata.rdb").write_bytes(chunk)
    assert gen.read_r_data(tmp_path / "pkg") == {"book": ["First line.", None, "Second line."]}


def test_generator_is_deterministic_and_covers_every_category(gen):
    passages = [("Emma", f"Emma walked to Highbury on day {i}. " * 8) for i in range(40)]
    a = gen.build(passages, per_category=60, multi_turn=0.25, seed=3)
    assert a == gen.build(passages, per_category=60, multi_turn=0.25, seed=3)
    assert a != gen.build(passages, per_category=60, multi_turn=0.25, seed=4)
    counts = collections.Counter(r["category"] for r in a)
    assert counts == {c: 60 for c in gen.CATEGORIES}
    multi = [r for r in a if "turns" in r]
    assert len(multi) == 8 * 15 and all(len(r["turns"]) == 2 for r in multi)
    firsts = [(r.get("turns") or [r.get("prompt")])[0] for r in a]
    assert len(set(firsts)) == len(firsts) and all("\x00" not in p for p in firsts)
    assert any("Emma walked" in p for p in firsts)


def test_committed_campaign_prompts():
    from eagle_jax.train.data import check_not_eval, load_jsonl_prompts

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    counts = collections.Counter(r["category"] for r in rows)
    assert len(rows) >= 6000 and set(counts) == {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                                  "stem", "humanities"}
    assert min(counts.values()) >= 700
    prompts = load_jsonl_prompts(PROMPTS, turns="all")
    assert sum(isinstance(p, list) for p in prompts) >= 1000
    check_not_eval(prompts, source=str(PROMPTS))
    # Extraction prompts bring their text: Austen passages and invented documents.
    extraction = [(r.get("turns") or [r.get("prompt")])[0] for r in rows if r["category"] == "extraction"]
    assert sum("passage" in p for p in extraction) >= 300
    assert all(len(p) > 120 for p in extraction)

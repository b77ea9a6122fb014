"""Writes train/prompts/campaign-prompts.jsonl: category-seeded prompts for the head campaign.

    python train/prompts/make_campaign_prompts.py [--austen DIR] [--per-category N] [--seed S] [--exclude JSONL]

Deterministic for a given seed. Eight categories of what people ask a chat model: writing, roleplay,
reasoning, math, coding, extraction (pulling facts out of, or summarising, a given text), stem and
humanities. Each category has its own topic lists and several request templates (lengths, formats,
audiences and word limits vary); a quarter of the rows are two-turn conversations whose follow-up
fits the first request ("make it shorter", "now write tests for it", "what is a counter-argument?").

Rows: {"category": ..., "prompt": str} or {"category": ..., "turns": [first, follow-up]}; the
recipe reads them with `{ kind = "jsonl", path = ..., turns = "all" }`. Every text here was written
for this file, except the passages for the extraction prompts: paragraphs of Jane Austen's six novels
(public domain), read from the R package janeaustenr as Debian ships it (`apt-get install
r-cran-janeaustenr`, or `apt-get download r-cran-janeaustenr && dpkg-deb -x <the .deb> DIR` and pass
`--austen DIR/usr/lib/R/site-library/janeaustenr`). Its data is R's XDR serialization, read here with
the standard library only. MT-bench and HumanEval prompts are refused by the pipeline
(`check_not_eval`), which this script also runs when eagle_jax is importable.
"""

from __future__ import annotations

import argparse
import bz2
import collections
import gzip
import json
import lzma
import random
import re
import struct
import zlib
from pathlib import Path

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def items(text: str) -> list[str]:
    """A semicolon-separated list written across lines."""
    return [t.strip() for t in " ".join(text.split("\n")).split(";") if t.strip()]


# ---------------------------------------------------------------------------------------------------
# Reading the janeaustenr data (R serialization, XDR format) with the standard library.


class _RReader:
    """Enough of R's unserialize for data sets: vectors, lists, pairlists, attributes, ALTREP seqs."""

    def __init__(self, buf: bytes):
        self.b, self.i, self.refs = buf, 0, []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.i)
        self.i += 4
        return v

    def raw(self, n: int) -> bytes:
        out = self.b[self.i: self.i + n]
        self.i += n
        return out

    def header(self):
        if self.raw(2) != b"X\n":
            raise ValueError("not an XDR-format R serialization")
        version = self.int()
        self.int(), self.int()  # writer's and minimal reader's R versions
        if version == 3:
            self.raw(self.int())  # native encoding name

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector
            n = (self.int() << 32) + self.int()
        return n

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 253, 252, 251, 250, 242, 241):  # NULL, environments, markers
            return None
        if kind == 255:  # back-reference to a symbol
            return self.refs[(flags >> 8) - 1]
        if kind == 1:  # symbol
            name = self.item()
            self.refs.append(name)
            return name
        if kind == 9:  # string
            n = self.int()
            return None if n == -1 else self.raw(n).decode("utf-8", "replace")
        if kind in (2, 6, 239, 240):  # pairlist / call: (tag, value) pairs
            pairs = []
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else None
                pairs.append((tag, self.item()))
                nxt = self.int()
                if nxt & 0xFF not in (2, 239):
                    self.i -= 4
                    self.item()  # the terminating NULL
                    return _RPairs(pairs)
                has_attr, has_tag = nxt & (1 << 9), nxt & (1 << 10)
        if kind in (10, 13):  # logical, integer
            n = self.length()
            value = list(struct.unpack_from(f">{n}i", self.b, self.i))
            self.i += 4 * n
        elif kind == 14:  # double
            n = self.length()
            value = list(struct.unpack_from(f">{n}d", self.b, self.i))
            self.i += 8 * n
        elif kind in (16, 19, 20):  # character vector, list, expression
            value = [self.item() for _ in range(self.length())]
        elif kind == 24:  # raw
            value = self.raw(self.length())
        elif kind == 238:  # ALTREP: class, state, attributes
            info, state = self.item(), self.item()
            self.item()
            cls = info.pairs[0][1]
            if cls in ("compact_intseq", "compact_realseq"):
                n, start, step = state
                return [start + k * step for k in range(int(n))]
            if cls.startswith("wrap_") or cls == "deferred_string":
                return state.pairs[0][1] if isinstance(state, _RPairs) else state[0]
            raise ValueError(f"unsupported ALTREP class {cls}")
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            return _RVector(value, self.item())
        return value


class _RPairs:
    def __init__(self, pairs):
        self.pairs = pairs

    def get(self, key):
        return next(v for t, v in self.pairs if t == key)


class _RVector(list):
    def __init__(self, value, attrs):
        super().__init__(value)
        self.attrs = attrs


def _unserialize(buf: bytes):
    r = _RReader(buf)
    r.header()
    return r.item()


def _decompress(buf: bytes) -> bytes:
    """A whole file: gzip, bzip2, xz or none."""
    if buf[:2] == b"\x1f\x8b":
        return gzip.decompress(buf)
    if buf[:3] == b"BZh":
        return bz2.decompress(buf)
    if buf[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(buf)
    return buf


def _lazyload_chunk(buf: bytes) -> bytes:
    """One object of a lazy-load database (.rdb): 4-byte length, then zlib, or a type byte for xz/bzip2/none."""
    body = buf[4:]
    kind = body[:1]
    if kind == b"Z":
        return lzma.decompress(body[1:])
    if kind == b"2":
        return bz2.decompress(body[1:])
    if kind == b"0":
        return body[1:]
    return zlib.decompress(body)


def read_r_data(package_dir: Path) -> dict[str, object]:
    """The data sets of an installed R package: data/*.rda files, or the lazy-load database data/Rdata.rdb."""
    data_dir = package_dir / "data"
    out: dict[str, object] = {}
    for rda in sorted(data_dir.glob("*.rda")) + sorted(data_dir.glob("*.RData")):
        buf = _decompress(rda.read_bytes())
        if buf[:5] not in (b"RDX2\n", b"RDX3\n"):
            raise ValueError(f"{rda}: not an XDR .rda file")
        for name, value in _unserialize(buf[5:]).pairs:
            out[name] = value
    rdx = data_dir / "Rdata.rdx"
    if rdx.exists():
        index = _unserialize(_decompress(rdx.read_bytes()))
        variables = index[index.attrs.get("names").index("variables")]
        rdb = (data_dir / "Rdata.rdb").read_bytes()
        for name, (offset, size) in zip(variables.attrs.get("names"), variables):
            out[name] = _unserialize(_lazyload_chunk(rdb[int(offset): int(offset) + int(size)]))
    return out


AUSTEN_DIRS = ("/usr/lib/R/site-library/janeaustenr", "/usr/local/lib/R/site-library/janeaustenr",
               "/usr/lib/R/library/janeaustenr")
NOVELS = {"sensesensibility": "Sense and Sensibility", "prideprejudice": "Pride and Prejudice",
          "mansfieldpark": "Mansfield Park", "emma": "Emma", "northangerabbey": "Northanger Abbey",
          "persuasion": "Persuasion"}
# Principal characters, to ask about one who appears in a passage.
AUSTEN_NAMES = items("""Elinor; Marianne; Willoughby; Brandon; Edward; Lucy; Dashwood; Ferrars; Jennings; Elizabeth;
Darcy; Jane; Bingley; Wickham; Lydia; Collins; Charlotte; Bennet; Lady Catherine; Fanny; Edmund; Crawford;
Bertram; Norris; Maria; Julia; Mary; Emma; Knightley; Harriet; Elton; Weston; Churchill; Fairfax;
Woodhouse; Bates; Catherine; Tilney; Thorpe; Isabella; Morland; Anne; Wentworth; Elliot; Musgrove;
Louisa; Russell; Walter""")


def austen_passages(package_dir: Path, rng: random.Random, n: int) -> list[tuple[str, str]]:
    """(novel title, passage) pairs: 1-3 consecutive paragraphs of 60-220 words, chosen at random."""
    books = read_r_data(package_dir)
    candidates = []
    for key, title in NOVELS.items():
        lines = books[key]
        paragraphs, cur = [], []
        for line in list(lines) + [""]:
            line = (line or "").strip()
            if line:
                cur.append(line)
            elif cur:
                paragraphs.append(" ".join(cur))
                cur = []
        # Skip front matter and headings: real paragraphs have sentences.
        paragraphs = [p for p in paragraphs if len(p.split()) >= 12 and not p.isupper() and "CHAPTER" not in p]
        for i in range(len(paragraphs)):
            text, j = paragraphs[i], i + 1
            while len(text.split()) < 60 and j < len(paragraphs) and j < i + 3:
                text += "\n\n" + paragraphs[j]
                j += 1
            words = len(text.split())
            if 60 <= words <= 220 and "_" not in text[:1]:
                candidates.append((title, text.replace("_", "")))
    rng.shuffle(candidates)
    return candidates[:n]


# ---------------------------------------------------------------------------------------------------
# Shared fills.

AUDIENCES = items("""a ten-year-old; a curious teenager; a busy parent; a first-year university student; a retired
engineer; someone who has never studied the subject; a group of new employees; a friend who is sceptical;
a class of high-school students; a non-native English speaker; a software developer; a small-business owner""")
TONES = items("""warm; humorous; formal; melancholic; cheerful; suspenseful; gentle; sarcastic; hopeful; dramatic;
matter-of-fact; nostalgic; playful; serious""")
FORMATS = items("""a numbered list; a table; three short paragraphs; bullet points; questions and answers;
a step-by-step guide; a short dialogue""")
NAMES = items("""Amara; Ben; Chloe; Dmitri; Esme; Farid; Greta; Hiro; Ines; Jonah; Kemi; Lars; Maya; Nikhil; Olga;
Pablo; Quinn; Rosa; Samir; Tessa; Umar; Vera; Wes; Ximena; Yusuf; Zoe; Priya; Mateo; Leila; Oscar; Hana; Theo""")
PLACES = items("""Lisbon; Kyoto; Nairobi; Oslo; Montreal; Cusco; Edinburgh; Hanoi; Marrakesh; Reykjavik; Seville;
Tallinn; Wellington; Valparaiso; Istanbul; Krakow; Cape Town; Vancouver; Bruges; Lima""")


def a_(word: str) -> str:
    """The word with its indefinite article."""
    return ("an " if word[0] in "aeioAEIO" or word.startswith("HR") else "a ") + word


def _words(rng: random.Random) -> int:
    return rng.choice([50, 80, 100, 120, 150, 200, 250, 300])


def constraint(rng: random.Random, prompt: str = "") -> str:
    """An optional extra demand on length, tone, audience or format (none about half the time), never
    one that the prompt already makes."""
    if rng.random() < 0.45:
        return ""
    low = prompt.lower()
    options = [f" Use a {rng.choice(TONES)} tone.", " Give it a title.", " Avoid jargon.",
               " End with a question for the reader."]
    if "word" not in low:
        options += [f" Keep it under {_words(rng)} words.", f" Use about {_words(rng)} words."]
    if not any(a in low for a in AUDIENCES) and " for a " not in low:
        options.append(f" Write it for {rng.choice(AUDIENCES)}.")
    if not any(w in low for w in ("list", "table", "bullet", "paragraph", "steps", "json")):
        options += [f" Format the answer as {rng.choice(FORMATS)}.",
                    f" Use exactly {rng.choice([2, 3, 4])} paragraphs."]
    return rng.choice(options)


CONSTRAINT = "\x00"  # a maker ends a prompt with this where build() may add a constraint


def add_constraint(rng: random.Random, prompt: str) -> str:
    if prompt.endswith(CONSTRAINT):
        prompt = prompt[: -len(CONSTRAINT)]
        prompt += constraint(rng, prompt)
    return prompt


POLITE = ("Could you ", "Can you ", "Please ", "I'd like you to ", "Would you ")
IMPERATIVES = ("Write", "Explain", "Give", "Describe", "List", "Summarize", "Create", "Compare", "Tell", "Suggest",
               "Draft", "Compose", "Outline", "Make", "Solve", "Find", "Calculate", "Translate", "Rewrite")


def vary(rng: random.Random, prompt: str) -> str:
    """Phrasing as people type it: sometimes polite, sometimes casual lower case."""
    first = prompt.split(" ", 1)[0]
    r = rng.random()
    if first in IMPERATIVES and "\n" not in prompt and r < 0.25:
        lead = rng.choice(POLITE)
        body = prompt[0].lower() + prompt[1:]
        if lead in ("Could you ", "Can you ", "Would you ") and body.endswith("."):
            first_end = body.find(". ")
            body = body[:-1] + "?" if first_end < 0 else body[:first_end] + "?" + body[first_end + 1:]
        return lead + body
    if "\n" not in prompt and len(prompt) < 90 and r > 0.93:
        return prompt.lower().rstrip(".?") + rng.choice(["", "?", " pls", " thanks"])
    return prompt


# ---------------------------------------------------------------------------------------------------
# Writing.

STORY_SUBJECTS = items("""a lighthouse keeper's last night on duty; the first snowfall of the year; an umbrella left on
a bus; a rooftop vegetable garden; leaving home for the first time; an old bicycle in a shed; a robot that wants to
paint; a family recipe nobody can get right; the night before an exam; a bakery in a small town; a train that only
runs at midnight; a friendship between a cat and a crow; the sea at dawn; a letter found inside a library book; a
power cut across a whole city; a grandmother's garden; a first day at a new job; a street musician; a mountain hut
in winter; learning to swim as an adult; a village where every clock has stopped; a message in a bottle; autumn
leaves; the finish line of a marathon; a kite festival; a cracked phone screen; a night market; a time machine that
only goes back ten minutes; a dragon who is afraid of heights; the smell of fresh coffee; a long-distance phone
call; an empty football stadium; the last bookshop in town; a scientist's accidental discovery; a treehouse; a snow
day; a ferry crossing in fog; an elevator that stops on a floor that does not exist; a vegetable-growing contest;
rain on a tin roof; a school science fair; an astronaut looking back at Earth; a shy giant; a detective who has
lost her sense of smell; a picnic invaded by ants; a city seen from a hot-air balloon; the end of summer; a chess
game in a park; a museum after closing time; a dog finding its way home; a house that rearranges its rooms at
night; an inventor's machine that never works; an oasis in the desert; a friendship that began online; a surprise
birthday party; the slowest race in the world; the song of a whale; a new neighbour with a strange hobby; a
thunderstorm over a city; the first cup of tea of the day; a key that fits no lock; the secret life of a garden
gnome; a cooking disaster at a dinner party; the night shift of a bus driver; an abandoned amusement park; a quiet
hero nobody thanks; the moon watching the Earth; a map that talks; a wedding where everything goes wrong; a
fisherman caught in a storm; a tiny spaceship; a musician who is losing their hearing; the last day of school; a
lost glove; a mountain rescue; a ghost who is bored; a lemonade stand; a forgotten toy; a clockmaker's apprentice;
the first robot in a village; a migrating bird; a heatwave; a bridge between two feuding towns; an old photograph;
a job interview that goes strangely; the world's most stubborn goat; a violin in a pawn shop; a city without cars;
a wrong number that changes a life; a night in a lighthouse; a garden on Mars; a lost language; a snowman that
does not melt; a spelling bee final; a sailor's last voyage; a library that lends memories; a painter who can only
use one colour""")
POEM_KINDS = items("""a haiku; a limerick; a sonnet; a free-verse poem; a short rhyming poem; an acrostic poem; a
ballad of four stanzas; a poem in couplets; a prose poem; a cinquain""")
STORY_FORMS = [
    "Write a short story about {s}.",
    "Write a short story about {s} in {n} words or fewer.",
    "Write {poem} about {s}.",
    "Write the opening paragraph of a novel about {s}.",
    "Write a {tone} diary entry by someone who lives through {s}.",
    "Write a dialogue between two friends about {s}.",
    "Write a bedtime story for a {age}-year-old about {s}.",
    "Write song lyrics with two verses and a chorus about {s}.",
    "Write a piece of flash fiction about {s} that ends with a twist.",
    "Write a {tone} short story about {s}, told in the first person.",
    "Write a fable about {s} with a clear moral at the end.",
    "Write a scene for a play about {s}, with stage directions.",
    "Describe {s} using all five senses, in one rich paragraph.",
    "Write a {poem_short} about {s}.",
]
EMAIL_TASKS = items("""to your landlord asking for a broken heater to be repaired; to a colleague asking to swap shifts
next Friday; to a professor asking for an extension on an essay; to a customer apologising for a delayed order; to
a neighbour about a tree that overhangs your garden; to your team announcing a new meeting schedule; to a hotel
asking about early check-in; to a former manager asking for a reference; to a friend you have not spoken to in
years; to a client following up on an unpaid invoice; to a school asking about its enrolment process; to a
supplier complaining about damaged goods; to your manager requesting a day off for a family event; to a
conference organiser proposing a talk; to a new team member welcoming them; to a gym cancelling a membership; to
an airline asking for a refund after a cancelled flight; to a local council reporting a broken streetlight; to a
recruiter declining a job offer politely; to volunteers thanking them after a charity run; to a company asking
for a quote for office cleaning; to a teacher about a child's homework worries; to a book club announcing the
next book; to a landlord giving notice that you are moving out; to a mentor thanking them for their advice""")
JOBS = items("""data analyst; primary-school teacher; nurse; software engineer; barista; marketing coordinator; civil
engineer; graphic designer; customer support specialist; project manager; lab technician; librarian; sales
associate; accountant; chef; museum guide; UX researcher; warehouse supervisor; social media manager; electrician;
veterinary assistant; translator; event planner; research assistant; bank teller; HR officer""")
PRODUCTS = items("""a reusable water bottle that keeps drinks cold for a day; a foldable electric bike; noise-cancelling
headphones; a smart plant pot that waters itself; a handmade ceramic mug; a solar-powered phone charger; a
beginner's watercolour set; an ergonomic office chair; a board game about trading spices; a weighted blanket; a
waterproof hiking jacket; an app that reminds you to drink water; a mechanical keyboard; a children's science kit;
a cast-iron frying pan; a sleep tracker ring; a language-learning podcast; a compost bin for small flats; a
sourdough starter kit; a travel pillow; a bird feeder with a camera; a pair of running shoes for trails; a
standing desk; a coffee grinder; a set of reusable beeswax food wraps; a portable projector; a puzzle of a
thousand pieces; a gardening subscription box""")
OCCASIONS = items("""a best friend's wedding; a colleague's retirement party; a high-school graduation; the opening of a
community garden; a sports team's end-of-season dinner; a grandparent's ninetieth birthday; the launch of a small
business; a charity fundraiser for a local animal shelter; the first day of a coding bootcamp; a farewell party
for a teacher; a science fair award ceremony; a town's centenary celebration; a company's tenth anniversary; a
memorial for a beloved neighbour""")
POSITIONS = items("""that cities should have more bike lanes; that homework should be limited in primary school; that
museums should be free; that everyone should learn to cook; that remote work is good for companies; that
libraries are more important than ever; that children should learn a musical instrument; that public transport
should be free; that school should start later in the morning; that people should spend less time on their phones;
that every town needs a community garden; that voting should be compulsory; that four-day working weeks make
sense; that learning history matters for everyone; that zoos do more good than harm; that handwriting should still
be taught""")
REVIEW_THINGS = items("""a new Italian restaurant in your neighbourhood; a fantasy novel you just finished; a budget
smartphone; a weekend stay at a seaside hotel; a jazz concert in a small club; an online cooking course; a
science-fiction film; a pair of wireless earbuds; a local farmers' market; a museum exhibition about ancient
maps; a coffee shop that opened last month; a city bike-sharing scheme""")
ANNOUNCEMENTS = items("""the opening of a new bakery; a charity bake sale this Saturday; a lost cat in the
neighbourhood; a company's new product launch; a free coding workshop for teenagers; a book signing at the local
library; a change in a shop's opening hours; a community beach clean-up; a band's first concert; a hiking club's
spring schedule""")
SENTENCES = items("""The meeting has been moved because some people could not come; Our product is good and you should
buy it; I think maybe we could possibly try to finish the report sooner; The weather was bad so the picnic did not
happen; He walked into the room and sat down on the chair; The results of the study were kind of interesting; We
regret to inform you that your application was not successful; The city is big and has many buildings and people;
Please make sure to turn off the lights when you leave the office; I am writing to complain about the noise from the
flat upstairs; The new software update fixes several bugs and makes the app faster; She was very sad when her
friend moved away; The team worked hard and finished the project on time; Prices went up a lot this year; The
restaurant's food was okay but the service was slow""")
STYLES = items("""more formal; more casual; more persuasive; more concise; more poetic; friendlier; more
professional; more exciting; more polite; simpler for a child""")
DRAFTS = [
    "me and my freind went to the beach yesterday it was realy fun we swimmed and eat ice cream untill the sun go down.",
    "The company have announced that there profits has increased, this is due to a new stratergy that they has used.",
    "Their are many reason why exercise is important. It make you healthy, it help your mood and you sleep more good.",
    "I am writting to apply for the job of assistant. I has worked in a office for three year and I am very organise.",
    "The book was intresting but to long, alot of the chapters was boring and the ending didnt make no sense.",
    "Climate change are a big problem. Scientist says that temperature is rising because of the gases we produces.",
    "our team meeting is on tuesday at 3 please bring you're laptops and the report we was working on last week.",
    "Learning a new langauge take time, but if you practise every day you will improve more fast then you think.",
    "The museum has a lot of old thing, like statue and painting, its a good place for to spend a rainy afternoon.",
    "Dear sir, I want to complaint about my order, it arrive late and the box were broken and one item is missing.",
]
TITLE_KINDS = items("""a blog post; a podcast episode; a children's book; a documentary; a mystery novel; a cookbook;
a YouTube video; a conference talk; a newsletter; a board game""")
BLOG_TOPICS = items("""saving money on groceries; starting a vegetable garden; learning to run; keeping a journal;
working from home; travelling with children; cooking for one; decluttering a small flat; making friends in a new
city; getting better sleep; learning to draw as an adult; planning a budget wedding; starting a book club; caring for
an older dog; cycling to work; reducing food waste; taking better phone photos; learning chess as an adult; staying
focused while studying; hosting a dinner party on a budget""")

WRITING_FOLLOWUPS = items("""Make it shorter.; Now make it funnier.; Rewrite it for a ten-year-old.; Give it a better
title.; Can you make the tone more formal?; Rewrite it from another character's point of view.; Turn it into a
short poem.; Add a surprising ending.; Make the language simpler.; Now write a version that is twice as long.; What
would you change to make it stronger? Then show the revised version.; Rewrite it in the present tense.""")
PRACTICAL_FOLLOWUPS = items("""Make it shorter.; Can you make it more formal?; Make it friendlier and less stiff.;
Rewrite it as three bullet points.; Make it sound more confident.; Cut it to half the length without losing anything
important.; Make it more exciting.; Now write a short version for social media.""")
EMAIL_FOLLOWUPS = PRACTICAL_FOLLOWUPS[:6] + items("""Give me two alternative subject lines.; Now write a reply to
it.; Add a sentence that sets a clear deadline.""")


def writing(rng: random.Random):
    s = rng.choice(STORY_SUBJECTS)
    k = rng.random()
    if k < 0.40:
        form = rng.choice(STORY_FORMS)
        p = form.format(s=s, n=rng.choice([100, 150, 200, 300, 400]), poem=rng.choice(POEM_KINDS),
                        poem_short=rng.choice(["haiku", "limerick", "four-line poem", "sonnet"]),
                        tone=rng.choice(TONES), age=rng.choice([4, 5, 6, 7, 9, 10]))
        if "words" not in p and rng.random() < 0.3:
            p += CONSTRAINT
        return p, WRITING_FOLLOWUPS
    if k < 0.52:
        return f"Write an email {rng.choice(EMAIL_TASKS)}." + CONSTRAINT, EMAIL_FOLLOWUPS
    if k < 0.57:
        years = rng.choice([1, 2, 3, 5, 8])
        return (f"Write a cover letter for {a_(rng.choice(JOBS))} position. I have {years} year"
                f"{'s' if years > 1 else ''} of experience.{CONSTRAINT}"), EMAIL_FOLLOWUPS
    if k < 0.64:
        return rng.choice([
            "Write a product description for {p}.", "Write an advertisement for {p}.",
            "Write three short taglines for {p}.", "Write a product description for {p} aimed at {a}.",
        ]).format(p=rng.choice(PRODUCTS), a=rng.choice(AUDIENCES)) + CONSTRAINT, PRACTICAL_FOLLOWUPS
    if k < 0.69:
        return rng.choice(["Write a speech for {o}.", "Write a short toast for {o}.",
                           "Write a {t} speech for {o}."]).format(o=rng.choice(OCCASIONS), t=rng.choice(TONES)) \
            + CONSTRAINT, WRITING_FOLLOWUPS
    if k < 0.75:
        return rng.choice(["Write a persuasive essay arguing {x}.", "Write a short opinion piece arguing {x}.",
                           "Write a letter to the editor of a local newspaper arguing {x}."]).format(
            x=rng.choice(POSITIONS)) + CONSTRAINT, WRITING_FOLLOWUPS
    if k < 0.80:
        return rng.choice(["Write a review of {x}.", "Write a short, honest review of {x}.",
                           "Write a {t} review of {x}."]).format(x=rng.choice(REVIEW_THINGS), t=rng.choice(TONES)) \
            + CONSTRAINT, WRITING_FOLLOWUPS
    if k < 0.84:
        return rng.choice(["Write a social media post announcing {x}.", "Write a short flyer text for {x}.",
                           "Write a newsletter paragraph about {x}."]).format(x=rng.choice(ANNOUNCEMENTS)), \
            PRACTICAL_FOLLOWUPS
    if k < 0.89:
        return (f"Rewrite this sentence to be {rng.choice(STYLES)}: \"{rng.choice(SENTENCES)}.\"",
                WRITING_FOLLOWUPS)
    if k < 0.93:
        return rng.choice(["Proofread and correct this text:\n\n{d}", "Fix the grammar and spelling in this text:\n\n{d}",
                           "Improve this paragraph and explain the changes you made:\n\n{d}"]).format(
            d=rng.choice(DRAFTS)), PRACTICAL_FOLLOWUPS
    if k < 0.96:
        return (f"Give me {rng.choice([5, 8, 10])} title ideas for {rng.choice(TITLE_KINDS)} about "
                f"{rng.choice(STORY_SUBJECTS + BLOG_TOPICS)}.", WRITING_FOLLOWUPS)
    return rng.choice(["Write a blog post about {b}.", "Write the introduction of a blog post about {b}.",
                       "Write a blog post about {b} for {a}."]).format(b=rng.choice(BLOG_TOPICS),
                                                                      a=rng.choice(AUDIENCES)) \
        + CONSTRAINT, WRITING_FOLLOWUPS


# ---------------------------------------------------------------------------------------------------
# Roleplay.

ROLES = items("""a grumpy lighthouse keeper; a cheerful cook on a space station; a medieval blacksmith; a private
detective in a rainy 1920s city; a ship's captain in the middle of a storm; a Roman soldier guarding a frontier
wall; a time traveller from the year 3000; a dragon who guards a library; a barista who remembers every customer's
order; a tour guide on Mars; a wise old tortoise; a nervous magician at their first show; a retired superhero; a
pirate who gets seasick; a park ranger in a huge forest; a chess grandmaster; an alien anthropologist studying
humans; a Victorian inventor; the computer of a starship; a travel agent for imaginary worlds; a strict but kind
head teacher; a football coach at half-time; a reporter covering a village fair; a ghost living in a modern flat;
a personal stylist; a cowboy on a cattle drive; a sushi chef; a polar explorer; a fairy godmother on a tight
budget; a knight who has forgotten his quest; a lighthouse cat; a museum night guard; a famous stage actor past
his prime; a mountain guide; a beekeeper; a court jester; a medieval monk copying books; a radio DJ on the night
shift; a train conductor on a sleeper train; a robot butler learning manners; a deep-sea diver; a fortune teller
who is always slightly wrong; a secret agent on holiday; a village baker; an ancient oak tree; a gardener at a
royal palace; a submarine captain; a circus ringmaster; a fantasy innkeeper; a marathon runner at mile twenty; a
hotel concierge; a weather forecaster; a librarian in a magical library; a zookeeper; a master carpenter""")
ROLE_QUESTIONS = [
    "What is the best advice you have ever been given?", "What are you most afraid of?",
    "Can you help me find my way?", "What do you do when things go wrong?", "Why did you choose this life?",
    "What is the strangest thing that has happened to you?", "What would you change about your job?",
    "Do you have any regrets?", "What does a good day look like for you?", "Who do you trust most?",
    "What should I know before I start?", "Can I join you for a while?",
]
ROLE_PROBLEMS = items("""an exam I am nervous about; an argument with my best friend; starting at a new school; saving
money; asking for a pay rise; learning to cook; feeling homesick; a job interview next week; keeping a plant
alive; making a hard decision; finishing a long project; being afraid of public speaking""")
OTHERS = items("""a lost traveller; a new apprentice; a curious child; an old rival; a customer who is in a hurry; a
suspicious inspector; a long-lost sibling; a journalist looking for a story""")
SETTINGS = items("""on a stormy night; at a busy market; at the start of a long journey; just after something has been
stolen; in a place where nobody else is around; on the last day of the season; during a festival""")
THINGS = items("""a houseplant on a windowsill; a city pigeon; an old library book; a smartphone battery; a raindrop;
a garden snail; a traffic light; a pair of old boots; a lighthouse lamp; a goldfish; a grand piano; a suitcase on
its first trip; a school backpack; a weather balloon; a bee; a sandcastle; a bookmark; a satellite; an alarm clock;
a cactus in an office""")
EVENTS = items("""won a prize they did not expect; lost their way in a strange city; found a mysterious letter; been
given a second chance; finished the hardest task of their life; met their hero; been accused of something they did
not do; discovered a hidden talent""")
INTERVIEW_JOBS = JOBS
LANGS_SPOKEN = items("""Spanish; French; German; Italian; Portuguese; Japanese""")
SERVICE_CASES = [
    ("an internet provider", "My internet has been down for two days and nobody has called me back."),
    ("an online shoe shop", "The shoes I ordered are the wrong size and the return label does not work."),
    ("a bank", "I see a payment on my account that I did not make."),
    ("an airline", "My suitcase did not arrive and I have a wedding tomorrow."),
    ("a food delivery app", "My order arrived cold and half of it was missing."),
    ("a gym", "I was charged twice this month."),
    ("a phone company", "I want to cancel my contract but I keep getting sent to a different department."),
    ("a furniture store", "The table I bought is missing two screws and the instructions are unclear."),
    ("a hotel", "The room I booked has no working air conditioning and it is very hot."),
    ("a train company", "My train was cancelled and I missed an important meeting."),
]
ROLE_FOLLOWUPS = items("""Stay in character: what is your biggest regret?; What would you say to someone who does not
believe you?; Describe where you are right now in detail.; Tell me a secret nobody else knows.; How did you end
up doing this?; Give me one piece of advice before I leave.; Someone suddenly interrupts you. How do you react?;
Now step out of character and explain what makes this character interesting.; What happens next?; Tell me about
your worst day.""")
INTERVIEW_FOLLOWUPS = [
    "Here is my answer: I learn fast and I enjoy working with people. What is your next question?",
    "I would say my biggest weakness is that I take on too much work. Is that a good answer?",
    "I once solved a problem with a difficult customer by listening first. What do you think, and what's next?",
    "Can you give me feedback on how I am doing so far?",
]
SERVICE_FOLLOWUPS = ["That is not good enough. I want to speak to a manager.", "Okay, thank you. How long will that take?",
                     "Can I get some compensation for the trouble?", "Fine. Please summarise what happens next."]
TUTOR_FOLLOWUPS = ["I think the answer is the second one. Am I right?", "Can you give me an easier one first?",
                   "Why is that the right answer?", "Great, give me another one that is a bit harder."]


def roleplay(rng: random.Random):
    r = rng.choice(ROLES)
    k = rng.random()
    if k < 0.15:
        return rng.choice(["Pretend you are {r}. Introduce yourself and describe a typical day.",
                           "You are {r}. Tell me about yourself in the first person.",
                           "Role-play as {r}. Tell me a story from your past."]).format(r=r), ROLE_FOLLOWUPS
    if k < 0.35:
        return f"You are {r}. I walk up to you and ask: \"{rng.choice(ROLE_QUESTIONS)}\" Answer in character.", \
            ROLE_FOLLOWUPS
    if k < 0.47:
        return f"Stay in character as {r} and give me advice about {rng.choice(ROLE_PROBLEMS)}.", ROLE_FOLLOWUPS
    if k < 0.59:
        return (f"Let's play a scene. You are {r} and I am {rng.choice(OTHERS)}. Start the scene "
                f"{rng.choice(SETTINGS)}."), ROLE_FOLLOWUPS
    if k < 0.69:
        return rng.choice(["Imagine you are {t}. Describe your day from your point of view.",
                           "Write a monologue as if you were {t}.", "You are {t}. What do you think about people?"]
                          ).format(t=rng.choice(THINGS)), ROLE_FOLLOWUPS
    if k < 0.76:
        return f"Write a monologue by {r} who has just {rng.choice(EVENTS)}.", ROLE_FOLLOWUPS
    if k < 0.84:
        return rng.choice([
            "Act as a job interviewer for {j} position. Ask me your first question and wait for my answer.",
            "Pretend to interview me for a job as {j}. Start with a question about my experience.",
        ]).format(j=a_(rng.choice(INTERVIEW_JOBS))), INTERVIEW_FOLLOWUPS
    if k < 0.92:
        company, complaint = rng.choice(SERVICE_CASES)
        return (f"Pretend you are a customer service agent for {company}. I say: \"{complaint}\" "
                "How do you respond?"), SERVICE_FOLLOWUPS
    if k < 0.96:
        return rng.choice([
            "Act as my {l} tutor. Give me a short exercise for a beginner and wait for my answer.",
            "You are a patient {l} teacher. Quiz me on five everyday words.",
        ]).format(l=rng.choice(LANGS_SPOKEN)), TUTOR_FOLLOWUPS
    return (f"You are a tour guide in {rng.choice(PLACES)}. Take me on a short walking tour and describe what we "
            "see."), ROLE_FOLLOWUPS


# ---------------------------------------------------------------------------------------------------
# Reasoning.

COMPARATIVES = [("taller", "tallest", "shortest"), ("older", "oldest", "youngest"), ("faster", "fastest", "slowest"),
                ("heavier", "heaviest", "lightest"), ("richer", "richest", "poorest")]
KINDS_OF_THINGS = items("""cats; dogs; birds; musicians; doctors; teachers; painters; runners; students; gardeners;
blickets; wugs; daxes; zorbs; fish; mammals; engineers; poets; chess players; cyclists""")
ARGUMENTS = [
    "Every time I wash my car, it rains the next day. So washing my car causes rain.",
    "My grandfather smoked all his life and lived to ninety, so smoking cannot be that bad.",
    "Most successful people wake up early, so waking up early will make you successful.",
    "This diet must work: thousands of people have bought the book.",
    "If we allow students to use calculators, soon they will not be able to do any maths at all.",
    "Nobody has proven that ghosts do not exist, so they probably do.",
    "The new manager started in March and sales fell in April, so the manager is bad for sales.",
    "You either support every part of this plan or you do not care about the city.",
    "The expert is not very friendly, so his argument about the bridge must be wrong.",
    "Ice cream sales and sunburn both rise in summer, so ice cream causes sunburn.",
    "I asked five friends and they all like my idea, so most people will like it.",
    "This medicine is natural, so it cannot have side effects.",
    "Our team lost the last three games, so we are due for a win this time.",
    "If the theory were true, scientists would all agree. Some disagree, so it is false.",
    "Cars are safer than ever, so there is no need to wear a seat belt any more.",
]
DECISIONS = [
    ("renting a flat near work", "buying a house an hour away", "I commute five days a week and like to cycle."),
    ("a job with a higher salary", "a job with more free time", "I have a young child and some savings."),
    ("learning Python", "learning JavaScript", "I want to analyse data for my small shop."),
    ("a used car", "an electric scooter", "I live in a city with good public transport."),
    ("studying abroad for a year", "staying at my home university", "I am shy but curious."),
    ("a big wedding", "a small one", "our families are large but our budget is limited."),
    ("adopting a puppy", "adopting an older dog", "I work from home three days a week."),
    ("a gym membership", "running outdoors", "I get bored easily and the winters are cold."),
    ("a laptop", "a tablet", "I write long reports and travel often."),
    ("starting my own bakery", "keeping my office job", "I have baked for ten years as a hobby."),
]
FERMI = items("""how many piano tuners work in a city of one million people; how many litres of water a person drinks
in a lifetime; how many tennis balls fit in a school bus; how many words a person speaks in a year; how many
trees there are in a large city park; how many cups of coffee are sold in a country in one day; how many steps it
takes to walk across a country; how many books a public library lends in a year; how many hairs are on a human
head; how many bicycles there are in a city of half a million; how long it would take to count to one million;
how much paper an office of fifty people uses in a year""")
COUNTERFACTUALS = items("""humans had never invented the wheel; the Moon were twice as close to Earth; everyone could
read minds; nobody needed to sleep; the internet disappeared for a month; all cars became self-driving overnight;
every country used the same currency; people lived to two hundred years; it never rained again in a region;
animals could talk; paper had never been invented; the working week were three days long; electricity cost nothing;
all schools taught only online; every city banned private cars""")
ANALOGIES = [("a book", "a library", "a painting"), ("a thermometer", "temperature", "a clock"),
             ("a seed", "a tree", "a child"), ("a pilot", "an aeroplane", "a captain"),
             ("a word", "a sentence", "a note"), ("hunger", "food", "thirst"), ("a key", "a lock", "a password"),
             ("an author", "a novel", "a composer"), ("the heart", "blood", "a pump"),
             ("a map", "a territory", "a menu"), ("a bee", "a hive", "a citizen"),
             ("a glove", "a hand", "a sock"), ("a caterpillar", "a butterfly", "a tadpole")]
PUZZLES = [
    "You have eight coins that look the same, but one is slightly heavier. With a balance scale, how can you find the "
    "heavy coin in only two weighings?",
    "A farmer must take a wolf, a goat and a cabbage across a river in a boat that holds only him and one of them. "
    "The wolf cannot be left alone with the goat, nor the goat with the cabbage. How does he do it?",
    "I have two ropes that each take exactly one hour to burn, but they burn unevenly. How can I measure 45 minutes?",
    "There are three boxes labelled apples, oranges and mixed, and every label is wrong. You may take one fruit from "
    "one box. How do you relabel all the boxes correctly?",
    "A clock shows 3:15. What is the angle between the hour hand and the minute hand?",
    "You have a 3-litre jug and a 5-litre jug and unlimited water. How can you measure exactly 4 litres?",
    "Four people must cross a bridge at night with one torch. They take 1, 2, 5 and 10 minutes and at most two can "
    "cross at once, walking at the slower one's pace. What is the shortest total time?",
    "A snail climbs 3 metres up a 10-metre wall each day and slips back 2 metres each night. On which day does it "
    "reach the top?",
    "If it takes five machines five minutes to make five widgets, how long does it take 100 machines to make 100 "
    "widgets?",
    "A bat and a ball cost 1.10 dollars together, and the bat costs one dollar more than the ball. How much does the "
    "ball cost?",
    "In a room there are three light switches outside a closed door, and one of them controls a lamp inside. You may "
    "enter the room only once. How do you find the right switch?",
    "A lily pad patch doubles in size every day and covers the whole pond on day 48. On which day did it cover half "
    "the pond?",
]


def _ordering_puzzle(rng: random.Random) -> str:
    names = rng.sample(NAMES, rng.choice([3, 4, 5]))
    comp, most, least = rng.choice(COMPARATIVES)
    facts = [f"{names[i]} is {comp} than {names[i + 1]}." for i in range(len(names) - 1)]
    rng.shuffle(facts)
    q = rng.choice([f"Who is the {most}?", f"Who is the {least}?",
                    f"Is {names[-1]} {comp} than {names[0]}?", "Put them in order and explain."])
    return " ".join(facts) + " " + q


def _sequence(rng: random.Random) -> str:
    a, d = rng.randint(1, 20), rng.randint(2, 9)
    kind = rng.randrange(6)
    if kind == 0:
        seq = [a + d * i for i in range(5)]
    elif kind == 1:
        seq = [a * rng.choice([2, 3]) ** i for i in range(5)]
    elif kind == 2:
        seq = [(i + a % 5 + 1) ** 2 for i in range(5)]
    elif kind == 3:
        seq = [a, a + d]
        while len(seq) < 6:
            seq.append(seq[-1] + seq[-2])
    elif kind == 4:
        seq = [a + i * (i + 1) // 2 * d for i in range(5)]
    else:
        seq = [a + d * (i // 2) if i % 2 == 0 else a * 10 + i for i in range(6)]
    return rng.choice(["What is the next number in the sequence {s}, ...? Explain the pattern.",
                       "Find the rule behind {s} and give the next two numbers.",
                       "Continue this sequence and explain your reasoning: {s}"]).format(s=", ".join(map(str, seq)))


def _truth_puzzle(rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    return rng.choice([
        f"{a} says {b} is lying. {b} says {c} is lying. {c} says both {a} and {b} are lying. Who is telling the truth?",
        f"On an island, knights always tell the truth and knaves always lie. {a} says: \"{b} and I are both knaves.\" "
        f"What are {a} and {b}?",
        f"One of {a}, {b} and {c} ate the last biscuit. {a} says: \"It was {b}.\" {b} says: \"It was not me.\" "
        f"{c} says: \"It was not me.\" Only one of them is telling the truth. Who ate it?",
    ])


def _schedule(rng: random.Random) -> str:
    h, m = rng.randint(7, 16), rng.choice([0, 15, 20, 30, 45, 50])
    dur_m = rng.choice([5, 10, 25, 35, 40, 55])
    dur_h = rng.randint(1, 4)
    hours = f"{dur_h} hour{'s' if dur_h > 1 else ''}"
    return rng.choice([
        f"A meeting starts at {h}:{m:02d} and lasts {hours} and {dur_m} minutes. When does it end?",
        f"I need to arrive at {h + 2}:{m:02d}. The trip takes {hours} {dur_m} minutes and I need 20 minutes to "
        "get ready. When should I start getting ready?",
        f"Three tasks take {rng.randint(20, 90)}, {rng.randint(20, 90)} and {rng.randint(20, 90)} minutes, and the "
        f"second cannot start before the first ends. If I start at {h}:{m:02d}, what is the earliest time I can "
        "finish all three if the third can run at the same time as the others?",
    ])


REASONING_FOLLOWUPS = items("""Are you sure? Check your answer step by step.; Explain your reasoning more simply.; How
would the answer change if one of the conditions were different?; Can you solve it in a different way?; What is
the most common mistake people make with this kind of problem?; Make up a similar puzzle for me to solve.; Explain
it to a child.; What assumptions did you make?""")


def reasoning(rng: random.Random):
    k = rng.random()
    if k < 0.16:
        return _ordering_puzzle(rng), REASONING_FOLLOWUPS
    if k < 0.26:
        a, b, c = rng.sample(KINDS_OF_THINGS, 3)
        return rng.choice([
            f"All {a} are {b}. Some {b} are {c}. Can we conclude that some {a} are {c}? Explain.",
            f"No {a} are {b}. All {c} are {b}. What can we conclude about {a} and {c}?",
            f"If every one of the {a} is one of the {b}, and none of the {b} is one of the {c}, can any of the {a} be "
            f"one of the {c}?",
        ]), REASONING_FOLLOWUPS
    if k < 0.38:
        return _sequence(rng), REASONING_FOLLOWUPS
    if k < 0.45:
        return _truth_puzzle(rng), REASONING_FOLLOWUPS
    if k < 0.52:
        return _schedule(rng), REASONING_FOLLOWUPS
    if k < 0.61:
        return rng.choice(["Find the flaw in this argument: {a}", "What is wrong with this reasoning? {a}",
                           "Is this a good argument? Explain. \"{a}\""]).format(a=rng.choice(ARGUMENTS)), \
            REASONING_FOLLOWUPS
    if k < 0.69:
        x, y, ctx = rng.choice(DECISIONS)
        return (f"I am choosing between {x} and {y}. {ctx[0].upper() + ctx[1:]} Which should I choose? Think it "
                "through step by step."), REASONING_FOLLOWUPS
    if k < 0.77:
        return rng.choice(["Estimate {f}. Show your reasoning.", "Make a rough estimate of {f}, step by step.",
                           "Walk me through a back-of-the-envelope estimate of {f}."]).format(f=rng.choice(FERMI)), \
            REASONING_FOLLOWUPS
    if k < 0.85:
        return rng.choice(["What would happen if {c}? Think through the consequences.",
                           "Imagine that {c}. What would change in everyday life?",
                           "Reason step by step: what would be the first three effects if {c}?"]).format(
            c=rng.choice(COUNTERFACTUALS)), REASONING_FOLLOWUPS
    if k < 0.91:
        a, b, c = rng.choice(ANALOGIES)
        return f"Complete the analogy: {a} is to {b} as {c} is to what? Explain.", REASONING_FOLLOWUPS
    return rng.choice(PUZZLES), REASONING_FOLLOWUPS


# ---------------------------------------------------------------------------------------------------
# Math.

MATH_CONCEPTS = items("""a derivative; an integral; a limit; a prime number; a logarithm; a matrix; an eigenvalue; a
vector; standard deviation; a normal distribution; a p-value; a function; a polynomial; a complex number; a proof by
induction; a proof by contradiction; the Pythagorean theorem; a geometric series; compound interest; a probability
distribution; a set; a graph in graph theory; modular arithmetic; the binomial theorem; a permutation; a
combination; conditional probability; Bayes' theorem; the median; the law of large numbers; a linear equation; a
quadratic equation; an exponential function; a sine wave; pi; the golden ratio; a fractal; infinity; a vector
space; a differential equation""")
PROOFS = items("""the sum of two odd numbers is even; there are infinitely many prime numbers; the square root of 2 is
irrational; the sum of the first n odd numbers is n squared; the angles of a triangle add up to 180 degrees; a number
is divisible by 3 if the sum of its digits is; the product of two consecutive integers is even; 1 + 2 + ... + n
equals n(n+1)/2; every integer greater than 1 has a prime factor; the difference of two squares a^2 - b^2 equals
(a - b)(a + b); n^3 - n is always divisible by 6; a set with n elements has 2^n subsets""")


def _poly(rng: random.Random) -> str:
    deg = rng.choice([2, 3, 4])
    terms = []
    for p in range(deg, -1, -1):
        c = rng.randint(-9, 9)
        if c == 0 and p != deg:
            continue
        c = c or 1
        x = "" if p == 0 else ("x" if p == 1 else f"x^{p}")
        coef = str(abs(c)) if (abs(c) != 1 or p == 0) else ""
        sign = "-" if c < 0 else "+"
        terms.append((sign, coef + x))
    s = ("-" if terms[0][0] == "-" else "") + terms[0][1]
    return s + "".join(f" {sg} {t}" for sg, t in terms[1:])


def _math_problem(rng: random.Random) -> str:
    R = rng.randint
    forms = [
        lambda: f"A shop sells notebooks at {R(2, 9)}.{R(10, 95):02d} dollars each. How much do {R(3, 40)} notebooks cost?",
        lambda: f"A car travels {R(80, 600)} km in {R(2, 8)} hours. What is its average speed in km/h and in m/s?",
        lambda: f"A rectangle has a perimeter of {2 * R(10, 60)} cm and a length of {R(5, 9)} cm. What is its area?",
        lambda: f"Solve for x: {R(2, 12)}x - {R(1, 40)} = {R(10, 150)}. Show each step.",
        lambda: f"Solve the system: {R(1, 6)}x + {R(1, 6)}y = {R(5, 40)} and {R(1, 6)}x - {R(1, 6)}y = {R(-10, 20)}.",
        lambda: (lambda a, b: f"Solve x^2 {'-' if a + b > 0 else '+'} {abs(a + b)}x {'+' if a * b >= 0 else '-'} "
                 f"{abs(a * b)} = 0.")(R(-9, 9), R(1, 9)),
        lambda: f"Factor the expression x^2 + {R(2, 12)}x + {R(1, 35)}, or explain why it cannot be factored over the integers.",
        lambda: f"Find the derivative of f(x) = {_poly(rng)}.",
        lambda: f"Find the derivative of f(x) = {rng.choice(['x^2 sin(x)', 'e^(3x) cos(x)', 'ln(x^2 + 1)', 'x / (x + 1)', 'sqrt(4x + 1)', 'x e^x', 'sin(x)^2', 'tan(2x)'])}.",
        lambda: f"Compute the integral of {_poly(rng)} from {R(0, 2)} to {R(3, 6)}.",
        lambda: f"Find the indefinite integral of {rng.choice(['x e^x', 'sin(x) cos(x)', '1/(x+2)', 'x^2 ln(x)', 'cos(3x)', '2x/(x^2+1)'])}.",
        lambda: f"Evaluate the limit of {rng.choice(['sin(x)/x', '(1 - cos x)/x^2', '(x^2 - 4)/(x - 2)', '(e^x - 1)/x', '(3x^2 + 1)/(x^2 - 5)'])} as x approaches {rng.choice(['0', '2', 'infinity'])}.",
        lambda: "Find the mean, median and mode of these numbers: " + ", ".join(str(R(1, 30)) for _ in range(R(6, 12))) + ".",
        lambda: "Compute the standard deviation of: " + ", ".join(str(R(1, 20)) for _ in range(R(5, 8))) + ". Explain each step.",
        lambda: f"Two fair dice are rolled. What is the probability that the total is {R(2, 12)}?",
        lambda: f"A bag holds {R(2, 9)} red, {R(2, 9)} green and {R(2, 9)} blue marbles. Two are drawn without replacement. What is the probability that both are red?",
        lambda: f"A fair coin is tossed {R(3, 8)} times. What is the probability of getting exactly {R(1, 3)} heads?",
        lambda: f"In how many ways can {R(4, 9)} people sit in a row? And around a round table?",
        lambda: f"How many ways are there to choose a committee of {R(2, 5)} from {R(6, 15)} people?",
        lambda: f"A circle has a radius of {R(2, 30)} cm. What are its area and circumference?",
        lambda: f"A right triangle has legs of {R(3, 20)} and {R(3, 20)} units. How long is the hypotenuse?",
        lambda: f"What is the volume of a cylinder with radius {R(2, 15)} cm and height {R(3, 40)} cm?",
        lambda: f"A cone has radius {R(2, 10)} m and height {R(3, 20)} m. Find its volume and surface area.",
        lambda: f"What is the sum of the interior angles of a polygon with {R(5, 14)} sides?",
        lambda: f"Find the greatest common divisor and the least common multiple of {R(12, 300)} and {R(12, 300)}.",
        lambda: f"Write {R(100, 5000)} as a product of prime factors.",
        lambda: f"What is {R(10, 999)} mod {R(3, 17)}? And what is {R(2, 9)}^{R(5, 30)} mod {R(5, 13)}?",
        lambda: f"Add {R(1, 9)}/{R(2, 12)} and {R(1, 9)}/{R(2, 12)}, and simplify the result.",
        lambda: f"What is {R(5, 95)}% of {R(40, 2000)}? And what percentage is {R(5, 90)} of {R(100, 400)}?",
        lambda: f"A jacket costs {R(40, 300)} dollars. It is discounted by {R(10, 50)}% and then taxed at {R(5, 20)}%. What is the final price?",
        lambda: f"You invest {R(1, 20) * 500} dollars at {R(2, 9)}% interest compounded {rng.choice(['yearly', 'monthly', 'quarterly'])}. How much is it worth after {R(2, 15)} years?",
        lambda: f"Convert {R(2, 500)} {rng.choice(['miles to kilometres', 'pounds to kilograms', 'litres to gallons', 'feet to metres', 'square metres to square feet'])}.",
        lambda: f"Find the determinant of the matrix [[{R(-5, 9)}, {R(-5, 9)}], [{R(-5, 9)}, {R(-5, 9)}]] and say whether it is invertible.",
        lambda: f"Multiply the matrices [[{R(0, 5)}, {R(0, 5)}], [{R(0, 5)}, {R(0, 5)}]] and [[{R(0, 5)}, {R(0, 5)}], [{R(0, 5)}, {R(0, 5)}]].",
        lambda: f"The first term of an arithmetic sequence is {R(1, 20)} and the common difference is {R(2, 9)}. What is term number {R(10, 60)}, and what is the sum of the first {R(10, 40)} terms?",
        lambda: f"What is the sum of the geometric series {R(1, 5)} + {R(1, 5)}*{R(2, 3)} + ... with {R(5, 12)} terms, where each term is {R(2, 3)} times the previous one?",
        lambda: f"A recipe for {R(2, 6)} people needs {R(100, 500)} g of flour. How much flour is needed for {R(7, 25)} people?",
        lambda: f"Pipe A fills a tank in {R(2, 9)} hours and pipe B in {R(3, 12)} hours. How long do they take together?",
        lambda: f"{rng.choice(NAMES)} is {R(20, 50)} years old and her son is {R(2, 15)}. In how many years will she be exactly twice his age?",
        lambda: f"A train leaves at {R(6, 11)}:00 at {R(60, 120)} km/h; another leaves the same station {R(2, 3)} hours later at {R(100, 180)} km/h on the same track. When does the second catch up?",
        lambda: f"Solve the inequality {R(2, 9)}x + {R(1, 20)} > {R(20, 80)} and describe the solution on a number line.",
        lambda: f"Find the slope and y-intercept of the line through ({R(-9, 9)}, {R(-9, 9)}) and ({R(-9, 9)}, {R(-9, 9)}).",
        lambda: f"Simplify: ({R(2, 9)}x^{R(2, 5)} y^{R(1, 4)}) * ({R(2, 9)}x^{R(1, 4)} y^{R(2, 5)}) / ({R(2, 6)}x y).",
        lambda: f"Is {R(100, 999)} a prime number? Explain how you check.",
        lambda: f"What is the probability of drawing {rng.choice(['an ace', 'a heart', 'a face card', 'a red king', 'two aces in a row'])} from a standard deck of 52 cards?",
    ]
    return rng.choice(forms)()


MATH_FOLLOWUPS = items("""Can you check the answer in another way?; Now explain it to a child.; Write Python code
that computes this.; What if all the numbers were doubled?; Give me a similar problem to practise, without the
answer.; Which step is the easiest to get wrong?; Can you explain the second step in more detail?; Is there a
shortcut for this kind of problem?""")


def math(rng: random.Random):
    k = rng.random()
    if k < 0.80:
        return _math_problem(rng), MATH_FOLLOWUPS
    if k < 0.92:
        return rng.choice(["Explain what {c} is, with an example.", "What is {c}? Explain it to {a}.",
                           "Give an intuitive explanation of {c} and one place it is used in real life.",
                           "Explain {c} in three short paragraphs."]).format(
            c=rng.choice(MATH_CONCEPTS), a=rng.choice(AUDIENCES)), MATH_FOLLOWUPS
    return rng.choice(["Prove that {p}.", "Show that {p}. Explain each step.", "Give a short proof that {p}."]).format(
        p=rng.choice(PROOFS)), MATH_FOLLOWUPS


# ---------------------------------------------------------------------------------------------------
# Coding.

CODE_TASKS = items("""reverses the words of a sentence; counts how often each word appears in a text; checks whether a
string is a palindrome, ignoring punctuation; removes duplicate items from a list while keeping their order; finds
the second largest number in a list; merges two sorted lists; flattens a nested list; computes the nth Fibonacci
number iteratively; checks whether a number is prime; returns all primes below a limit; converts a Roman numeral to
an integer; converts an integer to a Roman numeral; validates that brackets in a string are balanced; computes the
median of a list; groups a list of words by their first letter; transposes a matrix; rotates a list by k places;
finds the longest common prefix of several strings; counts the vowels in a string; converts snake_case to
camelCase; computes a moving average; finds all pairs in a list that add up to a target; returns the most common
element of a list; splits a list into chunks of a given size; checks whether two strings are anagrams; performs a
binary search on a sorted list; sorts a list of dictionaries by a given key; parses a CSV file and sums one column;
reads a text file and prints its ten most common words; validates an email address with a simple rule; generates a
random password of a given length; converts Celsius to Fahrenheit for a list of values; implements a stack with
push, pop and peek; implements a queue using two stacks; reverses a linked list; finds the depth of a binary tree;
checks whether a binary tree is a valid search tree; counts the islands in a grid of 0s and 1s; finds the shortest
path in a grid with breadth-first search; implements Dijkstra's algorithm on a small graph; detects a cycle in a
directed graph; implements an LRU cache; computes the edit distance between two strings; finds the longest
increasing subsequence; solves the coin-change problem with dynamic programming; generates all permutations of a
string; generates all subsets of a set; checks whether a sudoku row, column and box are valid; computes the
factorial of a number recursively and iteratively; formats a number with thousands separators; calculates the
number of days between two dates; checks whether a year is a leap year; compresses a string with run-length
encoding; decodes a run-length encoded string; merges overlapping intervals; finds the missing number in a list
from 1 to n; returns the intersection of two lists; counts the lines, words and characters of a file; implements
quicksort; implements merge sort; implements a simple tokenizer for arithmetic expressions; evaluates a simple
arithmetic expression with + - * / and parentheses; retries a function call up to three times with a delay;
memoises an expensive function; shows a progress bar in the terminal while a loop runs; builds a word
frequency histogram printed with stars; finds the k largest elements of a list; checks whether a string has all
unique characters; implements a simple bank account class with deposit and withdraw; implements a to-do list class
that can add, complete and list tasks; converts a list of tuples into a dictionary; deep-merges two nested
dictionaries; finds the first non-repeating character in a string; shuffles a list with the Fisher-Yates
algorithm; computes the greatest common divisor; converts a decimal number to binary; checks whether a number is a
power of two; reverses the digits of an integer; finds anagrams grouped together in a list of words""")
STOP_WORDS = {"a", "an", "the", "of", "whether", "and", "with", "in", "to", "all", "by", "its", "their", "from",
              "is", "that", "for", "two", "one", "given", "simple"}
CODE_LANGS = ["Python"] * 8 + ["JavaScript"] * 3 + ["TypeScript", "Java", "Java", "C", "C++", "C++", "Go", "Rust",
                                                   "C#", "Ruby", "Kotlin", "Swift"]
SNIPPETS = [
    ("Python", "def average(nums):\n    total = 0\n    for n in nums:\n        total += n\n    return total / len(nums)"),
    ("Python", "def find_max(items):\n    best = 0\n    for x in items:\n        if x > best:\n            best = x\n    return best"),
    ("Python", "def count_words(text):\n    counts = {}\n    for w in text.split():\n        counts[w] = counts.get(w, 0) + 1\n    return counts"),
    ("Python", "def append_item(item, bucket=[]):\n    bucket.append(item)\n    return bucket"),
    ("Python", "results = []\nfor i in range(10):\n    if i % 2 == 0:\n        results.append(i * i)\nprint(results)"),
    ("Python", "import json\n\nwith open('config.json') as f:\n    config = json.load(f)\nport = config['port']\nprint('listening on', port)"),
    ("Python", "def is_sorted(xs):\n    for i in range(len(xs)):\n        if xs[i] > xs[i + 1]:\n            return False\n    return True"),
    ("Python", "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n        count = self.count + 1\n        return count"),
    ("Python", "def fib(n):\n    if n <= 1:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i in range(30)])"),
    ("Python", "names = ['ana', 'bo', 'cy']\nfor i in range(len(names)):\n    print(i, names[i].upper())"),
    ("JavaScript", "function sum(arr) {\n  let total = 0;\n  for (let i = 0; i <= arr.length; i++) {\n    total += arr[i];\n  }\n  return total;\n}"),
    ("JavaScript", "const users = [{name: 'a', age: 30}, {name: 'b', age: 17}];\nconst adults = users.filter(u => u.age >= 18).map(u => u.name);\nconsole.log(adults);"),
    ("JavaScript", "for (var i = 0; i < 3; i++) {\n  setTimeout(function () { console.log(i); }, 100);\n}"),
    ("JavaScript", "async function load(url) {\n  const res = fetch(url);\n  const data = await res.json();\n  return data;\n}"),
    ("Java", "public static int indexOf(int[] a, int target) {\n    for (int i = 0; i < a.length; i++) {\n        if (a[i] == target) return i;\n    }\n    return -1;\n}"),
    ("Java", "String s = \"\";\nfor (int i = 0; i < 1000; i++) {\n    s += i + \",\";\n}\nSystem.out.println(s);"),
    ("C", "int sum_array(int *a, int n) {\n    int s;\n    for (int i = 0; i < n; i++) s += a[i];\n    return s;\n}"),
    ("C", "char *greet(const char *name) {\n    char buf[64];\n    sprintf(buf, \"Hello, %s\", name);\n    return buf;\n}"),
    ("C++", "std::vector<int> v = {1, 2, 3, 4};\nfor (auto it = v.begin(); it != v.end(); ++it) {\n    if (*it % 2 == 0) v.erase(it);\n}"),
    ("Go", "func divide(a, b int) int {\n    return a / b\n}\n\nfunc main() {\n    fmt.Println(divide(10, 0))\n}"),
    ("Rust", "fn longest(a: &str, b: &str) -> &str {\n    if a.len() > b.len() { a } else { b }\n}"),
    ("SQL", "SELECT customer_id, COUNT(*)\nFROM orders\nWHERE total > 100\nGROUP BY customer_id\nHAVING COUNT(*) > 3;"),
    ("Bash", "for f in $(ls *.txt); do\n  wc -l $f\ndone"),
]
SNIPPET_ASKS = ["What does this {l} code do?", "Explain this {l} code line by line.",
                "Is there a bug in this {l} code? If so, fix it.", "How could this {l} code be improved?",
                "Review this {l} code as a senior engineer would.", "Write unit tests for this {l} code.",
                "Rewrite this {l} code in {other}."]
SCHEMAS = [
    ("customers(id, name, city), orders(id, customer_id, total, created_at)",
     ["the total spent by each customer", "the five customers with the most orders",
      "customers who have never placed an order", "the average order value per city", "orders placed in the last 30 days"]),
    ("employees(id, name, department_id, salary, hired_on), departments(id, name)",
     ["the highest-paid employee in each department", "departments with more than ten employees",
      "the average salary per department, highest first", "employees hired in 2023", "employees who earn more than their department's average"]),
    ("books(id, title, author_id, year), authors(id, name, country), loans(book_id, member_id, loaned_on)",
     ["the ten most borrowed books", "authors with at least three books", "books never borrowed",
      "the number of loans per month", "the most popular author in each country"]),
    ("products(id, name, category, price), sales(product_id, quantity, sold_on)",
     ["revenue per category", "the best-selling product each month", "products whose price is above the category average",
      "total quantity sold per weekday", "categories with falling sales compared with last month"]),
    ("students(id, name, year), courses(id, title), enrolments(student_id, course_id, grade)",
     ["each student's average grade", "courses with no enrolments", "the top three students in each course",
      "students enrolled in more than four courses", "the grade distribution for one course"]),
]
REGEXES = items("""a valid email address; a UK postcode; a date in the form YYYY-MM-DD; a US phone number with optional
area code; a hexadecimal colour like #1a2b3c; an IPv4 address; a time in 24-hour format; a word that starts and
ends with the same letter; a strong password with a digit, a capital and a symbol; a URL starting with http or
https; a number with optional decimals and sign; repeated words like 'the the'""")
SHELL_TASKS = items("""find all files larger than 100 MB in my home directory; count the lines in every .py file in a
project; replace a word in all text files of a folder; show the ten largest folders on disk; find which process is
using port 8080; rename all .jpeg files to .jpg; compress a folder into a tar.gz archive; show the last 50 lines of a
log and keep following it; list files changed in the last 24 hours; check whether a website responds; delete all empty directories; sort a CSV file by its second column; count unique IP addresses in a log
file; run a command every five minutes; see the git commits of the last week""")
CONCEPT_PAIRS = [("a list", "a tuple in Python"), ("a process", "a thread"), ("TCP", "UDP"), ("SQL", "NoSQL databases"),
                 ("a stack", "a queue"), ("an interface", "an abstract class"), ("git merge", "git rebase"),
                 ("==", "is in Python"), ("let", "var in JavaScript"), ("compiled", "interpreted languages"),
                 ("a shallow copy", "a deep copy"), ("synchronous", "asynchronous code"), ("REST", "GraphQL"),
                 ("unit tests", "integration tests"), ("a hash map", "a binary search tree"),
                 ("static typing", "dynamic typing"), ("recursion", "iteration"), ("a library", "a framework"),
                 ("HTTP", "HTTPS"), ("a class", "an object")]
CODE_CONCEPTS = items("""recursion; big-O notation; a closure; a decorator in Python; a generator; dependency
injection; a race condition; a deadlock; memoisation; dynamic programming; a hash function; object-oriented
programming; functional programming; immutability; garbage collection; a pointer; an API; a REST endpoint; version
control; continuous integration; a unit test; regular expressions; SQL joins; database indexing; caching; a
virtual environment; type hints; exceptions and error handling; event loops; the observer pattern; the singleton
pattern; a binary heap; a trie; a bloom filter; load balancing; Docker containers""")
SYSTEMS = items("""a URL shortener; a chat application; a to-do list app with sync; a library lending system; a
parking-lot booking service; a leaderboard for an online game; a recipe website with search; a rate limiter for
an API; a newsletter signup service; an online bookshop's shopping cart""")
CODE_FOLLOWUPS = items("""Add type hints and docstrings.; Now write tests for it.; What is the time complexity? Can it
be improved?; Rewrite it in JavaScript.; Handle invalid input as well.; Explain it line by line.; Make it shorter.;
How would you make it faster for very large inputs?; Rewrite it without using any library functions.; Give an
example of how to call it.""")
CODE_EXPLAIN_FOLLOWUPS = items("""Can you give a short code example?; Explain it to a beginner.; When should I not use
it?; What is a common mistake with it?; Summarize that in three bullet points.; How is it done in Python?""")


def coding(rng: random.Random):
    k = rng.random()
    task = rng.choice(CODE_TASKS)
    lang = rng.choice(CODE_LANGS)
    if k < 0.40:
        return rng.choice([
            "Write a {l} function that {t}.", "How do I write {l} code that {t}?",
            "Implement a {l} function that {t}, and explain its time complexity.",
            "Write {l} code that {t}. Add comments.", "Show me a {l} program that {t}, with an example run.",
            "I need a {l} function that {t}. Keep it simple and readable.",
            "Write a {l} function that {t}. Include a docstring and two examples.",
        ]).format(l=lang, t=task), CODE_FOLLOWUPS
    if k < 0.47:
        words = [w for w in re.sub(r"[^a-z ]", "", task.lower()).split() if w not in STOP_WORDS]
        name = "_".join(words[:3])
        return (f"Complete this Python function:\n\ndef {name}(data):\n    \"\"\"A function that {task}.\"\"\"\n",
                CODE_FOLLOWUPS)
    if k < 0.63:
        l, code = rng.choice(SNIPPETS)
        fence = {"C++": "cpp", "C#": "csharp"}.get(l, l.lower())
        other = rng.choice([x for x in ("Python", "JavaScript", "Go", "Java", "Rust") if x != l])
        return rng.choice(SNIPPET_ASKS).format(l=l, other=other) + f"\n\n```{fence}\n{code}\n```", CODE_FOLLOWUPS
    if k < 0.71:
        schema, questions = rng.choice(SCHEMAS)
        return f"Given the tables {schema}, write a SQL query that returns {rng.choice(questions)}.", CODE_FOLLOWUPS
    if k < 0.75:
        return f"Write a regular expression that matches {rng.choice(REGEXES)}, and explain each part.", CODE_FOLLOWUPS
    if k < 0.80:
        return rng.choice(["How do I {t} from the Linux command line?", "Give me a shell command to {t}.",
                           "Write a bash one-liner to {t} and explain it."]).format(t=rng.choice(SHELL_TASKS)), \
            CODE_EXPLAIN_FOLLOWUPS
    if k < 0.88:
        a, b = rng.choice(CONCEPT_PAIRS)
        return rng.choice(["What is the difference between {a} and {b}?", "When should I use {a} rather than {b}?",
                           "Compare {a} and {b}, with a short example of each."]).format(a=a, b=b), \
            CODE_EXPLAIN_FOLLOWUPS
    if k < 0.96:
        return rng.choice(["What is {c}? Give a short code example.", "Explain {c} to a beginner programmer.",
                           "Explain {c} with an example in {l}."]).format(c=rng.choice(CODE_CONCEPTS), l=lang), \
            CODE_EXPLAIN_FOLLOWUPS
    return rng.choice(["How would you design {s}? Describe the main components.",
                       "Sketch the data model and API for {s}."]).format(s=rng.choice(SYSTEMS)), CODE_EXPLAIN_FOLLOWUPS


# ---------------------------------------------------------------------------------------------------
# Extraction and summarisation of a given text.

AUSTEN_TASKS = [
    "Summarize this passage from {novel} in {n} sentences:\n\n{x}",
    "Summarize the following passage in plain modern English:\n\n{x}",
    "List every character who is named in this passage and say what we learn about each of them.\n\n{x}",
    "Rewrite this passage from {novel} in simple modern English, keeping its meaning:\n\n{x}",
    "What is the tone of this passage? Quote words that support your answer.\n\n{x}",
    "Give three bullet points with the key points of this passage:\n\n{x}",
    "Write a one-line headline that captures this passage:\n\n{x}",
    "Read this passage from {novel}:\n\n{x}\n\nWhat does it reveal about {name}?",
    "Extract the people, places and events mentioned in this passage as a JSON object with the keys "
    "\"people\", \"places\" and \"events\":\n\n{x}",
    "In one sentence, what is the main point of this passage?\n\n{x}",
    "Explain any old-fashioned words or phrases in this passage:\n\n{x}",
    "Summarize this passage for a twelve-year-old:\n\n{x}",
    "{x}\n\nWhat is happening in this passage, and how do the characters feel about it?",
    "Find an example of irony or gentle humour in this passage and explain it.\n\n{x}",
    "Here is a passage from {novel}:\n\n{x}\n\nTurn it into a short modern text-message conversation.",
    "Pick out the three most important sentences in this passage and explain your choice.\n\n{x}",
]
COMPANIES = items("""Northwind Tools; Bluefern Labs; Harbour & Pine; Quillstone Books; Orbita Energy; Maple Row
Bakery; Kestrel Logistics; Brightpath Learning; Sunny Acres Farm; Copperleaf Design; Lumen Health; Tidewater
Cycles""")
TOWNS = items("""Ashbury; Millbrook; Fenwick; Larkhill; Stonebridge; Redcliff; Elmstead; Harrowgate; Westmoor;
Brackenfield""")
MONTHS = items("""January; February; March; April; May; June; July; August; September; October; November; December""")
WEEKDAYS = items("""Monday; Tuesday; Wednesday; Thursday; Friday""")
PROJECT_THINGS = items("""budget draft; website redesign; customer survey; hiring plan; quarterly report; supplier
contract; training schedule; product launch checklist; safety review; marketing brochure""")
METRICS = items("""website traffic; monthly sales; customer complaints; delivery times; sign-ups; returns; support
tickets; average basket size""")
REQUIREMENTS = items("""two years of relevant experience; a driving licence; good written English; experience with
spreadsheets; a degree in a related field; the ability to lift 20 kg; weekend availability; knowledge of Python;
experience managing a small team; a friendly attitude towards customers; a first-aid certificate; attention to
detail""")
BENEFITS = items("""25 days of paid holiday; a yearly training budget; flexible hours; a pension plan; free lunch on
Fridays; a cycle-to-work scheme; private health insurance; the option to work from home two days a week""")
POSITIVES = items("""The battery lasts far longer than I expected.; Setup took less than five minutes.; It looks even
better than in the photos.; Customer service answered my question within an hour.; It does exactly what the
description promised.; The
instructions were clear.; It feels solid and well made.; Delivery was a day early.""")
NEGATIVES = items("""The charging cable is far too short.; It started making a rattling noise after two weeks.; The
app keeps logging me out.; It is heavier than the description says.; One of the buttons sticks.; The colour is
darker than advertised.; It gets warm after an hour of use.; The packaging was damaged.""")
ITEMS_SHOP = [("wireless mouse", 19.99), ("USB-C cable", 7.5), ("notebook", 3.2), ("desk lamp", 24.0),
              ("coffee beans 1 kg", 16.9), ("water bottle", 12.5), ("phone case", 9.99), ("backpack", 45.0),
              ("pack of pens", 4.75), ("headphones", 59.0), ("yoga mat", 22.3), ("tea sampler", 14.0)]
NEWS_EVENTS = [
    "the council voted {a} to {b} to reopen the old railway bridge to cyclists",
    "a local bakery won a regional prize for its rye bread",
    "flooding closed {a} roads after {b} mm of rain fell overnight",
    "the library reported a record {a} visitors during its summer reading programme",
    "a new bus route will connect the town centre with the hospital from next month",
    "volunteers planted {a} trees along the river in a single weekend",
    "the secondary school's robotics team reached the national final",
    "the town's oldest cinema will close after {a} years",
]
EVENT_KINDS = items("""a charity quiz night; a beginners' photography workshop; a farmers' market; a jazz evening; a
repair café; a chess tournament; a career fair; a poetry reading; a children's science day; a 5 km fun run""")


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1, 28)} {rng.choice(MONTHS)}"


def _document(rng: random.Random) -> tuple[str, str, list[str]]:
    """(kind, text, tasks) of a short invented document."""
    kind = rng.randrange(8)
    n = rng.sample(NAMES, 4)
    if kind == 0:
        text = (f"Meeting notes, {rng.choice(WEEKDAYS)} {_date(rng)}. Present: {n[0]}, {n[1]}, {n[2]} and {n[3]}. "
                f"{n[0]} will finish the {rng.choice(PROJECT_THINGS)} by {rng.choice(WEEKDAYS)}. {n[1]} reported that "
                f"{rng.choice(METRICS)} went {rng.choice(['up', 'down'])} by {rng.randint(3, 40)}% since last month. "
                f"We agreed to {rng.choice(['postpone the launch by two weeks', 'hire one more person', 'move the team meeting to mornings', 'ask customers for feedback', 'cut the printing budget'])}. "
                f"{n[2]} needs to contact {rng.choice(COMPANIES)} before the end of the month. {n[3]} will book a room "
                f"for the next meeting on {_date(rng)}.")
        tasks = ["List the action items from these meeting notes as a table with owner and deadline.",
                 "Summarize these meeting notes in two sentences.",
                 "Who is responsible for what? Answer as a bulleted list.",
                 "Write a short follow-up email to the team based on these notes."]
    elif kind == 1:
        n_neg = rng.randint(0, 3)
        pos, neg = rng.sample(POSITIVES, rng.randint(max(1, 3 - n_neg), 3)), rng.sample(NEGATIVES, n_neg)
        body = pos + neg
        rng.shuffle(body)
        product = re.sub(r"^(a|an) ", "", rng.choice([p for p in PRODUCTS if not re.search("app|podcast|box", p)])
                         .split(" that ")[0])
        text = (f"I bought the {product} {rng.randint(2, 10)} weeks ago. "
                + " ".join(body) + f" Overall I would give it {rng.randint(1, 5)} out of 5.")
        tasks = ["Classify the sentiment of this review as positive, negative or mixed, and explain why.",
                 "List the pros and cons mentioned in this review.",
                 "Extract the product, the rating and each complaint from this review as JSON.",
                 "Write a polite reply from the company to this review."]
    elif kind == 2:
        chosen = rng.sample(ITEMS_SHOP, rng.randint(2, 5))
        lines = [f"{rng.randint(1, 3)} x {name} at {price:.2f}" for name, price in chosen]
        text = (f"Order {rng.randint(10000, 99999)} from {rng.choice(COMPANIES)}, placed on {_date(rng)}. Items: "
                + "; ".join(lines) + f". Shipping: {rng.choice(['free', '4.99', '6.50'])}. Delivery to {n[0]}, "
                f"{rng.randint(1, 200)} {rng.choice(['High Street', 'Mill Lane', 'Station Road', 'Park Avenue'])}, "
                f"{rng.choice(TOWNS)}.")
        tasks = ["Extract the items, quantities and prices from this order as JSON, and compute the total.",
                 "Turn this order into a table and add a total row.",
                 "What is the total cost of this order including shipping? Show the calculation.",
                 "Write a short order-confirmation email to the customer based on this."]
    elif kind == 3:
        low = rng.randint(24, 60)
        text = (f"{rng.choice(COMPANIES)} is hiring {a_(rng.choice(JOBS))} in {rng.choice(PLACES)}. Salary: {low},000 to "
                f"{low + rng.randint(4, 15)},000 a year. You will need "
                + ", ".join(rng.sample(REQUIREMENTS, 3)) + ". We offer " + " and ".join(rng.sample(BENEFITS, 2))
                + f". Apply by {_date(rng)} with a CV and a short cover letter.")
        tasks = ["Extract the job title, location, salary range, requirements and deadline from this posting as JSON.",
                 "Summarize this job advert in one sentence.",
                 "List the requirements and benefits in this job posting as two bulleted lists.",
                 "Based on this job advert, what questions might come up in the interview?"]
    elif kind == 4:
        text = (f"Join us for {rng.choice(EVENT_KINDS)} on {rng.choice(WEEKDAYS)} {_date(rng)} from "
                f"{rng.randint(9, 18)}:00 to {rng.randint(19, 22)}:00 at the {rng.choice(TOWNS)} community hall. "
                f"Tickets cost {rng.choice(['nothing', '5 pounds', '8 pounds', '12 pounds'])}, and children under "
                f"{rng.randint(5, 12)} come free. Contact {n[0]} on 0{rng.randint(1000000000, 1999999999)} to "
                "volunteer. Please bring your own cup.")
        tasks = ["Extract the event name, date, time, place, price and contact from this announcement as JSON.",
                 "Turn this announcement into a short social media post.",
                 "What do I need to know if I want to attend? Answer in three bullet points."]
    elif kind == 5:
        event = rng.choice(NEWS_EVENTS).format(a=rng.randint(4, 400), b=rng.randint(2, 90))
        text = (f"{rng.choice(TOWNS)}, {_date(rng)}: On {rng.choice(WEEKDAYS)}, {event}. \"This is a big day for "
                f"everyone here,\" said {n[0]} {rng.choice(['Hale', 'Okafor', 'Lindqvist', 'Moreau', 'Tanaka'])}, "
                f"who {rng.choice(['chairs the residents association', 'runs the local newspaper', 'has lived in the town for forty years'])}. "
                f"Not everyone agrees: {n[1]}, a local shop owner, worries about "
                f"{rng.choice(['parking', 'the cost', 'noise', 'what happens in winter'])}. A public meeting is planned "
                f"for {_date(rng)}.")
        tasks = ["Summarize this news item in one sentence.", "Extract every name, date and number from this text.",
                 "Who is quoted in this article, and what is each person's view?",
                 "Write a headline and a two-sentence summary for this story."]
    elif kind == 6:
        text = (f"Hi {n[0]}, thanks for yesterday. A few things: could you send me the "
                f"{rng.choice(PROJECT_THINGS)} by {rng.choice(WEEKDAYS)}? Also, {n[1]} asked whether we can move the "
                f"workshop to {_date(rng)}; I think that works, but please check with {n[2]}. Finally, the invoice "
                f"from {rng.choice(COMPANIES)} for {rng.randint(200, 9000)} dollars is still unpaid. Best, {n[3]}")
        tasks = ["List every request in this email and who should act on it.",
                 "Summarize this email in one sentence.", "Write a reply to this email that answers each point.",
                 "Extract the names, dates and amounts mentioned in this email."]
    else:
        cups = rng.randint(1, 4)
        text = (f"For this {rng.choice(['lentil soup', 'vegetable curry', 'banana bread', 'tomato pasta', 'pancake batter'])} "
                f"you need {rng.randint(2, 4)} onions, {cups} cup{'s' if cups > 1 else ''} of "
                f"{rng.choice(['red lentils', 'flour', 'rice', 'oats'])}, {rng.randint(1, 3)} cloves of garlic, a "
                f"{rng.choice(['pinch', 'teaspoon', 'tablespoon'])} of salt and {rng.randint(300, 900)} ml of "
                f"{rng.choice(['water', 'stock', 'milk'])}. Chop the onions and fry them for {rng.randint(5, 12)} "
                f"minutes, add the rest and simmer for {rng.randint(15, 45)} minutes, stirring now and then. "
                f"Serves {rng.randint(2, 6)}.")
        tasks = ["Extract the ingredients with their quantities as a bulleted list.",
                 "Rewrite this recipe as numbered steps.", "Turn this recipe into JSON with ingredients and steps.",
                 "How long does this recipe take in total? Explain."]
    return str(kind), text, tasks


EXTRACT_FOLLOWUPS = items("""Now make it shorter.; Give the answer as a table.; Which sentence of the text supports
that most strongly?; Explain it to a child.; Now give it as JSON.; What important detail did you leave out?;
Rewrite your answer in simple English for a language learner.; Are you sure that is all? Check the text again.""")


class Extraction:
    def __init__(self, passages: list[tuple[str, str]]):
        self.passages, self.next = passages, 0

    def __call__(self, rng: random.Random):
        if rng.random() < 0.55 and self.passages:
            novel, text = self.passages[self.next % len(self.passages)]
            self.next += 1
            names = [nm for nm in AUSTEN_NAMES if re.search(rf"\b{re.escape(nm)}\b", text)]
            tasks = [t for t in AUSTEN_TASKS if names or "{name}" not in t]
            task = rng.choice(tasks)
            return task.format(novel=novel, n=rng.choice([1, 2, 3]), x=text,
                               name=rng.choice(names) if names else ""), EXTRACT_FOLLOWUPS
        _, text, tasks = _document(rng)
        task = rng.choice(tasks + ["Summarize this text in one sentence.",
                                   "What are the key facts in this text? Answer as bullet points."])
        if rng.random() < 0.5:
            return f"{task}\n\n{text}", EXTRACT_FOLLOWUPS
        return f"{text}\n\n{task}", EXTRACT_FOLLOWUPS


# ---------------------------------------------------------------------------------------------------
# STEM.

STEM_TOPICS = items("""photosynthesis; cellular respiration; DNA replication; natural selection; the immune system;
vaccines; antibiotic resistance; the nervous system; how muscles contract; the water cycle; the carbon cycle; plate
tectonics; earthquakes; volcanoes; how hurricanes form; the greenhouse effect; ocean currents; the phases of the
Moon; tides; eclipses; black holes; how stars form; the Big Bang; exoplanets; the speed of light; special
relativity; gravity; Newton's laws of motion; friction; energy conservation; electricity and circuits; magnetism;
electromagnetic waves; sound waves; how lenses work; radioactivity; nuclear fission; nuclear fusion; the periodic
table; chemical bonds; acids and bases; oxidation and reduction; catalysts; polymers; states of matter;
temperature and heat; entropy; semiconductors; transistors; how a computer stores data; how the internet routes
data; how GPS works; how batteries work; solar panels; wind turbines; how a refrigerator works; how an engine
works; how aeroplanes fly; bridges and the forces on them; how vaccines are tested; the human heart; blood types;
the digestive system; how the eye sees colour; how hearing works; sleep and the brain; memory; hormones; the
microbiome; viruses; bacteria; fungi; pollination; food chains; ecosystems; biodiversity; coral reefs; soil
formation; glaciers; weather fronts; rainbows; why the sky is blue; lightning; how telescopes work; the Doppler
effect; quantum entanglement; superconductivity; lasers; fibre optics; 3D printing; CRISPR gene editing; stem
cells; evolution of whales; the origin of life; climate models; carbon capture; desalination; water purification;
recycling plastics; the chemistry of cooking; fermentation; how soap works; the scientific method""")
STEM_PAIRS = [("mitosis", "meiosis"), ("weather", "climate"), ("viruses", "bacteria"), ("speed", "velocity"),
              ("mass", "weight"), ("nuclear fission", "nuclear fusion"), ("AC", "DC electricity"),
              ("an element", "a compound"), ("DNA", "RNA"), ("a comet", "an asteroid"), ("heat", "temperature"),
              ("accuracy", "precision"), ("a hypothesis", "a theory"), ("renewable", "non-renewable energy"),
              ("arteries", "veins"), ("innate", "adaptive immunity"), ("conduction", "convection"),
              ("a planet", "a dwarf planet"), ("series", "parallel circuits"), ("ionic", "covalent bonds")]
STEM_QUESTIONS = items("""Why do we have seasons?; Why does ice float on water?; Why do onions make people cry?; How do
birds know where to migrate?; Why does bread rise?; Why do metals feel colder than wood at the same temperature?;
How do noise-cancelling headphones work?; Why is the ocean salty?; What causes the northern lights?; How does a
microwave oven heat food?; Why do leaves change colour in autumn?; How do fish breathe underwater?; Why does a
spoon look bent in a glass of water?; What happens to the body during a fever?; Why can't humans digest grass?; How
do bees make honey?; Why do we yawn?; How do touchscreens sense a finger?; Why does the Moon always show the same
face to Earth?; What makes a substance acidic?; How does caffeine keep people awake?; Why do some materials conduct
electricity and others not?; Why is the sea blue but a glass of sea water clear?; How do plants know which way is
up?; How do vaccines teach the immune system?; Why do we get hiccups?; How does a fridge keep food cold?; Why do
cats purr?; How does a compass work?; What limits how tall trees can grow?""")
HYPOTHESES = items("""plants grow faster with music; salt water freezes at a lower temperature than fresh water; bread
goes mouldy faster in a warm room; heavier paper aeroplanes fly shorter distances; a dark shirt warms up faster in
the sun than a white one; seeds sprout faster after soaking; the shape of a boat changes how much weight it can
carry; people remember words better with pictures""")
STEM_CALCS = [
    lambda R: f"Calculate the kinetic energy of an object of {R(1, 2000)} kg moving at {R(1, 40)} m/s.",
    lambda R: f"A ball is dropped from {R(2, 100)} m. Ignoring air resistance, how long does it take to hit the ground?",
    lambda R: f"How much current flows through a resistor of {R(2, 500)} ohms connected to a battery of {R(1, 24)} V?",
    lambda R: f"How many moles are in {R(5, 500)} g of water?",
    lambda R: f"Light takes about 8 minutes to reach Earth from the Sun. How long would it take to travel {R(1, 50)} million km?",
    lambda R: f"What is the wavelength of a sound wave at {R(100, 5000)} Hz in air, where sound travels at 343 m/s?",
    lambda R: f"A kettle rated at {R(500, 3000)} W runs for {R(2, 6)} minutes. How much energy does it use in kWh?",
    lambda R: f"What pressure does a person of {R(40, 120)} kg exert when standing on feet with a total area of {R(200, 500)} square cm?",
    lambda R: f"A population of bacteria doubles every {R(15, 60)} minutes. Starting from {R(1, 100)}, how many are there after {R(2, 8)} hours?",
    lambda R: f"How much heat is needed to warm {R(1, 5)} kg of water from {R(5, 20)} to {R(60, 100)} degrees Celsius?",
]
STEM_FOLLOWUPS = items("""Now explain it to a child.; Give an example from everyday life.; What is a common
misconception about this?; Can you give a formula or a number to go with it?; Summarize that in three bullet
points.; What open questions do scientists still have about this?; How was this discovered?; Make me a three-question
quiz about it.""")


def stem(rng: random.Random):
    k = rng.random()
    t = rng.choice(STEM_TOPICS)
    if k < 0.45:
        return rng.choice([
            "Explain {t} to {a}.", "How does {t} work?", "What are the most important facts about {t}? Answer in {n} "
            "bullet points.", "What are common misconceptions about {t}?", "Describe how scientists came to "
            "understand {t}.", "What are real-world applications of {t}?", "Write a short quiz with answers about "
            "{t}.", "Explain {t} in one paragraph, then give an everyday analogy.", "Give me a clear explanation of "
            "{t}, as if for a school textbook.", "Explain {t} in simple terms.",
        ]).format(t=t, a=rng.choice(AUDIENCES), n=rng.choice([3, 4, 5, 6])) + CONSTRAINT, STEM_FOLLOWUPS
    if k < 0.60:
        a, b = rng.choice(STEM_PAIRS)
        return rng.choice(["What is the difference between {a} and {b}?", "Compare {a} and {b} in a table.",
                           "Explain how {a} and {b} differ, with an example of each."]).format(a=a, b=b), \
            STEM_FOLLOWUPS
    if k < 0.80:
        q = rng.choice(STEM_QUESTIONS)
        return q + rng.choice(["", "", " Explain simply.", " Give the scientific explanation.",
                               f" Answer for {rng.choice(AUDIENCES)}."]), STEM_FOLLOWUPS
    if k < 0.88:
        return (f"Design a simple experiment to test whether {rng.choice(HYPOTHESES)}. Include the variables and "
                "what you would measure."), STEM_FOLLOWUPS
    return rng.choice(STEM_CALCS)(rng.randint) + " Show the formula you use.", STEM_FOLLOWUPS


# ---------------------------------------------------------------------------------------------------
# Humanities.

HISTORY = items("""the fall of the Western Roman Empire; the invention of the printing press; the Black Death; the
Renaissance in Italy; the Reformation; the voyages of Zheng He; the Columbian exchange; the Scientific Revolution;
the Enlightenment; the American Revolution; the French Revolution; the Haitian Revolution; the Industrial
Revolution; the abolition of the slave trade; the unification of Germany; the Meiji Restoration; the scramble for
Africa; the First World War; the Russian Revolution; the Great Depression; the Second World War; the founding of the
United Nations; the partition of India; decolonisation in Africa; the Cold War; the space race; the civil rights
movement in the United States; the fall of the Berlin Wall; the end of apartheid; the Silk Road; the Mongol Empire;
ancient Athenian democracy; the building of the pyramids; the Maya civilisation; the Inca road system; the
Ottoman Empire; the Mughal Empire; the Viking age; the Magna Carta; the Hundred Years' War; the Tang dynasty; the
women's suffrage movement; the history of the printing of money; the invention of writing; the agricultural
revolution; the history of public libraries""")
PHILOSOPHY = items("""utilitarianism; Kant's categorical imperative; virtue ethics; existentialism; stoicism; the
problem of free will; the mind-body problem; the ship of Theseus; Plato's allegory of the cave; the social contract;
moral relativism; the trolley problem; Descartes' 'I think, therefore I am'; empiricism versus rationalism; the
problem of induction; the veil of ignorance; nihilism; the meaning of life in Camus; Confucian ethics; Buddhist
ideas of impermanence; the philosophy of language; what makes a good life; personal identity over time; the
ethics of eating meat""")
LITERATURE = items("""Homer's Odyssey; Shakespeare's Hamlet; Shakespeare's Macbeth; Don Quixote; Pride and Prejudice;
Frankenstein; Jane Eyre; Moby-Dick; Great Expectations; Crime and Punishment; Anna Karenina; Middlemarch; The
Tale of Genji; the Epic of Gilgamesh; One Thousand and One Nights; Dante's Inferno; The Canterbury Tales;
Wuthering Heights; The Picture of Dorian Gray; Dracula; Little Women; The Adventures of Huckleberry Finn; A Doll's
House; The Metamorphosis; Gulliver's Travels""")
MOVEMENTS = items("""Impressionism; Cubism; the Baroque; Romanticism; Surrealism; Art Nouveau; the Bauhaus; Gothic
architecture; Pop Art; Realism; Modernism in literature; the Harlem Renaissance; Minimalism; Expressionism; Dada;
ukiyo-e woodblock prints; Abstract Expressionism; Neoclassicism""")
SOCIAL = items("""supply and demand; inflation; opportunity cost; the tragedy of the commons; globalisation;
urbanisation; the separation of powers; federalism; human rights; the rule of law; freedom of speech; the welfare
state; universal basic income; minimum wage debates; the role of a central bank; free trade; the gig economy;
social mobility; nationalism; cultural relativism; language change; how children acquire language; the origins
of English; dialects and accents; the history of the alphabet; religion and society; the role of museums; the
ethics of journalism; propaganda; the history of jazz; the development of classical music; the role of myths""")
HUM_QUESTIONS = items("""Is it ever right to break a promise?; Can a machine be creative?; Should history be taught
through great individuals or ordinary lives?; Is happiness the goal of life?; What do we owe future generations?;
Is it possible to be truly objective?; Should art be judged separately from the artist?; Are people naturally
good?; Does technology make us more or less free?; Why do societies have rules?; What makes a translation good?;
Can war ever be just?; Is tradition a good reason to keep doing something?; Why do people tell stories?; Should
voting age be lowered to sixteen?; What makes a city a good place to live?; Is privacy a right or a privilege?;
Why do empires fall?""")
HUM_FOLLOWUPS = items("""What is a counter-argument?; Give a concrete example.; How does this still matter today?;
Summarize that in two sentences.; What would a critic of this view say?; Explain it as if to a high-school
student.; What should I read to learn more about this?; How would someone from a different culture see this?""")


def humanities(rng: random.Random):
    k = rng.random()
    if k < 0.30:
        h = rng.choice(HISTORY)
        return rng.choice([
            "Explain the causes and consequences of {h}.", "What was the significance of {h}?",
            "Write a short essay about {h}.", "Create a timeline of the key moments of {h}.",
            "Describe {h} for {a}.", "What are the most common myths about {h}?",
            "How did {h} change everyday life for ordinary people?", "Summarize {h} in {n} bullet points.",
        ]).format(h=h, a=rng.choice(AUDIENCES), n=rng.choice([3, 5, 7])) + CONSTRAINT, HUM_FOLLOWUPS
    if k < 0.48:
        p = rng.choice(PHILOSOPHY)
        return rng.choice(["Explain {p} with an example.", "What are the strongest objections to {p}?",
                           "Explain {p} to {a}.", "How would {p} apply to a decision about lying to a friend?",
                           "Give the main arguments for and against {p}."]).format(p=p, a=rng.choice(AUDIENCES)), \
            HUM_FOLLOWUPS
    if k < 0.62:
        w = rng.choice(LITERATURE)
        return rng.choice(["What are the main themes of {w}?", "Summarize the plot of {w} without spoilers.",
                           "Why is {w} still read today?", "Write a short essay on the main character of {w}.",
                           "Compare {w} with {w2}.", "Outline an essay about power in {w}."]).format(
            w=w, w2=rng.choice(LITERATURE)), HUM_FOLLOWUPS
    if k < 0.72:
        m = rng.choice(MOVEMENTS)
        return rng.choice(["What was {m}, and how did it change art?", "Describe the main features of {m}.",
                           "Compare {m} with {m2}.", "Explain {m} to someone visiting a museum for the first time."]
                          ).format(m=m, m2=rng.choice(MOVEMENTS)), HUM_FOLLOWUPS
    if k < 0.86:
        s = rng.choice(SOCIAL)
        return rng.choice(["Explain {s} with an everyday example.", "What do people misunderstand about {s}?",
                           "Explain {s} to {a}.", "Why does {s} matter? Answer in {n} paragraphs.",
                           "What are the main debates about {s}?"]).format(
            s=s, a=rng.choice(AUDIENCES), n=rng.choice([2, 3])), HUM_FOLLOWUPS
    q = rng.choice(HUM_QUESTIONS)
    return rng.choice(["{q}", "Discuss: {q}", "Outline an essay that answers the question: {q}",
                       "{q} Give arguments on both sides.", "{q} Answer in about {n} words."]).format(
        q=q, n=rng.choice([150, 200, 300])), HUM_FOLLOWUPS


# ---------------------------------------------------------------------------------------------------


def find_austen(arg: str | None) -> Path:
    for d in ([arg] if arg else list(AUSTEN_DIRS)):
        p = Path(d)
        if (p / "data").is_dir():
            return p
    raise SystemExit("janeaustenr not found: apt-get install r-cran-janeaustenr, or extract the package with "
                     "`apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb DIR` and pass "
                     "--austen DIR/usr/lib/R/site-library/janeaustenr")


def build(passages: list[tuple[str, str]], per_category: int, multi_turn: float, seed: int) -> list[dict]:
    makers = {"writing": writing, "roleplay": roleplay, "reasoning": reasoning, "math": math, "coding": coding,
              "extraction": Extraction(passages), "stem": stem, "humanities": humanities}
    seen: set[str] = set()
    rows = []
    for cat in CATEGORIES:
        rng = random.Random(f"{seed}:{cat}")
        made = []
        for _ in range(per_category * 100):
            if len(made) == per_category:
                break
            prompt, followups = makers[cat](rng)
            prompt = vary(rng, add_constraint(rng, prompt))
            key = " ".join(prompt.split()).lower()
            if key not in seen:
                seen.add(key)
                made.append((prompt, followups))
        if len(made) < per_category:
            raise SystemExit(f"{cat}: only {len(made)} distinct prompts; add topics or templates")
        multi = set(rng.sample(range(per_category), round(multi_turn * per_category)))
        for i, (prompt, followups) in enumerate(made):
            if i in multi:
                rows.append({"category": cat, "turns": [prompt, rng.choice(followups)]})
            else:
                rows.append({"category": cat, "prompt": prompt})
    random.Random(f"{seed}:order").shuffle(rows)  # any prefix of the file covers every category
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--austen", help="the janeaustenr package directory (default: where Debian installs it)")
    ap.add_argument("--per-category", type=int, default=820)
    ap.add_argument("--multi-turn", type=float, default=0.25, help="fraction of two-turn conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).with_name("campaign-prompts.jsonl")))
    ap.add_argument("--exclude", action="append", default=[], metavar="JSONL",
                    help="drop rows whose first request already appears in this file (repeatable), so a "
                         "second file made with another seed adds only new requests")
    args = ap.parse_args(argv)

    passages = austen_passages(find_austen(args.austen), random.Random(f"{args.seed}:austen"), 2 * args.per_category)
    rows = build(passages, args.per_category, args.multi_turn, args.seed)
    first = lambda r: (r.get("turns") or [r["prompt"]])[0]  # noqa: E731
    seen = set()
    for path in args.exclude:
        with open(path) as f:
            seen.update(first(json.loads(line)) for line in f if line.strip())
    kept = []
    for r in rows:  # also drops repeats within this file
        if first(r) not in seen:
            seen.add(first(r))
            kept.append(r)
    if len(kept) < len(rows):
        print(f"dropped {len(rows) - len(kept)} rows whose first request was already seen")
    rows = kept
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's eagle_jax
    try:
        from eagle_jax.train.data import check_not_eval
    except ImportError:
        print("note: eagle_jax is not importable; evaluation prompts are checked when the pipeline reads the file")
    else:
        check_not_eval([r.get("turns") or r["prompt"] for r in rows], source="campaign prompts")
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    counts = collections.Counter(r["category"] for r in rows)
    multi = collections.Counter(r["category"] for r in rows if "turns" in r)
    print(f"{len(rows)} prompts ({sum(multi.values())} two-turn) -> {args.out}")
    for cat in CATEGORIES:
        print(f"  {cat:<11} {counts[cat]:5d}  ({multi[cat]} two-turn)")


if __name__ == "__main__":
    main()

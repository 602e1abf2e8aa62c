"""The long-context suite as lm-eval tasks, generated from the shipped public-domain text: no download.

Kinds, after RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", 2024), whose templates they follow, with Genesis (KJV, `data/genesis_kjv.txt`) as the
haystack instead of essays:

    niah_single      one needle "One of the special magic numbers for {key} is: {value}." (a 7-digit
                     value) at a depth of the text; asked for the value
    niah_multikey    four needles of different keys; asked for one (three distractors)
    niah_multivalue  four needles of one key; asked for all four values
    vt               variable tracking: VAR A = 12345, VAR B = VAR A, ... (four hops) among filler
                     sentences; asked for every variable that holds the value
    cwe              common-word extraction: a numbered list of words, ten of them far more frequent
                     (6 against 1 below 4K tokens, 30 against 3 from 4K, as RULER); asked for the ten
    passkey          `kitty_core.passkey`'s prompt (a 5-digit key in repeated filler); scored by
                     exact match of the first number, the others by recall (`lm_eval_metrics`)

A length L counts tokens of the model's tokenizer: every prompt (the input, a space, the answer
prefix) holds at most L - max_gen_toks tokens, so prompt and generation fit L. A chat template
(`--apply_chat_template`) adds its own tokens. Samples are drawn from `random.Random` seeded with
(seed, kind, length): the same settings and tokenizer give the same files, and adding a length or
a kind does not change the others.

Written into one folder (`write_suite`; `python -m kitty_core.lm_eval_tasks --out DIR`):
    kitty_<kind>_<L>.jsonl  one sample a line: input, gen_prefix, outputs (the expected answers),
                            length, tokens (the prompt's), index, and the needles' depth where there is one
    kitty_<kind>_<L>.yaml   the lm-eval task reading that file (by absolute path), tagged
                            kitty_long, kitty_long_<L> and kitty_<kind>
    kitty_metrics.py        a copy of `lm_eval_metrics`, which the tasks score with
    suite.json              what the files were made from; a folder whose suite.json matches is reused

    lm_eval --model hf --model_args pretrained=... --include_path DIR --tasks kitty_long_4096
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
import shutil
import string
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from .cli import count, parser, progress_bar, writable, write_text
from .texts import shipped_path

HAYSTACK = shipped_path()  # Genesis (KJV), public domain: kitty_core.texts says where it is looked up
KINDS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe", "passkey")
TITLES = {"niah_single": "needle: one key", "niah_multikey": "needle: one of many keys",
          "niah_multivalue": "needle: every value of a key", "vt": "variable tracking", "cwe": "common words",
          "passkey": "passkey"}  # each kind in words, as the lab names it
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
VERSION = 1  # of the generator: part of suite.json, so that a changed generator writes new files

# tokens each kind may generate (RULER gives NIAH 128, VT 30, CWE 120; an answer here is far shorter
# than NIAH's 128, so 32 suffices and saves decoding time)
MAX_GEN = {"niah_single": 32, "niah_multikey": 32, "niah_multivalue": 64, "vt": 32, "cwe": 120, "passkey": 16}
METRIC = {kind: "recall" for kind in KINDS} | {"passkey": "exact_match"}

NIAH_TEMPLATE = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the numbers afterwards.\n{context}\nWhat are all the special magic "
                 "numbers for {key} mentioned in the provided text?")
NIAH_PREFIX = "The special magic numbers for {key} mentioned in the provided text are"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               "{context}\nQuestion: Find all variables that are assigned the value {value} in the text above.")
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {value}, they are:")
VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
                "words in the above list?")
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"

# keys of the needles: adjective-noun pairs, none of which occurs in Genesis
ADJECTIVES = ("amber", "brisk", "cobalt", "dusty", "electric", "fuzzy", "glossy", "hollow", "icy", "jagged",
              "lively", "magnetic", "nimble", "orange", "plastic", "quirky", "rusty", "silent", "tidy", "velvet",
              "wobbly", "zesty", "breezy", "crimson", "digital", "frosty", "gentle", "humble", "polar", "sandy")
NOUNS = ("anchor", "bicycle", "cactus", "dolphin", "engine", "falcon", "glacier", "harbor", "igloo", "jacket",
         "kettle", "lantern", "meadow", "notebook", "octopus", "pencil", "quartz", "rocket", "saddle", "teapot",
         "umbrella", "violin", "walrus", "yogurt", "zipper", "balloon", "compass", "drum", "helmet", "tractor")


def _genesis() -> str:
    lines = HAYSTACK.read_text().splitlines()[3:]  # past the title and the edition line
    return "\n".join(line for line in lines if line.strip() and not line.startswith("Chapter "))


@lru_cache(maxsize=1)
def haystack_sentences() -> tuple[str, ...]:
    """Genesis, sentence by sentence (split after . ; : ? !)."""
    return tuple(s for s in re.split(r"(?<=[.;:?!])\s+", _genesis()) if s)


@lru_cache(maxsize=1)
def word_pool() -> tuple[str, ...]:
    """Distinct lower-case words of four letters or more in Genesis, in a fixed order: the CWE lists."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,}\b", _genesis()))))


class _Counter:
    """Token counts of prompts as the model sees them (special tokens included), and of filler units."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> int:
        return len(self.tokenizer(text).input_ids)

    def units(self, texts) -> list[int]:
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False).input_ids]


def _fit(count: _Counter, make: Callable[[int], tuple[str, str]], unit_tokens: list[int], target: int,
         what: str) -> tuple[str, str, int]:
    """The most filler units n (of len(unit_tokens)) whose prompt make(n) -> (input, gen_prefix) holds at
    most `target` tokens: estimated from the units' own counts, then checked with the tokenizer."""
    fixed = count(_joined(*make(0)))
    if fixed >= target:
        raise ValueError(f"a {what} prompt needs more than {target} tokens before any filler: use a longer length")
    n, total = 0, fixed
    while n < len(unit_tokens) and total + unit_tokens[n] <= target:
        total += unit_tokens[n]
        n += 1
    avg = max(1, sum(unit_tokens[:max(n, 1)]) // max(n, 1))
    while True:
        tokens = count(_joined(*make(n)))
        if tokens <= target or n == 0:
            return (*make(n), tokens)
        n = max(0, n - max(1, math.ceil((tokens - target) / avg)))


def _joined(text: str, gen_prefix: str) -> str:
    """The prompt lm-eval builds from a sample without a chat template: input, a space, the answer prefix."""
    return f"{text} {gen_prefix}" if gen_prefix else text


def _cycle(items, start: int, n: int) -> list:
    return [items[(start + i) % len(items)] for i in range(n)]


def _insert(filler: list[str], items: list[str], depths: list[float]) -> list[str]:
    """`items` placed among the filler at the given depths (0: before the first unit, 1: after the last),
    in the order given for equal depths."""
    out = list(filler)
    for item, d in sorted(zip(items, depths), key=lambda p: p[1], reverse=True):
        out.insert(round(d * len(filler)), item)
    return out


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = [f"{a}-{b}" for a in ADJECTIVES for b in NOUNS]
    return rng.sample(pairs, n)


def _niah(count, rng, target, kind):
    sentences = haystack_sentences()
    multikey, multivalue = kind == "niah_multikey", kind == "niah_multivalue"
    keys = _keys(rng, 4 if multikey else 1)
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), 4 if (multikey or multivalue) else 1)]
    needle_keys = keys if multikey else keys * len(values)
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(needle_keys, values)]
    depths = sorted(rng.random() for _ in needles)
    start = rng.randrange(len(sentences))
    filler = _cycle(sentences, start, len(sentences) * (1 + target // 40_000))  # enough for any length
    query = keys[0]
    outputs = values if multivalue else values[:1]

    def make(n):
        context = " ".join(_insert(filler[:n], needles, depths))
        return NIAH_TEMPLATE.format(context=context, key=query), NIAH_PREFIX.format(key=query)

    text, prefix, tokens = _fit(count, make, count.units(filler), target, kind)
    return {"input": text, "gen_prefix": prefix, "outputs": outputs, "tokens": tokens,
            "depth": depths[needle_keys.index(query)] if not multivalue else depths}


def _vt(count, rng, target, hops: int = 4):
    names = set()
    while len(names) < hops + 1:
        names.add("".join(rng.choices(string.ascii_uppercase, k=5)))
    names = rng.sample(sorted(names), hops + 1)
    value = str(rng.randrange(10000, 100000))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    depths = sorted(rng.random() for _ in chain)
    per_unit = count.units([VT_NOISE])[0]
    n_max = target // max(per_unit, 1) + 1

    def make(n):
        context = "\n".join(_insert([VT_NOISE] * n, chain, depths))
        return VT_TEMPLATE.format(context=context, value=value), VT_PREFIX.format(n=hops + 1, value=value)

    text, prefix, tokens = _fit(count, make, [per_unit + 1] * n_max, target, "vt")
    return {"input": text, "gen_prefix": prefix, "outputs": names, "tokens": tokens, "depth": depths[0]}


def _cwe(count, rng, target, common: int = 10):
    pool = list(word_pool())
    rng.shuffle(pool)
    common_words, uncommon = pool[:common], pool[common:]
    freq_cw, freq_ucw = (6, 1) if target < 4096 else (30, 3)
    seed = rng.randrange(1 << 30)

    def make_for(fu):
        def make(n):
            words = common_words * freq_cw + uncommon[:n] * fu
            random.Random(seed + n).shuffle(words)
            return CWE_TEMPLATE.format(context=" ".join(f"{i + 1}. {w}" for i, w in enumerate(words))), CWE_PREFIX
        return make

    # a length the whole pool fits at these counts: the uncommon words repeat more, always less than the ten
    while freq_ucw + 1 < freq_cw and count(_joined(*make_for(freq_ucw)(len(uncommon)))) < target:
        freq_ucw += 1
    sample = " ".join(f"{i + 1}. {w}" for i, w in enumerate(uncommon[:200]))
    entry = count.units([sample])[0] / 200
    text, prefix, tokens = _fit(count, make_for(freq_ucw), [math.ceil(entry * freq_ucw)] * len(uncommon), target,
                                "cwe")
    return {"input": text, "gen_prefix": prefix, "outputs": common_words, "tokens": tokens}


def _passkey(count, rng, target, depth: float):
    from .passkey import QUESTION, passkey_prompt

    key = str(rng.randrange(10000, 100000))
    head, _, prefix = QUESTION.rpartition("? ")  # the answer prefix of the passkey prompt: "The pass key is"
    aim = target
    for _ in range(8):
        prompt = passkey_prompt(count.tokenizer, aim, depth, key)
        tokens = count(prompt)
        if tokens <= target:
            return {"input": prompt[: -len(prefix)].rstrip(), "gen_prefix": prefix, "outputs": [key],
                    "tokens": tokens, "depth": depth}
        aim -= tokens - target
    raise ValueError(f"could not fit a passkey prompt in {target} tokens")


def generate(tokenizer, kind: str, length: int, samples: int, seed: int = 0) -> list[dict]:
    """`samples` samples of one kind at one length (see the module docstring for the fields)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose among {', '.join(KINDS)}")
    target = length - MAX_GEN[kind]
    rng = random.Random(f"{seed}/{kind}/{length}")
    count = _Counter(tokenizer)
    out = []
    for i in range(samples):
        if kind.startswith("niah"):
            doc = _niah(count, rng, target, kind)
        elif kind == "vt":
            doc = _vt(count, rng, target)
        elif kind == "cwe":
            doc = _cwe(count, rng, target)
        else:
            doc = _passkey(count, rng, target, depth=i / max(samples - 1, 1))
        out.append({"index": i, "length": length, **doc})
    return out


def task_name(kind: str, length: int) -> str:
    return f"kitty_{kind}_{length}"


def _task_yaml(kind: str, length: int, data: Path, seed: int) -> str:
    q = json.dumps  # a JSON string is a YAML double-quoted scalar
    metric = METRIC[kind]
    return "\n".join([
        f"task: {task_name(kind, length)}",
        f"tag: [kitty_long, kitty_long_{length}, kitty_{kind}]",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {q(str(data.resolve()))}",
        "test_split: test",
        "output_type: generate_until",
        'doc_to_text: "{{input}}"',
        "doc_to_target: \"{{outputs | join(', ')}}\"",
        'gen_prefix: "{{gen_prefix}}"',
        'target_delimiter: " "',
        "generation_kwargs:",
        "  until: []",
        f"  max_gen_toks: {MAX_GEN[kind]}",
        "  do_sample: false",
        f"process_results: !function kitty_metrics.{metric}",
        "metric_list:",
        f"  - metric: {metric}",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        f"  version: {VERSION}",
        f"  length: {length}",
        f"  seed: {seed}",
        "",
    ])


def tokenizer_id(tokenizer) -> str:
    """A short fingerprint of a tokenizer: its name, size and how it splits a fixed text."""
    probe = haystack_sentences()[0] + " 1234567 VAR QWERT = 12345. 17. lantern"
    ids = tokenizer(probe).input_ids
    text = f"{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}|{ids}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def default_dir(tokenizer) -> Path:
    from .models import cache_dir

    return cache_dir() / "lm_eval_tasks" / tokenizer_id(tokenizer)


def write_suite(tokenizer, out: Path | None = None, kinds=KINDS, lengths=DEFAULT_LENGTHS, samples: int = 50,
                seed: int = 0, progress=None) -> tuple[Path, list[str]]:
    """Write the suite's files for this tokenizer into `out` (default: under KITTY_CACHE_DIR, one folder
    per tokenizer); (the folder, the task names). A file already there from the same settings is kept."""
    kinds = list(kinds)
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown kind {k!r}; choose among {', '.join(KINDS)}")
    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] < 256:
        raise ValueError(f"lengths must be at least 256 tokens, got {lengths}")
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    out = Path(out) if out is not None else default_dir(tokenizer)
    writable(out, folder=True)
    shutil.copyfile(Path(__file__).with_name("lm_eval_metrics.py"), out / "kitty_metrics.py")
    manifest = out / "suite.json"
    old = json.loads(manifest.read_text()) if manifest.is_file() else {}
    made = old.get("tasks", {}) if old.get("tokenizer") == tokenizer_id(tokenizer) and old.get("version") == VERSION else {}
    names, jobs = [], [(k, n) for n in lengths for k in kinds]
    for i, (kind, length) in enumerate(jobs):
        name = task_name(kind, length)
        names.append(name)
        data = out / f"{name}.jsonl"
        want = {"samples": samples, "seed": seed}
        yaml = _task_yaml(kind, length, data, seed)  # always: it names the data by absolute path
        if (out / f"{name}.yaml").is_file() and (out / f"{name}.yaml").read_text() != yaml:
            write_text(out / f"{name}.yaml", yaml)
        if made.get(name) == want and data.is_file() and (out / f"{name}.yaml").is_file():
            continue
        if progress:
            progress(i, len(jobs), name)
        docs = generate(tokenizer, kind, length, samples, seed)
        write_text(data, "".join(json.dumps(d) + "\n" for d in docs))
        write_text(out / f"{name}.yaml", yaml)
        made[name] = want
        write_text(manifest, json.dumps({"version": VERSION, "tokenizer": tokenizer_id(tokenizer),
                                         "tokenizer_name": getattr(tokenizer, "name_or_path", ""),
                                         "tasks": made}, indent=1))
    return out, names


def load_tokenizer(name: str):
    """The tokenizer of a model name as `load_model` takes it (demo, a .gguf file, a directory, a hub id),
    without loading the weights."""
    from transformers import AutoTokenizer

    from .models import DEMO, ModelLoadError, _converted_gguf, demo_gguf_path

    if name.startswith("random:"):
        raise ModelLoadError(f"{name!r} has random weights and no tokenizer: pass a tokenizer (e.g. demo or a hub id)")
    source = str(_converted_gguf(demo_gguf_path())) if name == DEMO else (
        str(_converted_gguf(Path(name))) if name.lower().endswith(".gguf") else name)
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as err:  # noqa: BLE001  (no such id or directory, no network ...: all say why)
        raise ModelLoadError(f"could not load the tokenizer of {name!r}: {type(err).__name__}: "
                             f"{(str(err).splitlines() or [''])[0]}") from err


def main(argv=None) -> int:
    p = parser("kitty_core.lm_eval_tasks", __doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default="demo", help="the model's tokenizer: demo | hub id | local directory | file.gguf")
    p.add_argument("--out", type=Path, default=None, help="task folder (default: one per tokenizer under KITTY_CACHE_DIR)")
    p.add_argument("--kinds", default=",".join(KINDS), help="task kinds, comma-separated")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="tokens, prompt and generation")
    p.add_argument("--samples", type=count(1), default=50, help="per kind and length")
    p.add_argument("--seed", type=int, default=0, help="the samples' seed")
    a = p.parse_args(argv)
    from .models import ModelLoadError

    try:
        lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
        tok = load_tokenizer(a.tokenizer)
        with progress_bar("tasks", "task") as progress:
            out, names = write_suite(tok, a.out, [k.strip() for k in a.kinds.split(",") if k.strip()], lengths,
                                     a.samples, a.seed, progress=progress)
    except (ValueError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(names)} tasks in {out}\n  lm_eval ... --include_path {out} --tasks kitty_long")
    return 0


if __name__ == "__main__":
    sys.exit(main())

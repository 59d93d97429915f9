"""The RMT paper's algorithmic tasks (copy, reverse, associative retrieval, quadratic equations), generated from a seed.

One sample is one document: `prompt + SEP + answer`, where SEP (">") is the start-to-generate token. The loss mask is
1 on the answer characters only: the prompt and SEP are context, as in the paper ("we do not compute loss over the
input sequence before the start-to-generate token").

Vocabulary: documents are ASCII strings tokenized by the `bytes` tokenizer (ids = byte values, vocab 256, boundary
"\n"). A dedicated small vocabulary would save a few embedding rows but would need its own tokenizer kind; bytes keep
every task a plain byte corpus that `decode` prints readably. No task uses "\n" or ">" inside a prompt or answer.

Tasks (defaults follow the paper's appendix A):
    copy       prompt: `length` symbols from the alphabet; answer: the prompt `copies` times (paper: twice).
               "kqzb>kqzbkqzb"
    reverse    answer: the prompt reversed.  "kqzb>bzqk"
    retrieval  Ba et al. (2016): `pairs` key/value pairs (distinct keys of lowercase letters, one-digit values), then
               "??" and one of the keys; answer: its value.  "c9k8j3f1??k>8"
    quadratic  an equation with integer coefficients, alpha*(x-x1)(x-x2) expanded, x1, x2 uniform in [-100, 100] and
               alpha in +-[1, 10]; answer: the step-by-step solution with the discriminant, then the roots:
               "-4*x^2+392*x-2208=0>x^2-98*x+552=0;D=98^2-4*1*552=7396=86^2;x=(98-86)/2=6;x=(98+86)/2=92;6,92"
               A fraction `no_roots` (paper: 20%) has no real roots: "...;D=2^2-4*1*5=-16<0;none".
               The paper scores only the final answer; here the whole solution is the target (the model must
               generate it), and the roots are the text after the last ";". The paper pads each step to 30
               characters; we do not (the stream pads segments).

Every task also takes `predict_first` (default true): false makes the sample's first token an input only, as the
RMT authors' loader cuts a sample (`src[:-1]` -> `tgt[1:]`), so a sample of T tokens is T - 1 predictions and splits
into exactly the segments the paper's Figure 4 counts (copy 24 -> 48: 72 predictions). Retrieval's `query` is the
marker before the queried key ("??", Ba et al.; the RMT authors' generator has none: "").

The long-context tasks qa1, qa2, qa3 (BABILong-style: bAbI-like facts in WikiText background) and passkey are
data_pipeline/longctx.py's; their `length` is the sample's exact bytes, or its tokens when a task is prepared with a
backbone's tokenizer (data_pipeline/longctx_tokens.py, which also encodes the RMT tasks' prompt, SEP and answer).

Sizes: `length` (copy/reverse symbols, retrieval pairs) sets how many segments a sample spans. Splits are generated
from different seeds (seed, split), so train, valid and test differ; the same seed gives the same bytes (numpy's
PCG64 streams are stable for the pinned numpy).
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from . import longctx
from .format import SPLITS, DataError

# The RMT tasks, then the long-context ones (data_pipeline/longctx.py); appended, so the older tasks' seeds hold.
TASKS = ("copy", "reverse", "retrieval", "quadratic") + longctx.LONGCTX_TASKS
SEP = ">"  # start-to-generate token
QUERY = "??"  # retrieval: marks the queried key (Ba et al.)
NO_ROOTS = "none"

DEFAULT_DOCS = 10_000  # training samples; valid and test get a tenth each (the paper: 100k / 5k-10k / 10k-20k)
# Per task: (option -> default). `length` is the CLI's --task-length.
DEFAULTS = {
    "copy": {"length": 24, "copies": 2, "alphabet": string.ascii_lowercase},
    "reverse": {"length": 24, "alphabet": string.ascii_lowercase},
    "retrieval": {"length": 4, "query": QUERY},  # key/value pairs
    "quadratic": {"root_range": 100, "alpha_max": 10, "no_roots": 0.2},
    **{task: dict(options) for task, options in longctx.DEFAULTS.items()},
}
for _options in DEFAULTS.values():
    _options["predict_first"] = True  # false: the first token is an input only (the RMT authors' cut)
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


@dataclass(frozen=True)
class Sample:
    prompt: str
    answer: str

    @property
    def text(self) -> str:
        return self.prompt + SEP + self.answer


def resolve_options(task: str, options: dict | None = None, in_tokens: bool = False) -> dict:
    """The task's full option set (defaults filled in, values checked) plus `seed` and per-split `docs`.
    in_tokens: a long-context `length` counts a backbone tokenizer's tokens, not bytes (longctx_tokens.py)."""
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}: use one of {', '.join(TASKS)}")
    options = dict(options or {})
    resolved = dict(DEFAULTS[task])
    resolved["seed"] = int(options.pop("seed", 0) or 0)
    resolved["docs"] = _split_docs(options.pop("docs", None))
    for key, value in options.items():
        if value is None:
            continue
        if key not in resolved:
            hint = " (--task-length does not apply to quadratic)" if key == "length" else ""
            raise DataError(f"task {task!r} has no option {key!r}{hint}; it takes {', '.join(sorted(DEFAULTS[task]))}")
        resolved[key] = _typed(key, resolved[key], value)
    _check(task, resolved, in_tokens)
    return resolved


def _typed(key: str, default, value):
    """`value` (from YAML, Python or a --task-option string) as the option's type; booleans spelled out."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if str(value).lower() in TRUE + FALSE:
            return str(value).lower() in TRUE
        raise DataError(f"task option {key} is true or false, got {value!r}")
    try:
        return type(default)(value)
    except ValueError:
        raise DataError(f"task option {key} wants a {type(default).__name__}, got {value!r}") from None


def _split_docs(docs) -> dict:
    """`docs`: None, N (train N, valid and test N // 10), "N,V,T", or a {split: n} dict."""
    if docs is None:
        docs = DEFAULT_DOCS
    if isinstance(docs, dict):
        counts = {split: int(docs[split]) for split in SPLITS}
    elif isinstance(docs, str) and "," in docs:
        parts = docs.split(",")
        if len(parts) != len(SPLITS):
            raise DataError(f"--task-docs {docs!r}: give N or TRAIN,VALID,TEST")
        counts = dict(zip(SPLITS, (int(p) for p in parts)))
    else:
        n = int(docs)
        counts = {"train": n, "valid": max(1, n // 10), "test": max(1, n // 10)}
    if min(counts.values()) < 1:
        raise DataError(f"--task-docs must give every split at least one sample, got {counts}")
    return counts


def _check(task: str, o: dict, in_tokens: bool = False) -> None:
    if task in ("copy", "reverse", "retrieval") and o["length"] < 1:
        raise DataError(f"--task-length must be >= 1, got {o['length']}")
    if "alphabet" in o:
        bad = set(o["alphabet"]) - set(string.ascii_letters + string.digits)
        if len(set(o["alphabet"])) < 2 or bad:
            raise DataError(f"task alphabet must be at least two letters/digits, got {o['alphabet']!r}")
    if "query" in o and set(o["query"]) & set(string.ascii_letters + string.digits + SEP + "\n"):
        raise DataError(f"retrieval: query marker {o['query']!r} must not use letters, digits, {SEP!r} or a newline")
    if task == "copy" and o["copies"] < 1:
        raise DataError(f"copy: copies must be >= 1, got {o['copies']}")
    if task in longctx.LONGCTX_TASKS:
        longctx.check(task, o, in_tokens)
    if task == "quadratic":
        if o["root_range"] < 1 or o["alpha_max"] < 1 or not 0.0 <= o["no_roots"] <= 1.0:
            raise DataError(f"quadratic: need root_range >= 1, alpha_max >= 1, 0 <= no_roots <= 1; got {o}")


def split_rng(task: str, seed: int, split: str) -> np.random.Generator:
    """Independent, reproducible streams per (task, seed, split)."""
    return np.random.default_rng(np.random.SeedSequence([seed, SPLITS.index(split), TASKS.index(task)]))


def generate(task: str, split: str, options: dict | None = None) -> Iterator[Sample]:
    """The split's samples, in order, from resolved (or partial) options."""
    o = resolve_options(task, options)  # idempotent on resolved options
    rng = split_rng(task, o["seed"], split)
    if task in longctx.LONGCTX_TASKS:
        for _ in range(o["docs"][split]):
            yield Sample(*longctx.sample_text(task, split, rng, o))
        return
    make = {"copy": _copy, "reverse": _reverse, "retrieval": _retrieval, "quadratic": _quadratic}[task]
    for _ in range(o["docs"][split]):
        yield make(rng, o)


def task_documents(task: str, split: str, options: dict) -> Iterator[tuple[np.ndarray, np.ndarray, str]]:
    """(byte ids, loss mask, title) per sample, as `shards.write_split` takes them."""
    for i, sample in enumerate(generate(task, split, options)):
        tokens = np.frombuffer(sample.text.encode("ascii"), dtype=np.uint8).astype(np.int64)
        mask = np.zeros(len(tokens), dtype=np.uint8)
        mask[len(sample.prompt) + len(SEP):] = 1
        yield tokens, mask, f"{task}-{split}-{i}"


# ---------------------------------------------------------------- the tasks


def _symbols(rng: np.random.Generator, alphabet: str, n: int) -> str:
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), size=n))


def _copy(rng: np.random.Generator, o: dict) -> Sample:
    prompt = _symbols(rng, o["alphabet"], o["length"])
    return Sample(prompt, prompt * o["copies"])


def _reverse(rng: np.random.Generator, o: dict) -> Sample:
    prompt = _symbols(rng, o["alphabet"], o["length"])
    return Sample(prompt, prompt[::-1])


def _retrieval(rng: np.random.Generator, o: dict) -> Sample:
    pairs = o["length"]
    letters = string.ascii_lowercase
    key_len = 1
    while len(letters) ** key_len < pairs:  # the shortest keys that give `pairs` distinct ones
        key_len += 1
    chosen = rng.choice(len(letters) ** key_len, size=pairs, replace=False)  # distinct keys
    keys = ["".join(letters[(k // len(letters) ** p) % len(letters)] for p in range(key_len)) for k in chosen]
    values = rng.integers(0, 10, size=pairs)
    query = int(rng.integers(0, pairs))
    prompt = "".join(f"{k}{v}" for k, v in zip(keys, values)) + o["query"] + keys[query]
    return Sample(prompt, str(values[query]))


def polynomial(a: int, b: int, c: int) -> str:
    """a*x^2+b*x+c=0 written the paper's way ("-4*x^2+392*x-2208=0", "x^2-98*x+552=0")."""
    out = {1: "", -1: "-"}.get(a, f"{a}*") + "x^2"
    if b:
        out += ("+" if b > 0 else "-") + ("" if abs(b) == 1 else f"{abs(b)}*") + "x"
    if c:
        out += f"{c:+d}"
    return out + "=0"


def quadratic_solution(p: int, q: int) -> tuple[str, str]:
    """(solution steps, answer) for x^2+p*x+q=0."""
    d = p * p - 4 * q
    q_text = str(q) if q >= 0 else f"({q})"
    steps = [polynomial(1, p, q), f"D={abs(p)}^2-4*1*{q_text}={d}"]
    if d < 0:
        steps[-1] += "<0"
        return ";".join(steps), NO_ROOTS
    s = math.isqrt(d)
    steps[-1] += f"={s}^2"
    roots = [(-p - s) // 2, (-p + s) // 2]  # exact: integer roots make -p and s of equal parity
    steps += [f"x=({-p}-{s})/2={roots[0]}", f"x=({-p}+{s})/2={roots[1]}"]
    return ";".join(steps), f"{roots[0]},{roots[1]}"


def _quadratic(rng: np.random.Generator, o: dict) -> Sample:
    r = o["root_range"]
    alpha = int(rng.integers(1, o["alpha_max"] + 1)) * (1 if rng.random() < 0.5 else -1)
    if rng.random() < o["no_roots"]:
        while True:  # monic x^2+p*x+q with a negative discriminant
            p, q = (int(v) for v in rng.integers(-2 * r, 2 * r + 1, size=2))
            if p * p < 4 * q:
                break
    else:
        x1, x2 = (int(v) for v in rng.integers(-r, r + 1, size=2))
        p, q = -(x1 + x2), x1 * x2
    solution, answer = quadratic_solution(p, q)
    return Sample(polynomial(alpha, alpha * p, alpha * q), f"{solution};{answer}")

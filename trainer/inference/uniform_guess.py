"""Whether an evaluation measured a model or a uniform guess (issue 32).

A model that has learned nothing spreads its probability evenly over the vocabulary, and its perplexity is then
exactly the vocabulary's size. The README's quick start trained 20 steps, and `memlm eval` printed test ppl 32,759
on WikiText-2's 33,278 words without a word about it. Past half the vocabulary's size a perplexity says little more
than that, so `memlm eval` adds one line saying so.
"""

from __future__ import annotations

SHARE = 0.5  # a perplexity at least this share of the vocabulary's size: not yet a measure of the model


def note(result: dict, vocab_size: int) -> str | None:
    """The line for an evaluation `result` (the `memlm eval` JSON object) whose ppl is near a uniform guess's."""
    ppl = result.get("ppl")
    if ppl is None or ppl < SHARE * vocab_size:
        return None
    step = f" at step {result['step']:,}" if isinstance(result.get("step"), int) else ""
    return (f"{result['split']} ppl {ppl:,.0f} is close to the {vocab_size:,} of a uniform guess over the vocabulary: "
            f"the model{step} has not learned the data yet, so this number does not measure it (train longer)")

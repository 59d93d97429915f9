"""The baselines beside every long-context accuracy (trainer/inference/longeval_baselines.py): each heuristic on
hand-written prompts whose answer is worked out here by hand, the same heuristics written again plainly in this file
(word lists, no regular expressions shared) and compared on generated samples of every task, and chance counted
from the answers the generator gives."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from memlm.trainer.inference import longeval_baselines as lb

WIKITEXT2 = Path(__file__).resolve().parents[4] / "shared" / "data" / "wikitext-2"
PLACES = ("bathroom", "hallway", "garden", "office", "kitchen", "bedroom", "cellar", "park")

QA1 = ("The park was closed. Mary went to the kitchen. The kitchen of the house was small. John went to the garden. "
       "Mary travelled to the office. Q: Where is Mary?")
QA2 = ("Mary went to the garden. Mary picked up the apple. The garden is green. Mary went to the hallway. John went "
       "to the cellar. Q: Where is the apple?")
QA3 = ("Fred got the milk. Fred went to the cellar. Fred went to the kitchen. Bill went to the office. Fred went to "
       "the kitchen. The cellar was dark. Q: Where was the milk before the kitchen?")


@pytest.mark.parametrize("prompt,expected", [
    # last: office; most frequent: kitchen (twice; park, garden, office once)
    (QA1, {"last_mentioned": "office", "most_frequent": "kitchen"}),
    # before the apple's last mention: garden (where Mary was when she took it); last: cellar; most: garden (2)
    (QA2, {"last_mentioned": "cellar", "most_frequent": "garden", "before_object": "garden"}),
    # the question's kitchen never counts: last cellar, most cellar (2 vs office 1); before the milk: none;
    # before the kitchen's first mention: cellar
    (QA3, {"last_mentioned": "cellar", "most_frequent": "cellar", "before_object": None,
           "before_asked_place": "cellar"}),
])
def test_each_heuristic_on_hand_written_prompts(prompt, expected):
    context, question = lb.split_prompt(prompt)
    assert question.startswith("Where") and not context.endswith(" ")
    for name, answer in expected.items():
        assert lb.HEURISTICS[name](context, question, PLACES) == answer, name


def test_mentions_are_whole_words_of_any_case():
    assert lb.mentions("Parkland, the PARK; gardens and a garden-party at the office's door", PLACES) == [
        "park", "garden", "office"]


def test_a_tie_goes_to_the_label_mentioned_last():
    assert lb.most_frequent("garden office office garden", "Where is Mary?", PLACES) == "garden"


# ---------------------------------------------------------------- written again plainly, on generated samples


def words(text: str) -> list[str]:
    out, word = [], ""
    for ch in text.lower() + " ":
        if ch.isalnum() or ch == "_":
            word += ch
        else:
            if word:
                out.append(word)
            word = ""
    return out


def plain(name: str, prompt: str) -> str | None:
    context, question = prompt[:prompt.rindex(" Q: ")], prompt[prompt.rindex(" Q: ") + 4:]
    asked = [w for w in words(question) if w in PLACES]
    seen = words(context)
    places = [w for w in seen if w in PLACES and w not in asked]
    if name == "last_mentioned":
        return places[-1] if places else None
    if name == "most_frequent":
        counts = Counter(places)
        best = [p for p in places if counts[p] == max(counts.values())]
        return best[-1] if best else None
    if name == "before_object":
        thing = words(question)[words(question).index("the") + 1]
        if thing not in seen:
            return None
        last = len(seen) - 1 - seen[::-1].index(thing)
        before = [w for w in seen[:last] if w in PLACES and w not in asked]
        return before[-1] if before else None
    first = seen.index(asked[0]) if asked[0] in seen else None
    before = [w for w in seen[:first] if w in PLACES and w not in asked] if first is not None else []
    return before[-1] if before else None


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3"])
def test_baselines_equal_a_plain_rewrite_on_generated_samples(task):
    from memlm.data_pipeline.tasks import generate, resolve_options

    options = resolve_options(task, {"length": 700, "background": str(WIKITEXT2), "docs": "1,150,1"})
    samples = [(s.prompt, s.answer) for s in generate(task, "valid", options)]
    got = lb.baselines(task, samples, PLACES, 0.125)
    names = {"qa1": ["last_mentioned", "most_frequent"], "qa2": ["last_mentioned", "most_frequent", "before_object"],
             "qa3": ["last_mentioned", "most_frequent", "before_object", "before_asked_place"]}[task]
    assert list(got) == ["chance", *names] and got["chance"] == 0.125
    for name in names:
        assert got[name] == sum(plain(name, p) == a for p, a in samples) / len(samples), name
    assert max(got[n] for n in names) > 0.2  # a heuristic well above chance: why they are shown


def test_chance_is_one_over_the_answers_the_generator_gives():
    from memlm.data_pipeline.tasks import generate, resolve_options

    options = resolve_options("qa1", {"length": 300, "background": str(WIKITEXT2), "docs": "1,300,1"})
    answers = {s.answer for s in generate("qa1", "valid", options)}
    labels, chance = lb.task_labels_and_chance("qa1", options)
    assert set(labels) == answers and chance == 1 / len(answers)
    keys = {s.answer for s in generate("passkey", "valid", resolve_options("passkey", {
        "length": 200, "digits": 2, "docs": "1,2000,1"}))}
    assert lb.task_labels_and_chance("passkey", {"digits": 2}) == ((), 1 / len(keys))  # 10..99: all 90 drawn


def test_babilongs_rule_judges_the_guesses_when_given():
    from memlm.data_pipeline import babilong

    labels = babilong.TASK_LABELS["qa1"]
    samples = [("Mary went to the office. Q: Where is Mary?", "office"),
               ("Mary went to the office. John went to the garden. Q: Where is Mary?", "office")]

    def judge(answer, guess, question):
        return babilong.right(answer, guess or "", question, labels)

    assert lb.baselines("qa1", samples, labels, 1 / 6, judge) == {"chance": 1 / 6, "last_mentioned": 0.5,
                                                                  "most_frequent": 0.5}
    assert lb.baselines("passkey", samples, (), 1e-5) == {"chance": 1e-5}

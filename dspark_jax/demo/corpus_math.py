"""The math domain of the demo corpus: generated arithmetic word problems with worked
step-by-step solutions (see corpus.py)."""

from __future__ import annotations

import random
from collections.abc import Callable

from dspark_jax.demo.corpus_common import _rng
from dspark_jax.train.data import Conversation

# ------------------------------------------------------------------------------------------------
# Math: generated word problems

_NAMES = (
    ("Ana", "she"), ("Ben", "he"), ("Carla", "she"), ("Dev", "he"), ("Elena", "she"),
    ("Farid", "he"), ("Grace", "she"), ("Hugo", "he"), ("Ines", "she"), ("Jamal", "he"),
    ("Kira", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Olga", "she"),
    ("Pedro", "he"), ("Quinn", "she"), ("Ravi", "he"), ("Sara", "she"), ("Tom", "he"),
)  # fmt: skip
_ITEMS = (
    "apples", "pencils", "notebooks", "oranges", "stickers", "muffins", "candles", "books",
    "marbles", "cups", "tickets", "bananas", "erasers", "cookies", "balloons", "plants",
)  # fmt: skip
_MACHINES = (("machine", "bolts"), ("printer", "pages"), ("bakery", "loaves"), ("pump", "liters"))
MathProblem = tuple[str, list[str], int]  # (question, solution steps, answer)


def _two_names(rng: random.Random) -> tuple[tuple[str, str], tuple[str, str]]:
    a, b = rng.sample(_NAMES, 2)
    return a, b


def _shopping(rng: random.Random) -> MathProblem:
    (name, pron), (it1, it2) = rng.choice(_NAMES), rng.sample(_ITEMS, 2)
    a, p, b, q = rng.randint(2, 9), rng.randint(1, 12), rng.randint(2, 9), rng.randint(1, 12)
    c1, c2 = a * p, b * q
    total = c1 + c2
    steps = [
        f"The {it1} cost {a} * {p} = {c1} dollars.",
        f"The {it2} cost {b} * {q} = {c2} dollars.",
        f"Together that is {c1} + {c2} = {total} dollars.",
    ]
    q_text = f"{name} buys {a} {it1} for ${p} each and {b} {it2} for ${q} each."
    if rng.random() < 0.5:
        bill = next(x for x in (20, 50, 100, 200, 500) if x >= total)
        steps.append(f"The change is {bill} - {total} = {bill - total} dollars.")
        pron_c = pron.capitalize()
        return (
            f"{q_text} {pron_c} pays with a ${bill} bill. How much change does {pron} get?",
            steps,
            bill - total,
        )
    return f"{q_text} How much does {pron} spend in total?", steps, total


def _ages(rng: random.Random) -> MathProblem:
    (a, _), (b, _) = _two_names(rng)
    age_b, d, k = rng.randint(3, 40), rng.randint(2, 30), rng.randint(2, 15)
    age_a = age_b + d
    if rng.random() < 0.5:
        steps = [
            f"{a} is {age_b} + {d} = {age_a} years old now.",
            f"In {k} years {a} will be {age_a} + {k} = {age_a + k} years old.",
        ]
        return (
            f"{a} is {d} years older than {b}. {b} is {age_b} years old. "
            f"How old will {a} be in {k} years?",
            steps,
            age_a + k,
        )
    total = age_a + age_b + 2 * k
    steps = [
        f"{a} is {age_b} + {d} = {age_a} years old now.",
        f"In {k} years {a} will be {age_a} + {k} = {age_a + k} and {b} will be "
        f"{age_b} + {k} = {age_b + k}.",
        f"The sum is {age_a + k} + {age_b + k} = {total}.",
    ]
    return (
        f"{a} is {d} years older than {b}, who is {age_b}. "
        f"What will the sum of their ages be in {k} years?",
        steps,
        total,
    )


def _rates(rng: random.Random) -> MathProblem:
    if rng.random() < 0.5:
        machine, unit = rng.choice(_MACHINES)
        r, h, extra = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
        made = r * h
        steps = [
            f"In {h} hours the {machine} makes {r} * {h} = {made} {unit}.",
        ]
        if rng.random() < 0.5:
            return (
                f"A {machine} makes {r} {unit} per hour. How many {unit} does it make in {h} hours?",
                steps,
                made,
            )
        total = made + extra * r
        steps.append(f"In {extra} more hours it makes {r} * {extra} = {extra * r} {unit}.")
        steps.append(f"In total that is {made} + {extra * r} = {total} {unit}.")
        return (
            f"A {machine} makes {r} {unit} per hour. It runs for {h} hours, stops, and then "
            f"runs {extra} more hours. How many {unit} does it make?",
            steps,
            total,
        )
    s1, h1, s2, h2 = rng.randint(20, 90), rng.randint(1, 6), rng.randint(20, 90), rng.randint(1, 6)
    d1, d2 = s1 * h1, s2 * h2
    name, _ = rng.choice(_NAMES)
    steps = [
        f"First part: {s1} * {h1} = {d1} km.",
        f"Second part: {s2} * {h2} = {d2} km.",
        f"Total distance: {d1} + {d2} = {d1 + d2} km.",
    ]
    return (
        f"{name} drives at {s1} km per hour for {h1} hours, then at {s2} km per hour for "
        f"{h2} hours. How many kilometers does {name} drive?",
        steps,
        d1 + d2,
    )


def _sharing(rng: random.Random) -> MathProblem:
    (name, pron), item = rng.choice(_NAMES), rng.choice(_ITEMS)
    k, each = rng.randint(2, 9), rng.randint(2, 12)
    kept = rng.randint(1, 20)
    n = k * each + kept
    steps = [
        f"{name} keeps {kept}, so {n} - {kept} = {n - kept} {item} are shared.",
        f"Each friend gets {n - kept} / {k} = {each} {item}.",
    ]
    return (
        f"{name} has {n} {item}. {pron.capitalize()} keeps {kept} and shares the rest equally "
        f"among {k} friends. How many {item} does each friend get?",
        steps,
        each,
    )


def _multi_step(rng: random.Random) -> MathProblem:
    (name, pron), item = (
        rng.choice(_NAMES),
        rng.choice(("cookies", "muffins", "rolls", "cupcakes", "pies")),
    )
    batches, per = rng.randint(2, 8), rng.randint(6, 24)
    made = batches * per
    box = rng.randint(2, 8)
    boxes = rng.randint(1, max(1, made // box - 1))
    sold = made - boxes * box
    steps = [
        f"{name} makes {batches} * {per} = {made} {item}.",
        f"After selling {sold}, {made} - {sold} = {made - sold} {item} are left.",
        f"That fills {made - sold} / {box} = {boxes} boxes.",
    ]
    return (
        f"{name} bakes {batches} batches of {per} {item}. {pron.capitalize()} sells {sold} of "
        f"them and packs the rest into boxes of {box}. How many boxes does {pron} fill?",
        steps,
        boxes,
    )


def _savings(rng: random.Random) -> MathProblem:
    name, pron = rng.choice(_NAMES)
    x, w = rng.randint(3, 40), rng.randint(2, 12)
    saved = x * w
    y = rng.randint(1, saved)
    steps = [
        f"{name} saves {x} * {w} = {saved} dollars.",
        f"After spending {y} dollars, {saved} - {y} = {saved - y} dollars are left.",
    ]
    return (
        f"{name} saves ${x} every week for {w} weeks and then spends ${y} on a gift. "
        f"How much money does {pron} have left?",
        steps,
        saved - y,
    )


MATH_TEMPLATES: dict[str, Callable[[random.Random], MathProblem]] = {
    "shopping": _shopping,
    "ages": _ages,
    "rates": _rates,
    "sharing": _sharing,
    "multi_step": _multi_step,
    "savings": _savings,
}


def math_problem(rng: random.Random) -> tuple[str, str, str]:
    """(template name, question, worked solution ending in "The answer is N.")."""
    name = rng.choice(sorted(MATH_TEMPLATES))
    question, steps, answer = MATH_TEMPLATES[name](rng)
    steps = [f"Step {i + 1}: {s}" for i, s in enumerate(steps)]
    return name, question, "\n".join(steps + [f"The answer is {answer}."])


def math_chats(n: int, seed: int, stream: str, exclude: frozenset[str] = frozenset()) -> list:
    """`n` distinct math chats from the random stream `stream`, skipping `exclude` questions."""
    rng = _rng(seed, "math", stream)
    seen: set[str] = set(exclude)
    out = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise RuntimeError(f"could not generate {n} distinct math problems; lower n_math")
        template, question, solution = math_problem(rng)
        if question in seen:
            continue
        seen.add(question)
        out.append(
            Conversation.from_pairs(
                ("user", question), ("assistant", solution), domain="math", source=template
            )
        )
    return out

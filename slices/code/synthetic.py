"""Easy function-writing problems in HumanEval's format, generated from a seed.

A 135M model solves only a handful of HumanEval problems, so a slice made of them alone
cannot show flips. These templated problems ("return x plus three", "reverse s", "sum the
list") sit at the edge of what such a model can do, so quantization damage moves them.
Each template is a row of data: a signature, a docstring, the reference body and the
pure function that computes the expected values of its asserts (our own trusted code,
run here in-process; only model-written code goes through the sandbox).
"""
from __future__ import annotations

import random
from typing import Any, Callable, NamedTuple

NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
LETTERS = "aeiost"
SUFFIXES = ("_done", "!", "ing", ".txt")
WORDS = ("apple", "banana", "cherry", "orange", "tomato", "potato", "rocket", "window", "stone", "letter",
         "summer", "castle", "pepper", "mirror", "garden", "silver", "bottle", "island", "pencil", "yellow")


class Template(NamedTuple):
    """One family of problems; ``{k}``, ``{word}``, ``{c}`` and ``{suffix}`` are filled per item."""

    key: str  # cluster: items of one template share their wording and solution shape
    category: str  # arith | string | list (the sub-slice)
    name: str  # function name
    params: str  # parameter list with annotations
    returns: str  # return annotation
    doc: str  # first docstring line
    body: str  # reference solution (indented, one or more lines)
    reference: Callable[..., Callable[..., Any]]  # constants -> expected-value function
    inputs: Callable[[random.Random], tuple]  # one argument tuple per call


def _ints(rng: random.Random, n: int = 1, low: int = -20, high: int = 50) -> tuple:
    return tuple(rng.randint(low, high) for _ in range(n))


def _word(rng: random.Random) -> tuple:
    return (rng.choice(WORDS),)


def _numbers(rng: random.Random) -> tuple:
    return ([rng.randint(-9, 30) for _ in range(rng.randint(1, 6))],)


TEMPLATES: tuple[Template, ...] = (
    Template("add_k", "arith", "add_{word}", "x: int", "int", "Return x plus {k}.",
             "    return x + {k}", lambda k, **_: lambda x: x + k, _ints),
    Template("times_k", "arith", "times_{word}", "x: int", "int", "Return x multiplied by {k}.",
             "    return x * {k}", lambda k, **_: lambda x: x * k, _ints),
    Template("divisible_k", "arith", "is_divisible_by_{word}", "n: int", "bool",
             "Return True if n is divisible by {k}, otherwise False.",
             "    return n % {k} == 0", lambda k, **_: lambda n: n % k == 0, lambda r: _ints(r, 1, 0, 60)),
    Template("larger", "arith", "larger", "a: int, b: int", "int", "Return the larger of a and b.",
             "    return max(a, b)", lambda **_: max, lambda r: _ints(r, 2)),
    Template("square_plus_k", "arith", "square_plus_{word}", "x: int", "int", "Return x squared plus {k}.",
             "    return x * x + {k}", lambda k, **_: lambda x: x * x + k, lambda r: _ints(r, 1, -9, 12)),
    Template("distance", "arith", "distance", "a: int, b: int", "int",
             "Return the absolute difference between a and b.",
             "    return abs(a - b)", lambda **_: lambda a, b: abs(a - b), lambda r: _ints(r, 2)),
    Template("reverse", "string", "reverse_string", "s: str", "str", "Return the string s reversed.",
             "    return s[::-1]", lambda **_: lambda s: s[::-1], _word),
    Template("upper", "string", "to_upper", "s: str", "str", "Return s in upper case.",
             "    return s.upper()", lambda **_: str.upper, _word),
    Template("repeat_k", "string", "repeat_{word}_times", "s: str", "str", "Return s repeated {k} times.",
             "    return s * {k}", lambda k, **_: lambda s: s * k, _word),
    Template("count_letter", "string", "count_{c}", "s: str", "int",
             "Return how many times the letter '{c}' occurs in s.",
             "    return s.count('{c}')", lambda c, **_: lambda s: s.count(c), _word),
    Template("first_last", "string", "first_and_last", "s: str", "str",
             "Return the first and the last character of s joined together.",
             "    return s[0] + s[-1]", lambda **_: lambda s: s[0] + s[-1], _word),
    Template("suffix", "string", "add_suffix", "s: str", "str", "Return s followed by '{suffix}'.",
             "    return s + '{suffix}'", lambda suffix, **_: lambda s: s + suffix, _word),
    Template("sum", "list", "total", "numbers: list", "int", "Return the sum of the numbers.",
             "    return sum(numbers)", lambda **_: sum, _numbers),
    Template("max", "list", "largest", "numbers: list", "int", "Return the largest number in the list.",
             "    return max(numbers)", lambda **_: max, _numbers),
    Template("count_even", "list", "count_even", "numbers: list", "int",
             "Return how many numbers in the list are even.",
             "    return sum(1 for n in numbers if n % 2 == 0)",
             lambda **_: lambda xs: sum(1 for n in xs if n % 2 == 0), _numbers),
    Template("greater_k", "list", "greater_than_{word}", "numbers: list", "list",
             "Return a list of the numbers greater than {k}, in their original order.",
             "    return [n for n in numbers if n > {k}]",
             lambda k, **_: lambda xs: [n for n in xs if n > k], _numbers),
    Template("scale_k", "list", "multiply_all_by_{word}", "numbers: list", "list",
             "Return a new list with every number multiplied by {k}.",
             "    return [n * {k} for n in numbers]", lambda k, **_: lambda xs: [n * k for n in xs], _numbers),
    Template("last", "list", "last_element", "numbers: list", "int", "Return the last element of the list.",
             "    return numbers[-1]", lambda **_: lambda xs: xs[-1], _numbers),
)
CATEGORIES = ("arith", "string", "list")


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def problem(index: int, seed: int) -> dict:
    """Problem ``index`` of the synthetic set: a HumanEval-shaped dict (prompt, test, entry_point, ...).

    Problem i depends only on (seed, i), so a larger item count extends a smaller one.
    Templates are visited in a seeded order that interleaves the three categories.
    """
    order = sorted(range(len(TEMPLATES)), key=lambda t: (CATEGORIES.index(TEMPLATES[t].category),
                                                         random.Random(f"order/{seed}/{t}").random()))
    by_category = [[t for t in order if TEMPLATES[t].category == c] for c in CATEGORIES]
    round_robin = [group[i] for i in range(max(map(len, by_category))) for group in by_category if i < len(group)]
    template = TEMPLATES[round_robin[index % len(round_robin)]]
    rng = random.Random(f"code-synthetic/{seed}/{index}")
    k = rng.choice(sorted(NUMBER_WORDS))
    constants = {"k": k, "word": NUMBER_WORDS[k], "c": rng.choice(LETTERS), "suffix": rng.choice(SUFFIXES)}
    name = template.name.format(**constants)
    expected = template.reference(**constants)
    example, *cases = [template.inputs(rng) for _ in range(5)]
    prompt = (f"def {name}({template.params}) -> {template.returns}:\n"
              f'    """{template.doc.format(**constants)}\n'
              f"    >>> {_call(name, example)}\n"
              f"    {expected(*example)!r}\n"
              f'    """\n')
    asserts = "\n".join(f"    assert candidate({', '.join(repr(a) for a in args)}) == {expected(*args)!r}"
                        for args in [example, *cases])
    return {
        "task_id": f"synthetic/{index}",
        "prompt": prompt,
        "entry_point": name,
        "canonical_solution": template.body.format(**constants) + "\n",
        "test": f"def check(candidate):\n{asserts}\n",
        "category": template.category,
        "template": template.key,
    }

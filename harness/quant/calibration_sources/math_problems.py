"""The ``math`` calibration source: generated arithmetic word problems with worked solutions.

Each problem states a situation, asks a question and solves it step by step ("Step 1: 7 × 12
= 84."), ending in "Answer: N.". Templates cover rates, totals with change, percentages, averages,
areas, ratios, unit conversions and one-unknown linear equations; the numbers come from a fixed
seed, so the text is the same on every machine. The templates are this module's own, not the
math slice's (which calibration never sees). Every equation written is true (checked in tests).
"""
from __future__ import annotations

import random
from typing import Callable

N_PROBLEMS = 4000
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena", "Malik",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tova")
ITEMS = ("notebooks", "tickets", "pencils", "bottles of juice", "boxes of tea", "packs of cards", "plants")


def _rate(rng: random.Random) -> str:
    speed, hours, extra = rng.randint(20, 120), rng.randint(2, 9), rng.randint(5, 60)
    return (f"A bus travels at {speed} km per hour for {hours} hours and then drives another {extra} km. "
            f"How far does it travel in total?\nStep 1: {speed} × {hours} = {speed * hours}.\n"
            f"Step 2: {speed * hours} + {extra} = {speed * hours + extra}.\nAnswer: {speed * hours + extra} km.")


def _change(rng: random.Random) -> str:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 12), rng.randint(2, 25)
    paid = (count * price // 10 + rng.randint(1, 5)) * 10
    return (f"{name} buys {count} {item} at {price} dollars each and pays with {paid} dollars. "
            f"How much change does {name} get?\nStep 1: {count} × {price} = {count * price}.\n"
            f"Step 2: {paid} - {count * price} = {paid - count * price}.\nAnswer: {paid - count * price} dollars.")


def _percent(rng: random.Random) -> str:
    price, percent = rng.randint(2, 30) * 20, rng.choice((10, 20, 25, 30, 40, 50))  # price x percent / 100 is whole
    off = price * percent // 100
    return (f"A jacket costs {price} euros. It is on sale for {percent}% off. What is the sale price?\n"
            f"Step 1: {price} × {percent} ÷ 100 = {off}.\nStep 2: {price} - {off} = {price - off}.\n"
            f"Answer: {price - off} euros.")


def _average(rng: random.Random) -> str:
    name, n = rng.choice(NAMES), rng.randint(3, 5)
    mean = rng.randint(50, 95)
    scores = [mean + rng.randint(-8, 8) for _ in range(n - 1)]
    scores.append(mean * n - sum(scores))
    steps, total = [], scores[0]
    for score in scores[1:]:
        steps.append(f"{total} + {score} = {total + score}")
        total += score
    return (f"{name} scored {', '.join(map(str, scores[:-1]))} and {scores[-1]} on {n} tests. What is the average "
            f"score?\nStep 1: {'; '.join(steps)}.\nStep 2: {total} ÷ {n} = {mean}.\nAnswer: {mean}.")


def _area(rng: random.Random) -> str:
    width, length, cost = rng.randint(3, 30), rng.randint(3, 40), rng.randint(2, 15)
    area = width * length
    return (f"A garden is {width} m wide and {length} m long. Grass seed costs {cost} dollars per square metre. "
            f"How much does it cost to seed the garden?\nStep 1: {width} × {length} = {area}.\n"
            f"Step 2: {area} × {cost} = {area * cost}.\nAnswer: {area * cost} dollars.")


def _ratio(rng: random.Random) -> str:
    a, b, unit = rng.randint(1, 5), rng.randint(1, 5), rng.randint(3, 20)
    total = (a + b) * unit
    return (f"Flour and sugar are mixed in the ratio {a} : {b}. The mixture weighs {total} grams. How much flour "
            f"is in it?\nStep 1: {a} + {b} = {a + b}.\nStep 2: {total} ÷ {a + b} = {unit}.\n"
            f"Step 3: {unit} × {a} = {unit * a}.\nAnswer: {unit * a} grams.")


def _conversion(rng: random.Random) -> str:
    hours, minutes = rng.randint(1, 6), rng.randint(1, 59)
    return (f"A film lasts {hours} hours and {minutes} minutes. How many minutes is that?\n"
            f"Step 1: {hours} × 60 = {hours * 60}.\nStep 2: {hours * 60} + {minutes} = {hours * 60 + minutes}.\n"
            f"Answer: {hours * 60 + minutes} minutes.")


def _equation(rng: random.Random) -> str:
    a, x, b = rng.randint(2, 12), rng.randint(1, 30), rng.randint(1, 50)
    c = a * x + b
    return (f"Solve for x: {a}x + {b} = {c}.\nStep 1: {c} - {b} = {c - b}, so {a}x = {c - b}.\n"
            f"Step 2: {c - b} ÷ {a} = {x}.\nAnswer: x = {x}.")


TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _rate, _change, _percent, _average, _area, _ratio, _conversion, _equation)


def problems(n: int = N_PROBLEMS, seed: str = "calibration-math/0") -> list[str]:
    rng = random.Random(seed)
    return [f"Problem {i + 1}. {rng.choice(TEMPLATES)(rng)}" for i in range(n)]


def math_text() -> str:
    return "\n\n".join(problems())

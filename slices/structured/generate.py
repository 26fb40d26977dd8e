"""Structured-output slice: extract facts from a sentence as JSON that fits a given schema.

Every item gives a short text, a JSON schema and a plain-words list of the keys; the
answer must parse, validate against the schema (``jsonschema``) and carry the right
values. The sub-slices are format constraints, each a family of templates:

* ``flat``: one object of strings, integers and a boolean;
* ``nested``: objects inside an object;
* ``array``: a list of objects, in the order of the text;
* ``enum``: string fields restricted to a fixed set of values;
* ``number``: numbers written with units, thousands separators or percent signs;
* ``key_order``: a flat object whose keys must come in a stated order (checked on top of the schema);
* ``json_only``: the whole reply must be the JSON object, with no prose and no code fence.

Item i depends only on (seed, i), so a larger item count extends a smaller one.
"""
from __future__ import annotations

import json
import random
from typing import Any, Callable

SIZES = {"quick": 42, "full": 245}
VARIANTS = ("flat", "nested", "array", "enum", "number", "key_order", "json_only")

NAMES = ("Maria", "Kenji", "Amara", "Lukas", "Sofia", "Omar", "Ingrid", "Tomas", "Priya", "Diego", "Hana",
         "Felix", "Leila", "Marco", "Nadia", "Oscar", "Elena", "Samuel", "Yara", "Victor")
PLACES = (("Lyon", "France"), ("Osaka", "Japan"), ("Porto", "Portugal"), ("Cusco", "Peru"), ("Leeds", "England"),
          ("Graz", "Austria"), ("Tartu", "Estonia"), ("Krakow", "Poland"), ("Bergen", "Norway"),
          ("Seville", "Spain"), ("Turin", "Italy"), ("Ghent", "Belgium"), ("Daegu", "Korea"), ("Perth", "Australia"))
JOBS = ("engineer", "teacher", "nurse", "baker", "pilot", "lawyer", "farmer", "chemist", "architect", "librarian")
GOODS = ("nails", "screws", "bolts", "hinges", "washers", "brackets", "hooks", "clamps", "springs", "rivets")
PRIORITIES = ("low", "medium", "high")
CATEGORIES = {"billing": "a wrong invoice", "shipping": "a late delivery", "technical": "a login error",
              "account": "a password reset"}

STRING, INTEGER, NUMBER, BOOLEAN = ({"type": t} for t in ("string", "integer", "number", "boolean"))


def _object(properties: dict[str, dict]) -> dict:
    """A closed object schema: every listed key required, no other key allowed."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _flat(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    name, (city, _), age = rng.choice(NAMES), rng.choice(PLACES), rng.randint(19, 78)
    member = rng.random() < 0.5
    texts = (f"{name} is {age} years old and lives in {city}. {name} is {'a' if member else 'not a'} club member.",
             f"Member check: {name}, aged {age}, from {city}, {'has' if member else 'does not have'} a membership.",
             f"{'A member' if member else 'Not a member'}: {name} ({age}) lives in {city}.")
    expected = {"name": name, "age": age, "city": city, "member": member}
    return texts[template], _object({"name": STRING, "age": INTEGER, "city": STRING, "member": BOOLEAN}), expected


def _nested(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    name, (city, country), age, job = rng.choice(NAMES), rng.choice(PLACES), rng.randint(21, 70), rng.choice(JOBS)
    texts = (f"{name} is a {age}-year-old {job} who lives in {city}, {country}.",
             f"Our new {job}, {name} ({age}), moved here from {city} in {country}.",
             f"Profile: {name}, {job}, age {age}. Home: {city}, {country}.")
    schema = _object({"person": _object({"name": STRING, "age": INTEGER, "job": STRING}),
                      "address": _object({"city": STRING, "country": STRING})})
    expected = {"person": {"name": name, "age": age, "job": job}, "address": {"city": city, "country": country}}
    return texts[template], schema, expected


def _array(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    goods = rng.sample(GOODS, rng.randint(2, 3))
    counts = [rng.randint(2, 40) for _ in goods]
    parts = [f"{n} boxes of {g}" for n, g in zip(counts, goods)]
    listing = ", ".join(parts[:-1]) + f" and {parts[-1]}"
    texts = (f"The delivery contains {listing}.", f"Please restock {listing}.", f"Inventory count: {listing}.")
    schema = _object({"items": {"type": "array", "minItems": 1,
                                "items": _object({"product": STRING, "boxes": INTEGER})}})
    expected = {"items": [{"product": g, "boxes": n} for g, n in zip(goods, counts)]}
    return texts[template], schema, expected


def _enum(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    name, ticket = rng.choice(NAMES), rng.randint(1000, 9999)
    priority, category = rng.choice(PRIORITIES), rng.choice(sorted(CATEGORIES))
    texts = (f"Ticket {ticket} from {name} is about {CATEGORIES[category]} ({category}); priority is {priority}.",
             f"{name} opened ticket {ticket}: a {priority} priority {category} issue, {CATEGORIES[category]}.",
             f"[{priority.upper()}] #{ticket} {category} - {name} reports {CATEGORIES[category]}.")
    schema = _object({"ticket": INTEGER, "customer": STRING,
                      "category": {"type": "string", "enum": sorted(CATEGORIES)},
                      "priority": {"type": "string", "enum": list(PRIORITIES)}})
    expected = {"ticket": ticket, "customer": name, "category": category, "priority": priority}
    return texts[template], schema, expected


def _number(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    weight = rng.randint(5, 95) / 10
    price = rng.randint(1000, 9999) + rng.choice((0, 0.5, 0.25, 0.99))
    percent = rng.choice((5, 10, 12.5, 15, 20, 25, 30))
    price_text = f"{price:,.2f}"
    texts = (f"The parcel weighs {weight} kg, costs ${price_text} and has a {percent}% discount.",
             f"Price: ${price_text}. Discount: {percent}%. Weight: {weight} kg.",
             f"A {weight} kg parcel priced at {price_text} dollars, {percent}% off.")
    schema = _object({"weight_kg": NUMBER, "price_usd": NUMBER, "discount_percent": NUMBER})
    expected = {"weight_kg": weight, "price_usd": price, "discount_percent": percent}
    return texts[template], schema, expected


def _key_order(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    text, schema, expected = _flat(rng, template)
    keys = list(expected)
    rng.shuffle(keys)
    ordered = {key: expected[key] for key in keys}
    return text, _object({key: schema["properties"][key] for key in keys}), ordered


VARIANT_BUILDERS: dict[str, Callable[[random.Random, int], tuple[str, dict, dict]]] = {
    "flat": _flat, "nested": _nested, "array": _array, "enum": _enum, "number": _number,
    "key_order": _key_order, "json_only": _flat,
}
TEMPLATES_PER_VARIANT = 3
TYPE_WORDS = {"string": "string", "integer": "integer", "number": "number", "boolean": "true or false",
              "array": "list", "object": "object"}


def describe_keys(schema: dict) -> str:
    """The schema's top-level keys in words, e.g. 'name (string), age (integer)'."""
    words = []
    for key, sub in schema["properties"].items():
        if "enum" in sub:
            words.append(f"{key} (one of {', '.join(sub['enum'])})")
        elif sub["type"] == "object":
            words.append(f"{key} (object with {describe_keys(sub)})")
        elif sub["type"] == "array":
            words.append(f"{key} (list of objects with {describe_keys(sub['items'])})")
        else:
            words.append(f"{key} ({TYPE_WORDS[sub['type']]})")
    return ", ".join(words)


def instruction(text: str, schema: dict, variant: str) -> str:
    lines = [f"Extract the information from this text as JSON.\nText: {text}",
             f"Keys: {describe_keys(schema)}.",
             f"JSON schema: {json.dumps(schema)}"]
    if variant == "key_order":
        lines.append(f"Write the keys in exactly this order: {', '.join(schema['properties'])}.")
    if variant == "json_only":
        lines.append("Reply with the JSON object only: no explanation and no code fence.")
    return "\n".join(lines)


def items(size: str = "quick", seed: int = 1234, n_items: int | None = None, **_: Any) -> list[dict]:
    """The slice's items, variants in turn; every item carries id, sub_slice, cluster and gold_text."""
    if size not in SIZES:
        raise ValueError(f"structured slice: size={size!r} is unknown; use one of {sorted(SIZES)}")
    out: list[dict] = []
    for index in range(n_items if n_items is not None else SIZES[size]):
        variant = VARIANTS[index % len(VARIANTS)]
        rng = random.Random(f"structured/{seed}/{index}")
        template = rng.randrange(TEMPLATES_PER_VARIANT)
        text, schema, expected = VARIANT_BUILDERS[variant](rng, template)
        prompt = instruction(text, schema, variant)
        answer = json.dumps(expected)
        out.append({
            "id": f"structured-{seed}-{index:05d}",
            "sub_slice": variant,
            "cluster": f"{variant}/t{template}",
            "prompt": prompt,
            "schema": json.dumps(schema),
            "expected": answer,
            "check_key_order": variant == "key_order",
            "json_only": variant == "json_only",
            "gold_text": f"{prompt}\n{answer}",
        })
    return out


def dataset(**metadata: Any):
    """lm-eval ``custom_dataset`` hook: the item set as a DatasetDict with a test split."""
    from datasets import Dataset, DatasetDict

    return DatasetDict({"test": Dataset.from_list(items(**metadata))})

"""Structured-output slice: extract facts from a sentence as JSON that fits a given schema.

Every item holds a short text and a closed JSON schema (all keys required, no others); the
answer must parse, validate against the schema (``jsonschema``) and carry the right values.
The prompt states the schema's shape compactly, e.g. ``{"name": string, "age": integer}``:
SmolLM2-135M-Instruct, shown the JSON Schema document itself, copies the schema back
instead of answering (0/42 measured), and shown a worked example, copies the example.
``show_schema=True`` (slice metadata) adds the full JSON Schema to the prompt, for larger models.
The sub-slices are format constraints, each a family of three phrasings:

* ``flat``: one object of strings and an integer;
* ``nested``: objects inside an object;
* ``array``: a list of strings, in the order of the text;
* ``enum``: a string field restricted to a fixed set of values;
* ``number``: a price written with a currency sign, thousands separator and cents;
* ``key_order``: a flat object whose keys must come in a stated order (checked on top of the schema);
* ``json_only``: the whole reply must be the JSON object, with no prose and no code fence.

Item i depends only on (seed, i), so a larger item count extends a smaller one.
"""
from __future__ import annotations

import json
import random
from typing import Any, Callable

SIZES = {"quick": 50, "full": 210}
VARIANTS = ("flat", "nested", "array", "enum", "number", "key_order", "json_only")
# The quick size asks 10 items of each of the five variants SmolLM2-135M (the default model) can
# do; nested and number scored 0/6 on it (it fills nested fields with text spans, adds keys to the
# price), so at quick they are a floor that cannot show a drop. Full asks all seven.
SIZE_VARIANTS = {"quick": ("flat", "array", "enum", "key_order", "json_only"), "full": VARIANTS}

NAMES = ("Maria", "Kenji", "Amara", "Lukas", "Sofia", "Omar", "Ingrid", "Tomas", "Priya", "Diego", "Hana",
         "Felix", "Leila", "Marco", "Nadia", "Oscar", "Elena", "Samuel", "Yara", "Victor")
PLACES = (("Lyon", "France"), ("Osaka", "Japan"), ("Porto", "Portugal"), ("Cusco", "Peru"), ("Leeds", "England"),
          ("Graz", "Austria"), ("Tartu", "Estonia"), ("Krakow", "Poland"), ("Bergen", "Norway"),
          ("Seville", "Spain"), ("Turin", "Italy"), ("Ghent", "Belgium"), ("Daegu", "Korea"), ("Perth", "Australia"))
JOBS = ("engineer", "teacher", "nurse", "baker", "pilot", "lawyer", "farmer", "chemist", "architect", "librarian")
PRODUCTS = ("sofa", "laptop", "bicycle", "piano", "camera", "telescope", "boat", "tractor", "fridge", "drone")
PRIORITIES = ("low", "medium", "high")
CATEGORIES = {"billing": "a wrong invoice", "shipping": "a late delivery", "technical": "a login error",
              "account": "a forgotten password"}

STRING, INTEGER, NUMBER = ({"type": t} for t in ("string", "integer", "number"))


def _object(properties: dict[str, dict]) -> dict:
    """A closed object schema: every listed key required, no other key allowed."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _flat(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    name, (city, _), age = rng.choice(NAMES), rng.choice(PLACES), rng.randint(19, 78)
    texts = (f"{name} is {age} years old and lives in {city}.",
             f"Meet {name} from {city}, aged {age}.",
             f"{city} resident {name} turned {age} this year.")
    expected = {"name": name, "age": age, "city": city}
    return texts[template], _object({"name": STRING, "age": INTEGER, "city": STRING}), expected


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
    name, cities = rng.choice(NAMES), [city for city, _ in rng.sample(PLACES, rng.randint(2, 4))]
    listing = ", ".join(cities[:-1]) + f" and {cities[-1]}"
    texts = (f"On the trip, {name} visited {listing}.", f"Stops of {name}'s tour: {listing}.",
             f"{name} has offices in {listing}.")
    schema = _object({"person": STRING, "cities": {"type": "array", "minItems": 1, "items": STRING}})
    return texts[template], schema, {"person": name, "cities": cities}


def _enum(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    name, priority, category = rng.choice(NAMES), rng.choice(PRIORITIES), rng.choice(sorted(CATEGORIES))
    texts = (f"{name} reports {CATEGORIES[category]}. Priority: {priority}.",
             f"A {priority} priority ticket from {name} about {CATEGORIES[category]}.",
             f"[{priority.upper()}] {name}: {CATEGORIES[category]}.")
    schema = _object({"customer": STRING, "priority": {"type": "string", "enum": list(PRIORITIES)}})
    return texts[template], schema, {"customer": name, "priority": priority}


def _number(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    product = rng.choice(PRODUCTS)
    price = rng.randint(1000, 9999) + rng.choice((0, 0.5, 0.25, 0.99))
    texts = (f"The {product} costs ${price:,.2f}.", f"Price list: {product}, ${price:,.2f}.",
             f"We sold the {product} for {price:,.2f} dollars.")
    schema = _object({"product": STRING, "price_usd": NUMBER})
    return texts[template], schema, {"product": product, "price_usd": price}


def _key_order(rng: random.Random, template: int) -> tuple[str, dict, dict]:
    text, schema, expected = _flat(rng, template)
    keys = list(expected)
    while keys == list(expected):  # a stated order that differs from the text's natural one
        rng.shuffle(keys)
    ordered = {key: expected[key] for key in keys}
    return text, _object({key: schema["properties"][key] for key in keys}), ordered


VARIANT_BUILDERS: dict[str, Callable[[random.Random, int], tuple[str, dict, dict]]] = {
    "flat": _flat, "nested": _nested, "array": _array, "enum": _enum, "number": _number,
    "key_order": _key_order, "json_only": _flat,
}
TEMPLATES_PER_VARIANT = 3


def shape(schema: dict) -> str:
    """The schema's shape as compact pseudo-JSON: '{"name": string, "tags": [string, ...]}'."""
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    if schema["type"] == "object":
        return "{" + ", ".join(f"{json.dumps(key)}: {shape(sub)}" for key, sub in schema["properties"].items()) + "}"
    if schema["type"] == "array":
        return f"[{shape(schema['items'])}, ...]"
    return schema["type"]


def instruction(text: str, schema: dict, variant: str, show_schema: bool = False) -> str:
    lines = ["Extract the information from the text as a JSON object.", f"Text: {text}", f"Format: {shape(schema)}"]
    if show_schema:
        lines.append(f"JSON schema: {json.dumps(schema)}")
    if variant == "key_order":
        lines.append(f"Write the keys in exactly this order: {', '.join(schema['properties'])}.")
    if variant == "json_only":
        lines.append("Reply with the JSON object only: no explanation and no code fence.")
    return "\n".join(lines)


def items(size: str = "quick", seed: int = 1234, n_items: int | None = None, show_schema: bool = False,
          variants: list[str] | None = None, **_: Any) -> list[dict]:
    """The slice's items, variants in turn; every item carries id, sub_slice, stratum, cluster and gold_text.

    ``variants`` (slice metadata) overrides the size's variants, e.g. all seven at quick size.
    """
    if size not in SIZES:
        raise ValueError(f"structured slice: size={size!r} is unknown; use one of {sorted(SIZES)}")
    chosen = tuple(variants) if variants else SIZE_VARIANTS[size]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise ValueError(f"structured slice: variants {unknown} are unknown; use some of {list(VARIANTS)}")
    out: list[dict] = []
    for index in range(n_items if n_items is not None else SIZES[size]):
        variant = chosen[index % len(chosen)]
        rng = random.Random(f"structured/{seed}/{index}")
        template = rng.randrange(TEMPLATES_PER_VARIANT)
        text, schema, expected = VARIANT_BUILDERS[variant](rng, template)
        prompt = instruction(text, schema, variant, bool(show_schema))
        answer = json.dumps(expected)
        out.append({
            "id": f"structured-{seed}-{index:05d}",
            "sub_slice": variant,
            # stratum: the variant (a format the slice enumerates); cluster: the item (facts and phrasing drawn per item)
            "stratum": variant,
            "cluster": f"structured-{seed}-{index:05d}",
            "template": template,
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

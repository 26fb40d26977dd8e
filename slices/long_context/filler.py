"""Essay-like filler text for long-context haystacks, generated from word lists.

RULER's "repeat" haystack (one sentence repeated) is trivially compressible: a model can
attend to the needle because it is the only novel token span. This generator composes
varied sentences from templates and word lists, so every stretch of the haystack carries
fresh content (tens of thousands of distinct sentences), while staying deterministic:
the same ``random.Random`` gives the same text on every machine.

The vocabulary is kept apart from the needles' key words (``KEY_ADJECTIVES`` and
``KEY_NOUNS``), so a retrieval question never matches filler by accident.
"""
from __future__ import annotations

import random
import re

NAMES = (
    "Amelia", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ingrid", "Jonas",
    "Kasia", "Lorenzo", "Mira", "Nikolai", "Olga", "Pablo", "Quentin", "Rosa", "Samir", "Tamsin",
    "Ulrich", "Vera", "Wendell", "Ximena", "Yusuf", "Zelda", "Anton", "Beatrix", "Cyrus", "Delphine",
)
ROLES = (
    "baker", "engineer", "gardener", "historian", "librarian", "merchant", "navigator", "painter",
    "potter", "sailor", "scholar", "shepherd", "surveyor", "tailor", "teacher", "weaver", "carpenter",
    "cartographer", "clockmaker", "fisherman", "glassblower", "miller", "musician", "physician",
    "printer", "stonemason", "translator", "innkeeper", "beekeeper", "astronomer",
)
PLACES = (
    "the northern valley", "the old harbour", "a quiet village", "the river delta", "the market square",
    "the mountain pass", "a coastal town", "the eastern plains", "the university library",
    "a busy workshop", "the cathedral steps", "the salt marshes", "a hillside farm", "the city archive",
    "the railway station", "the pine forest", "a distant island", "the botanical garden",
    "the canal district", "the frozen lake",
)
OBJECTS = (
    "map", "lantern", "manuscript", "bridge", "garden", "ledger", "telescope", "violin", "compass",
    "tapestry", "orchard", "letter", "clock", "boat", "kiln", "loom", "well", "windmill", "almanac",
    "sketchbook", "barometer", "chapel", "granary", "fountain", "printing press", "herbarium",
    "music box", "sundial", "canoe", "quilt",
)
ADJECTIVES = (
    "ancient", "fragile", "heavy", "narrow", "curious", "weathered", "polished", "forgotten", "crowded",
    "silent", "bright", "dusty", "elaborate", "modest", "sturdy", "peculiar", "faded", "generous",
    "remote", "restless", "humble", "intricate", "rusty", "spacious", "tangled", "unfinished",
    "valuable", "wooden", "careful", "famous",
)
VERBS_PAST = (
    "repaired", "described", "carried", "studied", "measured", "painted", "rebuilt", "examined",
    "discovered", "borrowed", "sold", "copied", "cleaned", "guarded", "translated", "decorated",
    "catalogued", "restored", "photographed", "sketched", "admired", "questioned", "moved", "hid",
)
VERBS_BASE = (
    "repair", "describe", "carry", "study", "measure", "paint", "rebuild", "examine", "discover",
    "borrow", "sell", "copy", "clean", "guard", "translate", "decorate", "catalogue", "restore",
)
ADVERBS = (
    "slowly", "carefully", "quietly", "eagerly", "reluctantly", "patiently", "suddenly", "gladly",
    "hastily", "proudly", "cautiously", "nervously", "thoroughly", "cheerfully", "stubbornly",
)
TIMES = (
    "in the spring of that year", "before dawn", "after the long winter", "during the festival",
    "on a rainy afternoon", "late in the autumn", "at the turn of the century", "every other Sunday",
    "after the harvest", "in the weeks before the flood", "soon after the war", "on the first warm evening",
    "when the roads reopened", "at the end of the season", "in the middle of the night",
)
CONNECTORS = (
    "although", "because", "while", "even though", "since", "whereas", "as soon as", "until",
)
TOPICS = (
    "patience", "memory", "craftsmanship", "the weather", "old maps", "trade routes", "music",
    "handwriting", "local history", "the price of grain", "migrating birds", "family recipes",
    "forgotten songs", "the tides", "borrowed books", "letters from abroad", "winter storms",
    "the old calendar", "glass and sand", "river trade", "village festivals", "mountain paths",
    "the cost of timber", "distant relatives", "the night sky", "ink and paper",
)

TEMPLATES = (
    "The {adj} {role} from {place} {verb} the {adj2} {obj} {time}.",
    "{name} {verb} the {obj} {adv}, {conn} the {role} from {place} had warned against it.",
    "Nobody in {place} expected {name} to {base} the {adj} {obj} {time}.",
    "According to the {role}, the {obj} in {place} was {adj} and rather {adj2}.",
    "{time}, {name} and a {adj} {role} {verb} a {obj} near {place}.",
    "It is said that {name} once {verb} every {obj} in {place} {adv}.",
    "The story of the {adj} {obj} begins in {place}, where a {role} named {name} lived.",
    "{name} wrote at length about {topic}, {conn} the {role}s of {place} preferred to talk about {topic2}.",
    "When the {obj} was finally {verb}, the people of {place} gathered {adv} to see it.",
    "A {adj} {obj} and a {adj2} {obj2} were all that {name} left behind in {place}.",
    "Years later, the {role} still remembered how {name} {verb} the {obj} {time}.",
    "In {place}, {topic} mattered more than {topic2}, or so the {adj} {role} claimed.",
    "{name} asked the {role} whether the {obj} could be {verb} before {time2}.",
    "The {role}s of {place} {verb} the {obj} {adv} and argued about {topic} for hours.",
    "Few visitors to {place} noticed the {adj} {obj} that {name} had {verb} {time}.",
    "Some say the {obj} was never {verb} at all; others insist that {name} kept it in {place}.",
    "There is a {adj} {obj} in {place}, and the {role}s there speak of it {adv}.",
    "By the time {name} reached {place}, the {adj} {obj} had already been {verb}.",
    "{name} kept a {adj} notebook about {topic}, full of remarks on the {obj}s of {place}.",
    "Why the {role} {verb} the {obj} {time} is still debated in {place}.",
    "Travellers from {place} brought news of {topic}, and {name} listened {adv}.",
    "The {obj} that {name} {verb} was {adj}, but the {obj2} beside it was even more {adj2}.",
    "Most {role}s in {place} agree that {topic} and {topic2} are closely related.",
    "{time}, the {adj} {obj} was {verb} again, this time by a {role} who knew {name}.",
    "{name} once told a {role} that {topic} was the only thing worth studying in {place}.",
)


_ARTICLE = re.compile(r"\b([Aa]) ([aeiou])")


def sentence(rng: random.Random) -> str:
    """One filler sentence; every slot is drawn independently."""
    template = rng.choice(TEMPLATES)
    obj, obj2 = rng.sample(OBJECTS, 2)
    adj, adj2 = rng.sample(ADJECTIVES, 2)
    topic, topic2 = rng.sample(TOPICS, 2)
    time, time2 = rng.sample(TIMES, 2)
    text = template.format(
        name=rng.choice(NAMES), role=rng.choice(ROLES), place=rng.choice(PLACES), obj=obj, obj2=obj2,
        adj=adj, adj2=adj2, verb=rng.choice(VERBS_PAST), base=rng.choice(VERBS_BASE), adv=rng.choice(ADVERBS),
        time=time, time2=time2, conn=rng.choice(CONNECTORS), topic=topic, topic2=topic2)
    text = _ARTICLE.sub(lambda m: m.group(1) + "n " + m.group(2), text)
    return text[0].upper() + text[1:]


def sentences(rng: random.Random, count: int) -> list[str]:
    """``count`` filler sentences, drawn one after another from ``rng``."""
    return [sentence(rng) for _ in range(count)]


# Needle keys and variable names use words that never occur in the filler.
KEY_ADJECTIVES = (
    "amber", "brisk", "cobalt", "dapper", "emerald", "frosty", "gilded", "hollow", "ivory", "jagged",
    "lucky", "mellow", "nimble", "opal", "plucky", "quaint", "rosy", "scarlet", "tawny", "velvet",
)
KEY_NOUNS = (
    "falcon", "otter", "walrus", "heron", "badger", "lynx", "panther", "gecko", "marmot", "ibis",
    "jackal", "koala", "lemur", "narwhal", "ocelot", "puffin", "raven", "tapir", "viper", "yak",
)


def needle_keys(rng: random.Random, count: int, *, confusable: bool = False) -> list[str]:
    """``count`` distinct keys such as 'cobalt-heron'; ``confusable`` keys share their noun
    ('cobalt-heron', 'amber-heron', ...), so only the exact key identifies the needle."""
    if confusable:
        noun = rng.choice(KEY_NOUNS)
        return [f"{adjective}-{noun}" for adjective in rng.sample(KEY_ADJECTIVES, count)]
    pairs = rng.sample([(a, n) for a in KEY_ADJECTIVES for n in KEY_NOUNS], count)
    return [f"{adjective}-{noun}" for adjective, noun in pairs]

"""A generated world of invented entities: the Deep Search corpus and its questions.

No Wikipedia or NQ/HotpotQA file can be fetched here, so the environment ships a small world whose
facts exist only in its own passages: no real-world knowledge answers a question, and the generator
is deterministic byte for byte (one seeded `random.Random`, no set iteration), so the committed files
in `envs/deepsearch/data` are exactly what `python -m envs.deepsearch.synthetic --out DIR` writes.

Entities. Every name is built from invented syllables (`_Names`), with endings by kind (cities end
like "Tarvenek", countries like "Ostrevia"); each word of a name is unique across the world (given
names of people excepted), at least 4 letters, never an English template word, and no two names
are equal after SQuAD normalisation. Kinds and their facts, all consistent with each other:
- country (60): a capital (one of its cities), a currency ("Tovar florin"), neighbours, its rivers;
- city (6 per country): its country, the river it lies on (one of its country's rivers), a
  charter year, a twin city; capitals say so;
- river (2 per country, "Velna River"): the country it rises in, the sea it flows into, the cities
  on it; sea (14, "Korlan Sea"): the countries and rivers around it;
- person (1,200, "Kelvane Oriss": a shared given name, a unique surname): birth city and year
  (1750-1949), occupation, 70% a university, 60% a death city and year (aged 60-95, up to 2020,
  so after every other date of the life); 450 are founders of one company each, 285 writers,
  composers or painters of 1-3 works each, and half the rest "joined" a company;
- company (450, "Oriveth Lines"): industry, headquarters city, founder and year (the founder aged
  25-59), offices in other cities, a competitor; university (100, "Velmora University"): city,
  year established, alumni;
- work (novel, play, poem, opera, symphony, painting): its creator (of the matching occupation),
  the year it was published, first performed or completed (the creator aged 20-59), a city;
- event (150) and prize (40): passages that only mention people, companies and cities.

Passages. One per entity, the title its name: `{"id": "<n>", "contents": "<Title>\\n<text>"}`, ids
numbered after a seeded shuffle. The text is 2-5 sentences from `SENTENCES`, one seeded variant per
fact, a fact written only when the entity has it; a person is named in full in the first sentence
and by surname after. Several sentences are distractors for a reader: a second city and year in a
person's passage (death), a company's other offices, a city's twin, a country's neighbours, and
every passage that mentions an entity without being about it (founders, alumni, events, prizes).

Questions. `RELATIONS` are the facts a question may ask (its phrasings, the scripted search query
for it, the kind of entity it is about); a single-hop question asks one, a two-hop one
(`TWOHOP_QUESTIONS`) composes two through a bridge entity, e.g. founder then birth city: "In which
city was the founder of Oriveth Lines born?". Every relation is a function (one founder, one birth
city), so the bridge is unique. Golden answers: the canonical answer plus an alias where natural (a
person's surname; the stem of a river, sea or university). `metadata.hops` lists per hop the
scripted query (the subject's name plus words of the gold sentence), the gold passage's id, the
relation and its answer: hop 2's query contains hop 1's answer. Types are drawn round-robin; the
test questions are drawn first, and no train question shares any hop's (entity, relation) with a
test question. Files: `single/{train,test}.jsonl`, `twohop/{train,test}.jsonl` (ids `<split>_<n>`,
numbered through a split's files in `layout.json`'s order), `corpus.jsonl`, `layout.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SIZES = {("single", "train"): 400, ("twohop", "train"): 300, ("single", "test"): 100, ("twohop", "test"): 100}
LAYOUT = [{"source": "single", "file": "single/train.jsonl", "split": "train"},
          {"source": "twohop", "file": "twohop/train.jsonl", "split": "train"},
          {"source": "single", "file": "single/test.jsonl", "split": "test"},
          {"source": "twohop", "file": "twohop/test.jsonl", "split": "test"}]

N_COUNTRIES, CITIES_PER_COUNTRY, RIVERS_PER_COUNTRY, N_SEAS = 60, 6, 2, 14
N_PEOPLE, N_COMPANIES, N_UNIVERSITIES, N_EVENTS, N_PRIZES = 1200, 450, 100, 150, 40
WORKS = {"novel": 170, "play": 70, "poem": 60, "opera": 60, "symphony": 60, "painting": 150}
CREATOR = {"novel": "novelist", "play": "playwright", "poem": "poet", "opera": "composer", "symphony": "composer",
           "painting": "painter"}
FOUNDER_JOBS = ["industrialist", "merchant", "engineer", "banker", "shipbuilder", "inventor"]
OTHER_JOBS = ["physician", "astronomer", "botanist", "architect", "lawyer", "chemist", "mathematician",
              "historian", "surgeon", "cartographer", "diplomat"]
INDUSTRIES = ["shipping", "textile", "mining", "publishing", "brewing", "railway", "insurance", "glassmaking",
              "steel", "timber", "porcelain", "banking"]
COMPANY_SUFFIXES = ["Company", "Works", "Group", "Industries", "Holdings", "Trading", "Mills", "Lines"]
CURRENCY_UNITS = ["crown", "florin", "mark", "thaler", "ducat", "shilling"]
EVENT_KINDS = ["Exhibition", "Congress", "Festival", "Fair"]
PRIZE_FIELDS = {"literature": ["novelist", "playwright", "poet"], "music": ["composer"], "painting": ["painter"],
                "medicine": ["physician", "surgeon", "chemist"], "science": ["astronomer", "botanist", "mathematician"],
                "industry": FOUNDER_JOBS}

# Sentences per entity kind: (fact, variants). A variant's slots are the entity's attributes; a slot
# named after a relation holds that relation's answer, so a reader finds it with the same template.
SENTENCES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "person": [
        ("birth", ("{s} was born in {birth_city} in {birth_year}.",
                   "{s} was born in {birth_year} in the city of {birth_city}.")),
        ("occupation", ("{s} worked as {occupation}.", "{s} was {occupation} by profession.")),
        ("education", ("{s} studied at {studied_at}.", "{s} studied at {studied_at} for several years.")),
        ("founded", ("In {founded_year}, {s} founded {founded}.",)),
        ("work", ("{s} is best known for the {work_kind} {work}.",)),
        ("joined", ("{s} joined {joined} in {joined_year}.",)),
        ("death", ("{s} died in {death_city} in {death_year}.", "{s} died in {death_year} in {death_city}.")),
    ],
    "company": [
        ("headquarters", ("{s} is {industry} company headquartered in {headquarters}.",
                          "{s}, {industry} company, is headquartered in {headquarters}.")),
        ("founding", ("{s} was founded by {founder} in {founding_year}.",
                      "{s} was founded in {founding_year} by {founder}.")),
        ("offices", ("{s} also has offices in {office1} and {office2}.",)),
        ("competitor", ("Its main competitor is {competitor}.",)),
    ],
    "university": [
        ("city", ("{s} is a university based in {university_city}.",
                  "{s} is a public university based in {university_city}.")),
        ("established", ("{s} was established in {established_year}.",)),
        ("alumni", ("Its alumni include {alumnus1} and {alumnus2}.",)),
    ],
    "city": [
        ("country", ("{s} is a city located in {country}.", "{s} is a port city located in {country}.")),
        ("capital", ("{s} is the capital of {capital_of}.",)),
        ("river", ("{s} lies on the {river}.", "{s} lies on the banks of the {river}.")),
        ("charter", ("{s} received its town charter in {charter_year}.",)),
        ("twin", ("{s} is twinned with {twin}.",)),
    ],
    "country": [
        ("capital", ("The capital of {s} is {capital}.", "{s} has its capital at {capital}.")),
        ("currency", ("The currency of {s} is the {currency}.", "{s} uses the {currency} as its currency.")),
        ("borders", ("{s} borders {neighbour1} and {neighbour2}.",)),
        ("longest", ("The longest river in {s} is the {longest_river}.",)),
    ],
    "river": [
        ("source", ("The {s} rises in {source_country}.", "The {s} rises in the hills of {source_country}.")),
        ("mouth", ("The {s} flows into the {mouth_sea}.",
                   "The {s} flows for {length} kilometres into the {mouth_sea}.")),
        ("cities", ("Cities on the {s} include {on1} and {on2}.",)),
    ],
    "sea": [
        ("coast", ("The {s} is a sea bordering {coast1} and {coast2}.",)),
        ("rivers", ("Rivers flowing into the {s} include the {inflow1} and the {inflow2}.",)),
    ],
    "work": [
        ("written", ("{s} is {work_kind} written by {written_by}.", "{s}, {work_kind}, was written by {written_by}.")),
        ("published", ("{s} was first published in {published_year}.", "{s} was published in {published_year}.")),
        ("composed", ("{s} is {work_kind} composed by {composed_by}.",
                      "{s}, {work_kind}, was composed by {composed_by}.")),
        ("premiere", ("{s} was first performed in {premiere_year}.",
                      "{s} was performed for the first time in {premiere_year}.")),
        ("painted", ("{s} was painted by {painted_by}.", "{s}, an oil painting, was painted by {painted_by}.")),
        ("completed", ("{s} was completed in {painting_year}.",)),
        ("setting", ("The story is set in {setting}.",)),
        ("premiere_city", ("It premiered in {premiere_city}.",)),
        ("gallery", ("It hangs in a gallery in {gallery_city}.",)),
    ],
    "event": [
        ("held", ("The {s} was held in {event_city} in {event_year}.",)),
        ("participants", ("Participants included {participant1} and {participant2}.",)),
        ("address", ("The opening address was given by {speaker}.",)),
    ],
    "prize": [
        ("field", ("The {s} is awarded for achievement in {field}.",)),
        ("recipients", ("Recipients have included {recipient1}, {recipient2} and {recipient3}.",)),
    ],
}


@dataclasses.dataclass(frozen=True)
class Relation:
    """A fact a question may ask: `subject` the kind of entity it is about, `answer` the kind of its
    answer ("year" or an entity kind), `query` the scripted search ("{s}": the subject's name, with
    words of the gold sentence), `questions` its single-hop phrasings ("{e}": the subject's name,
    "{kind}": a work's kind)."""

    subject: str
    answer: str
    query: str
    questions: tuple[str, ...]


RELATIONS: dict[str, Relation] = {
    "birth_city": Relation("person", "city", "{s} born", ("In which city was {e} born?", "Where was {e} born?")),
    "birth_year": Relation("person", "year", "{s} born", ("In what year was {e} born?", "When was {e} born?")),
    "death_city": Relation("person", "city", "{s} died", ("In which city did {e} die?", "Where did {e} die?")),
    "studied_at": Relation("person", "university", "{s} studied",
                           ("At which university did {e} study?", "Where did {e} study?")),
    "founder": Relation("company", "person", "{s} founded by", ("Who founded {e}?", "Who was the founder of {e}?")),
    "founding_year": Relation("company", "year", "{s} founded", ("In what year was {e} founded?",
                                                                  "When was {e} founded?")),
    "headquarters": Relation("company", "city", "{s} headquartered",
                             ("In which city is {e} headquartered?", "Where is {e} headquartered?")),
    "university_city": Relation("university", "city", "{s} based", ("In which city is {e} based?",
                                                                     "Where is {e} based?")),
    "established_year": Relation("university", "year", "{s} established", ("In what year was {e} established?",)),
    "country": Relation("city", "country", "{s} located", ("In which country is {e} located?",
                                                            "In which country does {e} lie?")),
    "river": Relation("city", "river", "{s} lies on river", ("On which river does {e} lie?",
                                                             "Which river flows through {e}?")),
    "capital": Relation("country", "city", "capital of {s}", ("What is the capital of {e}?",
                                                              "Which city is the capital of {e}?")),
    "currency": Relation("country", "currency", "{s} currency", ("What is the currency of {e}?",
                                                                 "Which currency is used in {e}?")),
    "source_country": Relation("river", "country", "{s} rises", ("In which country does the {e} rise?",
                                                                 "Where does the {e} rise?")),
    "mouth_sea": Relation("river", "sea", "{s} flows into", ("Into which sea does the {e} flow?",)),
    "written_by": Relation("work", "person", "{s} written by", ("Who wrote the {kind} {e}?",
                                                                "Who is the author of the {kind} {e}?")),
    "published_year": Relation("work", "year", "{s} published", ("In what year was the {kind} {e} first published?",
                                                                 "When was the {kind} {e} first published?")),
    "composed_by": Relation("work", "person", "{s} composed by", ("Who composed the {kind} {e}?",
                                                                  "Who is the composer of the {kind} {e}?")),
    "premiere_year": Relation("work", "year", "{s} first performed",
                              ("In what year was the {kind} {e} first performed?",)),
    "painted_by": Relation("work", "person", "{s} painted by", ("Who painted {e}?", "Which artist painted {e}?")),
    "painting_year": Relation("work", "year", "{s} completed", ("In what year was the painting {e} completed?",)),
}

# (relation of hop 1, relation of hop 2) -> phrasings; hop 1's answer is hop 2's subject.
TWOHOP_QUESTIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("founder", "birth_city"): ("In which city was the founder of {e} born?", "Where was the founder of {e} born?"),
    ("founder", "birth_year"): ("In what year was the founder of {e} born?",),
    ("founder", "studied_at"): ("At which university did the founder of {e} study?",),
    ("headquarters", "country"): ("In which country is {e} headquartered?",
                                  "In which country is the headquarters of {e}?"),
    ("headquarters", "river"): ("On which river lies the city where {e} is headquartered?",),
    ("written_by", "birth_city"): ("In which city was the author of the {kind} {e} born?",),
    ("written_by", "birth_year"): ("In what year was the author of the {kind} {e} born?",),
    ("composed_by", "birth_city"): ("In which city was the composer of the {kind} {e} born?",),
    ("composed_by", "studied_at"): ("At which university did the composer of the {kind} {e} study?",),
    ("painted_by", "birth_city"): ("In which city was the painter of {e} born?",
                                   "Where was the artist who painted {e} born?"),
    ("birth_city", "country"): ("In which country was {e} born?",),
    ("birth_city", "river"): ("On which river lies the city where {e} was born?",
                              "On which river is the birthplace of {e}?"),
    ("death_city", "country"): ("In which country did {e} die?",),
    ("studied_at", "university_city"): ("In which city is the university where {e} studied?",),
    ("university_city", "country"): ("In which country does {e} have its campus?",),
    ("country", "capital"): ("What is the capital of the country in which {e} lies?",
                             "What is the capital of the country where {e} is located?"),
    ("country", "currency"): ("What currency is used in the country where {e} is located?",),
    ("capital", "river"): ("On which river does the capital of {e} lie?",),
    ("river", "mouth_sea"): ("Into which sea does the river through {e} flow?",),
}

# Syllables of invented names: endings by kind make them readable as places, people or titles.
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "tr",
           "th", "st", "sk", "vr", "h", "j"]
_VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ae", "ei", "ou"]
_CODAS = ["", "", "", "n", "r", "l", "s", "rn", "nd", "m"]
_ENDINGS = {"country": ["ia", "ova", "esh", "and", "ark"], "city": ["ek", "oth", "arn", "ira", "esk", "avel", "ouk"],
            "river": ["a", "e", "in", "ul"], "sea": ["an", "ic", "or"], "given": ["el", "a", "ion", "is", "ane", "o"],
            "surname": ["ss", "ck", "n", "rd", "lt", "vik"], "stem": ["eth", "ar", "ora", "ix", "und", "ane"],
            "title": ["ine", "elle", "ar", "oum", "ith", "a"]}


class _Names:
    """Unique invented words: no word is handed out twice, so names stay distinct after
    normalisation and are distinctive BM25 tokens."""

    def __init__(self, rng: random.Random, reserved: set[str]):
        self.rng, self.used = rng, set(reserved)

    def word(self, kind: str) -> str:
        while True:
            syllables = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                         for _ in range(2)]
            if self.rng.random() < 0.2:  # a vowel-initial name
                syllables[0] = syllables[0].lstrip("bdfgklmnprstvzhj")
            body, ending = "".join(syllables), self.rng.choice(_ENDINGS[kind])
            word = (body + ending).capitalize()
            # Readable: no three consonants or vowels in a row, no doubled letter but an ending's
            # ("Oriss"). Two syllables and an ending keep clear of short real words ("Ground", "Diane").
            lower = word.lower()
            if (len(word) <= 11 and lower not in self.used and not re.search(r"[^aeiou]{3}|[aeiou]{3}", lower)
                    and not re.search(r"(.)\1", lower[:len(body)] + ending[0])):
                self.used.add(lower)
                return word


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


@dataclasses.dataclass
class _Maker:
    """What every part of the world is drawn with: the one seeded rng, the name source, and the
    world the entities land in (by name)."""

    rng: random.Random
    names: _Names
    world: dict[str, dict] = dataclasses.field(default_factory=dict)

    def add(self, kind: str, name: str, **attrs) -> dict:
        assert name not in self.world, name
        self.world[name] = {"kind": kind, "name": name, **attrs}
        return self.world[name]


def _world(rng: random.Random) -> dict[str, dict]:
    """Every entity by name: {"kind", "name", "short"?, attributes...}; facts refer to names.
    The parts are drawn in this order from the one rng: changing it changes every file."""
    template_words = {w.lower() for kind in SENTENCES.values() for _, variants in kind for v in variants
                      for w in re.findall(r"[A-Za-z]+", re.sub(r"\{\w+\}", " ", v))}
    make = _Maker(rng, _Names(rng, template_words))
    cities = _geography(make)
    universities = [make.add("university", make.names.word("stem") + " University",
                             university_city=rng.choice(cities)["name"], established_year=str(rng.randint(1400, 1900)))
                    for _ in range(N_UNIVERSITIES)]
    people = _people(make, cities, universities)
    companies = _companies(make, people, cities)
    _works(make, people, cities)
    _events_and_prizes(make, people, companies, cities)
    return make.world


def _geography(make: _Maker) -> list[dict]:
    """Seas, countries, their rivers and cities (the cities returned), neighbours and twins."""
    rng, names, add = make.rng, make.names, make.add
    seas = [add("sea", names.word("sea") + " Sea") for _ in range(N_SEAS)]
    countries = [add("country", names.word("country"), currency=f"{names.word('stem')} {rng.choice(CURRENCY_UNITS)}")
                 for _ in range(N_COUNTRIES)]
    cities, rivers = [], []
    for country in countries:
        own_rivers = [add("river", names.word("river") + " River", source_country=country["name"],
                          mouth_sea=rng.choice(seas)["name"], length=str(rng.randrange(80, 1900, 10)))
                      for _ in range(RIVERS_PER_COUNTRY)]
        own_cities = [add("city", names.word("city"), country=country["name"], river=rng.choice(own_rivers)["name"],
                          charter_year=str(rng.randint(1100, 1700))) for _ in range(CITIES_PER_COUNTRY)]
        own_cities[0]["capital_of"] = country["name"]
        country.update(capital=own_cities[0]["name"], longest_river=own_rivers[0]["name"])
        for river in own_rivers:
            on = [c["name"] for c in own_cities if c["river"] == river["name"]]
            if len(on) >= 2:
                river.update(on1=on[0], on2=on[1])
        rivers += own_rivers
        cities += own_cities
    for country in countries:
        country["neighbour1"], country["neighbour2"] = (c["name"] for c in rng.sample(
            [c for c in countries if c is not country], 2))
    for city in cities:
        if rng.random() < 0.4:
            city["twin"] = rng.choice([c for c in cities if c["country"] != city["country"]])["name"]
    for sea in seas:
        inflows = [r for r in rivers if r["mouth_sea"] == sea["name"]]
        coasts = list(dict.fromkeys(r["source_country"] for r in inflows))
        assert len(inflows) >= 2 and len(coasts) >= 2, "every sea needs two rivers and two coasts for its passage"
        sea.update(inflow1=inflows[0]["name"], inflow2=inflows[1]["name"], coast1=coasts[0], coast2=coasts[1])
    return cities


def _people(make: _Maker, cities: list[dict], universities: list[dict]) -> list[dict]:
    """Everyone, founders first, then creators, then the other occupations; and each university's
    first two students as its named alumni."""
    rng, names = make.rng, make.names
    given = [names.word("given") for _ in range(200)]
    jobs = ([rng.choice(FOUNDER_JOBS) for _ in range(N_COMPANIES)]
            + [CREATOR[k] for k, n in WORKS.items() for _ in range(n // 2)])
    jobs += [rng.choice(OTHER_JOBS) for _ in range(N_PEOPLE - len(jobs))]
    people = []
    for job in jobs:
        surname = names.word("surname")
        person = make.add("person", f"{rng.choice(given)} {surname}", short=surname, occupation=_article(job), job=job,
                          birth_city=rng.choice(cities)["name"], birth_year=str(rng.randint(1750, 1949)))
        if rng.random() < 0.7:
            person["studied_at"] = rng.choice(universities)["name"]
        # Dying at 60 or later comes after any founding, work or post (at most at 59); none after 2020.
        death_year = int(person["birth_year"]) + rng.randint(60, 95)
        if rng.random() < 0.6 and death_year <= 2020:
            person.update(death_city=rng.choice([c for c in cities if c["name"] != person["birth_city"]])["name"],
                          death_year=str(death_year))
        people.append(person)
    for person in people:
        if person.get("studied_at"):
            university = make.world[person["studied_at"]]
            university.setdefault("alumnus1" if "alumnus1" not in university else "alumnus2", person["name"])
    return people


def _companies(make: _Maker, people: list[dict], cities: list[dict]) -> list[dict]:
    """A company per founder, some competitors, and half the other occupations' posts at one."""
    rng = make.rng
    companies = []
    for founder in (p for p in people if p["job"] in FOUNDER_JOBS):
        year = str(int(founder["birth_year"]) + rng.randint(25, 59))
        industry = rng.choice(INDUSTRIES)
        company = make.add("company", f"{make.names.word('stem')} {rng.choice(COMPANY_SUFFIXES)}",
                           industry=_article(industry), headquarters=rng.choice(cities)["name"],
                           founder=founder["name"], founding_year=year)
        if rng.random() < 0.5:
            company["office1"], company["office2"] = (c["name"] for c in rng.sample(
                [c for c in cities if c["name"] != company["headquarters"]], 2))
        founder.update(founded=company["name"], founded_year=year)
        companies.append(company)
    for company in companies:
        if rng.random() < 0.4:
            company["competitor"] = rng.choice([c for c in companies if c is not company])["name"]
    for person in people:
        if person["job"] in OTHER_JOBS and rng.random() < 0.5:
            person.update(joined=rng.choice(companies)["name"],
                          joined_year=str(int(person["birth_year"]) + rng.randint(18, 50)))
    return companies


def _works(make: _Maker, people: list[dict], cities: list[dict]) -> None:
    rng = make.rng
    for kind, count in WORKS.items():
        creators = [p for p in people if p["job"] == CREATOR[kind]]
        for i in range(count):
            # Every creator has a work; the rest go to creators at random, so some have 2-3.
            creator = creators[i] if i < len(creators) else rng.choice(creators)
            words = [make.names.word("title") for _ in range(rng.choice([1, 1, 2]))]
            title = " ".join(words) + (" Symphony" if kind == "symphony" else "")
            year = str(int(creator["birth_year"]) + rng.randint(20, 59))
            city = rng.choice(cities)["name"]
            work = make.add("work", title, kind_noun=kind, work_kind=_article(kind))
            if kind in ("novel", "play", "poem"):
                work.update(written_by=creator["name"], published_year=year, setting=city)
            elif kind in ("opera", "symphony"):
                work.update(composed_by=creator["name"], premiere_year=year, premiere_city=city)
            else:
                work.update(painted_by=creator["name"], painting_year=year, gallery_city=city)
            if "work" not in creator:
                creator.update(work=title, work_kind=kind)


def _events_and_prizes(make: _Maker, people: list[dict], companies: list[dict], cities: list[dict]) -> None:
    """Passages that only mention people, companies and cities."""
    rng, names = make.rng, make.names
    participants = people + companies
    for _ in range(N_EVENTS):
        a, b = rng.sample(participants, 2)
        event = make.add("event", f"{names.word('stem')} {rng.choice(EVENT_KINDS)}",
                         event_city=rng.choice(cities)["name"], event_year=str(rng.randint(1800, 1990)),
                         participant1=a["name"], participant2=b["name"])
        if rng.random() < 0.5:
            event["speaker"] = rng.choice(people)["name"]
    for _ in range(N_PRIZES):
        field = rng.choice(sorted(PRIZE_FIELDS))
        recipients = rng.sample([p for p in people if p["job"] in PRIZE_FIELDS[field]], 3)
        make.add("prize", f"{names.word('stem')} Prize", field=field,
                 **{f"recipient{i}": p["name"] for i, p in enumerate(recipients, 1)})


def _passage_text(entity: dict, rng: random.Random) -> str:
    sentences = []
    for _, variants in SENTENCES[entity["kind"]]:
        usable = [v for v in variants if all(entity.get(slot) for slot in _slots(v) if slot != "s")]
        if usable:
            # A person is named in full first, then by surname, as an encyclopedia does.
            subject = entity["name"] if not sentences else entity.get("short", entity["name"])
            sentences.append(rng.choice(usable).format(s=subject, **entity))
    return " ".join(sentences)


def _slots(template: str) -> list[str]:
    return re.findall(r"\{(\w+)\}", template)


def _aliases(world: dict, answer: str) -> list[str]:
    entity = world.get(answer)  # a year or a currency is no entity
    if entity is None:
        return [answer]
    if entity["kind"] == "person":
        return [answer, entity["short"]]
    if entity["kind"] in ("river", "sea", "university"):
        return [answer, answer.split()[0]]
    return [answer]


def _questions(world: dict, passage_ids: dict[str, str], rng: random.Random) -> dict[tuple[str, str], list[dict]]:
    """The question rows (no id yet) per (source, split). A candidate is a chain of hop keys
    [(subject, relation), ...]; a pool holds one question type's."""
    def hop(subject: str, relation: str) -> dict:
        return {"query": RELATIONS[relation].query.format(s=subject), "passage_id": passage_ids[subject],
                "relation": relation, "answer": world[subject][relation]}

    def phrase(templates: tuple[str, ...], subject: str) -> str:
        return rng.choice(templates).format(e=subject, kind=world[subject].get("kind_noun", ""))

    pools: dict[str, dict[str, list]] = {"single": {}, "twohop": {}}
    entities = list(world.values())
    for relation, spec in RELATIONS.items():
        pools["single"][relation] = [[(e["name"], relation)] for e in entities
                                     if e["kind"] == spec.subject and e.get(relation)]
    for (first, second) in TWOHOP_QUESTIONS:
        pools["twohop"][f"{first}+{second}"] = [
            [(e["name"], first), (e[first], second)] for e in entities
            if e["kind"] == RELATIONS[first].subject and e.get(first) and world[e[first]].get(second)
            # "the capital of the country in which X lies" must not be X itself
            and not (second == "capital" and world[e[first]]["capital"] == e["name"])]
    for by_type in pools.values():
        for pool in by_type.values():
            rng.shuffle(pool)

    out: dict[tuple[str, str], list[dict]] = {}
    test_keys: set[tuple[str, str]] = set()
    for split in ("test", "train"):
        for source in ("single", "twohop"):
            chains = _round_robin(pools[source], SIZES[source, split],
                                  lambda chain: split == "train" and any(k in test_keys for k in chain))
            if split == "test":
                test_keys.update(k for chain in chains for k in chain)
            rows = []
            for chain in chains:
                hops = [hop(subject, relation) for subject, relation in chain]
                subject = chain[0][0]
                templates = RELATIONS[chain[0][1]].questions if source == "single" else TWOHOP_QUESTIONS[
                    tuple(r for _, r in chain)]
                rows.append({"question": phrase(templates, subject),
                             "golden_answers": _aliases(world, hops[-1]["answer"]),
                             "metadata": {"hops": hops, "type": source}})
            out[source, split] = rows
    return out


def _round_robin(pools: dict[str, list], n: int, excluded) -> list:
    """Up to n chains, one type at a time in turn; a chosen chain leaves its pool, so the two
    splits never draw the same question."""
    chosen: list = []
    types = list(pools)
    while len(chosen) < n and types:
        for name in list(types):
            pool = pools[name]
            while pool and excluded(pool[-1]):
                pool.pop()
            if not pool:
                types.remove(name)
                continue
            chosen.append(pool.pop())
            if len(chosen) == n:
                break
    return chosen


def _dump(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def generate(out_dir: str, seed: int = 0) -> dict:
    """Writes the corpus, the question files and layout.json into `out_dir`; returns the counts."""
    rng = random.Random(seed)
    world = _world(rng)
    entities = list(world.values())
    rng.shuffle(entities)
    passage_ids = {e["name"]: str(i) for i, e in enumerate(entities)}
    corpus = [{"id": passage_ids[e["name"]], "contents": e["name"] + "\n" + _passage_text(e, rng)} for e in entities]
    questions = _questions(world, passage_ids, rng)
    _dump(os.path.join(out_dir, "corpus.jsonl"), corpus)
    counts = {"passages": len(corpus)}
    for split in ("train", "test"):
        number = 0
        for entry in (e for e in LAYOUT if e["split"] == split):
            rows = questions[entry["source"], split]
            rng.shuffle(rows)
            rows = [{"id": f"{split}_{number + i}", **row} for i, row in enumerate(rows)]
            number += len(rows)
            _dump(os.path.join(out_dir, entry["file"]), rows)
            counts[entry["file"]] = len(rows)
    with open(os.path.join(out_dir, "layout.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(LAYOUT, indent=2) + "\n")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DATA_DIR, help="directory to write (default: the shipped data directory)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(generate(args.out, args.seed)))


if __name__ == "__main__":
    main()

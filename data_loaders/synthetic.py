"""A synthetic biography corpus in the CS224N format: the embedded default when no corpus is given.

A seeded generator of fictional people: made-up names built from syllables in ten naming styles, each
born in a real place of a region that usually (not always) matches the style of the name, and one
sentence about each in varied templates that put the birthplace in different positions, sometimes next
to a second place that is not the birthplace, and for about one person in twenty not at all (as in
wiki.txt, where 4.2% of dev lines lack the answer). Files mirror the CS224N ones: a corpus with one line
per person, titled with the name as wiki.txt's lines are (`Name. sentence`; train people, then dev, then
test, as wiki.txt is aligned), and train/dev/test TSVs over disjoint people; the test TSV holds questions
only.
"""

import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

GENERATOR_VERSION = 3
DEFAULT_NUM_PEOPLE = 300

REGIONS = {
    "british": dict(
        weight=0.20,
        places=["London"] * 5 + ["Manchester", "Glasgow", "Edinburgh", "Liverpool", "Dublin", "Birmingham", "Cardiff"],
        first=(
            ["Al", "Ber", "Cla", "Ed", "Ger", "Har", "Hen", "Mar", "Reg", "Wil", "Eve", "Ros"],
            ["bert", "ric", "ald", "ton", "win", "ford", "la", "ley", "ette", "wyn"],
        ),
        last=(
            ["Ash", "Black", "Brad", "Crom", "Fair", "Hal", "Kings", "Pen", "Thorn", "Whit"],
            ["bury", "combe", "field", "ham", "ington", "ley", "more", "ridge", "worth", "stead"],
        ),
    ),
    "american": dict(
        weight=0.15,
        places=["New York City"] * 3 + ["Chicago", "Boston", "Philadelphia", "Toronto", "Los Angeles", "Sydney"],
        first=(
            ["Brad", "Chan", "Dex", "Jor", "Kay", "Mad", "Shel", "Tay", "Zach", "Brook"],
            ["ley", "dler", "ter", "dan", "la", "ison", "by", "lor", "lyn", "den"],
        ),
        last=(
            ["Ban", "Col", "Dun", "Gar", "Hol", "Mer", "Red", "Sum", "Wal", "Hart"],
            ["croft", "lins", "kirk", "rett", "brook", "wether", "ford", "mers", "dron", "well"],
        ),
    ),
    "french": dict(
        weight=0.10,
        places=["Paris"] * 3 + ["Lyon", "Marseille", "Bordeaux", "Montreal", "Brussels"],
        first=(
            ["Aur", "Bap", "Cé", "Dom", "Fran", "Gis", "Hon", "Jul", "Lé", "Ren"],
            ["elle", "ien", "ine", "ois", "ette", "and", "ard", "ice", "on", "aud"],
        ),
        last=(
            ["Beau", "Char", "Duc", "Fon", "Gar", "La", "Mont", "Rou", "Ver", "Mar"],
            ["chard", "det", "geot", "lier", "mont", "nier", "reau", "tel", "vin", "zac"],
        ),
    ),
    "german": dict(
        weight=0.10,
        places=["Berlin"] * 2 + ["Munich", "Vienna", "Hamburg", "Zurich", "Frankfurt"],
        first=(
            ["Ad", "Bern", "Dit", "Fried", "Gun", "Hein", "Kon", "Lud", "Ot", "Wal"],
            ["bert", "hard", "mar", "olf", "rich", "run", "ter", "trud", "helm", "fried"],
        ),
        last=(
            ["Bau", "Eich", "Falk", "Hof", "Kalt", "Lind", "Rot", "Stein", "Wald", "Zim"],
            ["bach", "berg", "brenner", "feld", "hauser", "mann", "meier", "müller", "stadt", "wald"],
        ),
    ),
    "italian": dict(
        weight=0.08,
        places=["Rome"] * 2 + ["Milan", "Naples", "Florence", "Turin", "Venice"],
        first=(
            ["Al", "Bea", "Car", "Fab", "Gian", "Lo", "Mas", "Ric", "Sal", "Vit"],
            ["ando", "essa", "ino", "ella", "ario", "enzo", "iana", "one", "ilde", "ello"],
        ),
        last=(
            ["Bel", "Cal", "Del", "Fer", "Gal", "Lom", "Ros", "San", "Ver", "Mor"],
            ["acci", "aldi", "ano", "etti", "ini", "oni", "otti", "ucci", "ardo", "ese"],
        ),
    ),
    "spanish": dict(
        weight=0.08,
        places=["Madrid", "Barcelona", "Seville", "Mexico City", "Buenos Aires", "Lima", "Bogotá"],
        first=(
            ["Al", "Bea", "Car", "Es", "Fer", "Ig", "Lu", "Mer", "Ra", "Sol"],
            ["ejandro", "triz", "mela", "teban", "nando", "nacio", "cía", "cedes", "món", "edad"],
        ),
        last=(
            ["Al", "Bar", "Cas", "Echa", "Fuen", "Ibá", "Mend", "Oroz", "Val", "Qui"],
            ["varez", "rera", "tillo", "varría", "tes", "ñez", "oza", "dés", "roga", "ntana"],
        ),
    ),
    "slavic": dict(
        weight=0.08,
        places=["Moscow", "Warsaw", "Prague", "Kiev", "Belgrade", "Kraków", "Saint Petersburg"],
        first=(
            ["Bog", "Dra", "Ka", "Ly", "Mi", "Ol", "Sta", "Vla", "Ya", "Zo"],
            ["dan", "gomir", "tarina", "dmila", "roslav", "ga", "nislav", "dimir", "na", "ris"],
        ),
        last=(
            ["Bor", "Dvo", "Kos", "Lis", "Nov", "Pav", "Rad", "Sok", "Vol", "Zaj"],
            ["ak", "ovich", "enko", "ski", "ová", "in", "ev", "ič", "czyk", "uk"],
        ),
    ),
    "nordic": dict(
        weight=0.06,
        places=["Stockholm", "Oslo", "Copenhagen", "Helsinki", "Bergen", "Gothenburg"],
        first=(
            ["As", "Bjør", "Ei", "Gun", "Hal", "In", "Sig", "Sol", "Tor", "Vig"],
            ["trid", "n", "nar", "dis", "vard", "grid", "rid", "veig", "ben", "mund"],
        ),
        last=(
            ["Berg", "Dahl", "Fjell", "Holm", "Lind", "Lund", "Nord", "Sand", "Strand", "Vik"],
            ["gren", "qvist", "ström", "sen", "by", "heim", "vall", "stad", "rud", "lie"],
        ),
    ),
    "east_asian": dict(
        weight=0.08,
        places=["Tokyo", "Osaka", "Seoul", "Beijing", "Shanghai", "Kyoto"],
        first=(
            ["Ai", "Hi", "Ji", "Ke", "Mi", "Ta", "Yu", "Hao", "Min", "Sei"],
            ["ko", "roshi", "woo", "nji", "yuki", "kumi", "na", "lan", "jun", "mei"],
        ),
        last=(
            ["Ka", "Ha", "Mo", "Na", "Ta", "Wa", "Zha", "Cho", "Li", "Xu"],
            ["ta", "shi", "mura", "kano", "bata", "ng", "yama", "moto", "ra", "da"],
        ),
    ),
    "south_asian": dict(
        weight=0.07,
        places=["Mumbai", "Delhi", "Calcutta", "Karachi", "Lahore", "Chennai"],
        first=(
            ["A", "De", "Ka", "Ma", "Pri", "Ra", "Su", "Vi", "Ish", "Ne"],
            ["nand", "vika", "vya", "dhav", "jesh", "nita", "kram", "jun", "aan", "ha"],
        ),
        last=(
            ["Ba", "Cha", "De", "Gup", "Ku", "Me", "Na", "Ra", "Sha", "Va"],
            ["nerjee", "tterjee", "sai", "ta", "mar", "hta", "yar", "rma", "swamy", "dkar"],
        ),
    ),
}

OCCUPATIONS = [
    "painter", "poet", "chemist", "footballer", "violinist", "architect", "novelist", "botanist",
    "politician", "sculptor", "film director", "engineer", "historian", "jazz pianist", "mathematician",
    "photographer", "cyclist", "opera singer", "journalist", "astronomer",
]  # fmt: skip
AWARDS = ["Morlan Prize", "Vesper Medal", "Orrin Award", "Halden Cup", "Tessaly Prize"]
WORKS = ["stage designs", "early radio plays", "bridge designs", "folk recordings", "field notebooks", "short films"]

# {n} name, {p} birthplace, {o} another place, {j} occupation with its article, {y}/{z} years, {a} award,
# {w} work.
TEMPLATES_WITH_PLACE = [
    "{n} (born {y} in {p}) is {j}.",
    "{n} was {j} born in {p}.",
    "Born in {p}, {n} was {j}.",
    "{n} ({y}–{z}) was {j} from {p}.",
    "{n} was born in {p} and lives in {o}.",
    "The {jb} {n} was born in {p}.",
    "{n}, {j} born in {p}, won the {a}.",
    "{n} is {j}; born in {p} in {y}.",
]
TEMPLATES_WITHOUT_PLACE = [
    "{n} ({y}) is {j} known for {w}.",
    "{n} was {j} who won the {a}.",
]
SHARE_WITHOUT_PLACE = 0.05
SHARE_OTHER_STYLE = 0.15  # names that do not match the region people were born in


@dataclass
class SyntheticPerson:
    name: str
    name_style: str
    region: str
    place: str
    sentence: str

    @property
    def document(self) -> str:
        """The person's corpus line: the sentence under a title of the name, as wiki.txt writes them."""
        return f"{self.name}. {self.sentence}"


def _name(rng: random.Random, style: str) -> str:
    spec = REGIONS[style]
    first = rng.choice(spec["first"][0]) + rng.choice(spec["first"][1])
    last = rng.choice(spec["last"][0]) + rng.choice(spec["last"][1])
    return f"{first} {last}"


def make_names(count: int, seed: int, style: str | None = None, exclude=()) -> list[tuple[str, str]]:
    """`count` distinct made-up (name, style) pairs, optionally all of one naming style, avoiding `exclude`."""
    rng = random.Random(f"names-{seed}-{style}")
    styles = list(REGIONS)
    seen, names = set(exclude), []
    for _ in range(count * 200):
        chosen = style or rng.choice(styles)
        name = _name(rng, chosen)
        if name not in seen:
            seen.add(name)
            names.append((name, chosen))
            if len(names) == count:
                return names
    raise ValueError(f"could not make {count} distinct names in style {style!r}")


def generate_people(num_people: int = DEFAULT_NUM_PEOPLE, seed: int = 0) -> list[SyntheticPerson]:
    if num_people < 3:
        raise ValueError(f"num_people must be at least 3 (train, dev and test need one each), got {num_people}")
    rng = random.Random(seed)
    regions = list(REGIONS)
    weights = [REGIONS[r]["weight"] for r in regions]
    all_places = sorted({p for spec in REGIONS.values() for p in spec["places"]})
    people, names = [], set()
    while len(people) < num_people:
        region = rng.choices(regions, weights)[0]
        style = region if rng.random() >= SHARE_OTHER_STYLE else rng.choice(regions)
        name = _name(rng, style)
        if name in names:
            continue
        names.add(name)
        place = rng.choice(REGIONS[region]["places"])
        other = rng.choice([p for p in all_places if p != place])
        year = rng.randint(1820, 1990)
        occupation = rng.choice(OCCUPATIONS)
        article = "an" if occupation[0] in "aeiou" else "a"
        fields = dict(
            n=name, p=place, o=other, j=f"{article} {occupation}", jb=occupation, y=year, z=year + rng.randint(20, 80),
            a=rng.choice(AWARDS), w=rng.choice(WORKS),
        )  # fmt: skip
        templates = TEMPLATES_WITHOUT_PLACE if rng.random() < SHARE_WITHOUT_PLACE else TEMPLATES_WITH_PLACE
        people.append(SyntheticPerson(name, style, region, place, rng.choice(templates).format(**fields)))
    return people


def split_people(people, dev_fraction=0.2, test_fraction=0.2):
    n_dev = max(1, round(len(people) * dev_fraction))
    n_test = max(1, round(len(people) * test_fraction))
    n_train = len(people) - n_dev - n_test
    if n_train < 1:
        raise ValueError("too few people for a train split")
    return people[:n_train], people[n_train : n_train + n_dev], people[n_train + n_dev :]


@dataclass
class SyntheticFiles:
    directory: Path
    corpus: Path
    train: Path
    dev: Path
    test: Path


def write_synthetic_corpus(directory, num_people: int = DEFAULT_NUM_PEOPLE, seed: int = 0) -> SyntheticFiles:
    """Write corpus.txt, train.tsv, dev.tsv and test_inputs.tsv (questions only) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, dev, test = split_people(generate_people(num_people, seed))
    files = SyntheticFiles(
        directory,
        directory / "corpus.txt",
        directory / "train.tsv",
        directory / "dev.tsv",
        directory / "test_inputs.tsv",
    )
    files.corpus.write_text("".join(p.document + "\n" for p in train + dev + test), encoding="utf-8")
    for path, group in ((files.train, train), (files.dev, dev)):
        path.write_text("".join(f"Where was {p.name} born?\t{p.place}\n" for p in group), encoding="utf-8")
    files.test.write_text("".join(f"Where was {p.name} born?\n" for p in test), encoding="utf-8")
    return files


def default_cache_dir() -> Path:
    return Path(os.environ.get("KNOWGPT_CACHE", Path.home() / ".cache" / "hf_knowgpt"))


def synthetic_corpus_files(num_people: int = DEFAULT_NUM_PEOPLE, seed: int = 0, cache_dir=None) -> SyntheticFiles:
    """The synthetic files for (num_people, seed), generated once into a cache folder (atomically)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"synthetic-v{GENERATOR_VERSION}-n{num_people}-seed{seed}"
    if not (target / "test_inputs.tsv").is_file():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".synthetic-", dir=root))
        write_synthetic_corpus(staging, num_people, seed)
        try:
            staging.rename(target)
        except OSError:  # another process wrote it first; theirs is identical
            shutil.rmtree(staging, ignore_errors=True)
    return SyntheticFiles(
        target, target / "corpus.txt", target / "train.tsv", target / "dev.tsv", target / "test_inputs.tsv"
    )


__all__ = [
    "DEFAULT_NUM_PEOPLE",
    "REGIONS",
    "SyntheticFiles",
    "SyntheticPerson",
    "generate_people",
    "make_names",
    "split_people",
    "synthetic_corpus_files",
    "write_synthetic_corpus",
]

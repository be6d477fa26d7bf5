"""A bundled sample corpus for demos and tests: synthetic, English-like and learnable, no download.

Documents mix templated sentences with structure a small model can pick up in a few dozen steps:
consistent facts about a fixed cast of people (who lives where, who works as what), small sums,
counting runs and simple descriptive sentences. The same ``seed`` always writes the same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ("Alice", "Bruno", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Julia",
         "Kofi", "Lena", "Mateo", "Nora", "Omar", "Priya")
CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Quito", "Perth")
JOBS = ("baker", "pilot", "nurse", "farmer", "teacher", "painter", "builder", "doctor")
ANIMALS = ("cat", "dog", "fox", "horse", "owl", "rabbit", "goat", "crow")
ADJECTIVES = ("small", "quiet", "old", "bright", "green", "happy", "tall", "brown")
OBJECTS = ("fence", "river", "bridge", "garden", "table", "wall", "road", "hill")
VERBS = ("jumps over", "walks along", "sleeps near", "looks at", "runs past", "sits by")
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve")


def _world(seed: int) -> dict[str, tuple[str, str]]:
    """Each person's (city, job): fixed for a seed so the facts are consistent across documents."""
    rng = random.Random(f"world-{seed}")
    return {name: (rng.choice(CITIES), rng.choice(JOBS)) for name in NAMES}


def _sentence(rng: random.Random, world: dict[str, tuple[str, str]]) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        name = rng.choice(NAMES)
        return f"{name} lives in {world[name][0]}."
    if kind == 1:
        name = rng.choice(NAMES)
        return f"{name} works as a {world[name][1]}."
    if kind == 2:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"{a} plus {b} equals {a + b}."
    if kind == 3:
        start = rng.randrange(len(NUMBER_WORDS) - 4)
        return ", ".join(NUMBER_WORDS[start:start + 5]).capitalize() + "."
    adj1, adj2 = rng.choice(ADJECTIVES), rng.choice(ADJECTIVES)
    return (f"The {adj1} {rng.choice(ANIMALS)} {rng.choice(VERBS)} the {adj2} "
            f"{rng.choice(OBJECTS)}.")


def sample_documents(n_docs: int = 1600, seed: int = 0) -> list[str]:
    """``n_docs`` documents of 4-10 sentences each (about 400 bytes per document)."""
    rng = random.Random(seed)
    world = _world(seed)
    docs = []
    for _ in range(n_docs):
        sentences = [_sentence(rng, world) for _ in range(rng.randint(4, 10))]
        docs.append(" ".join(sentences))
    return docs


def write_sample_corpus(out_dir: str | Path, n_docs: int = 1600, seed: int = 0) -> list[Path]:
    """Write the sample corpus as ``sample.txt`` (blank-line separated) and ``sample.jsonl``.

    Args:
        out_dir: Directory to write into (created if missing).
        n_docs: Number of documents in total (half per file); 1600 is about 300 KB.
        seed: Makes the corpus; the same seed writes the same bytes.

    Returns:
        The written files.

    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    docs = sample_documents(n_docs, seed)
    half = len(docs) // 2
    txt, jsonl = out / "sample.txt", out / "sample.jsonl"
    txt.write_text("\n\n".join(docs[:half]) + "\n", encoding="utf-8")
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n"
                             for i, d in enumerate(docs[half:], start=half)), encoding="utf-8")
    return [txt, jsonl]

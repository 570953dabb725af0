"""Write the tiny instruction dataset that `configs/tiny.yaml` trains on (deterministic, no network).

Five small task families with regular answers, so a tiny model's loss falls clearly within minutes:
colour facts, counting, shouting a word, adding digits, and repeating a word. Run from the repository
root; the output is the same on every machine:

    python scripts/make_tiny_dataset.py --out data/tiny
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"banana": "yellow", "cherry": "red", "lime": "green", "plum": "purple", "orange": "orange",
           "blueberry": "blue", "coconut": "brown", "lemon": "yellow", "kiwi": "green", "grape": "purple",
           "strawberry": "red", "pear": "green", "apricot": "orange", "fig": "purple", "tomato": "red"}
WORDS = ["cat", "dog", "river", "stone", "cloud", "apple", "train", "lamp", "forest", "music", "paper",
         "glass", "honey", "tiger", "window", "garden", "silver", "rocket", "candle", "winter"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def colour(rng: random.Random) -> tuple[str, str]:
    fruit = rng.choice(sorted(COLOURS))
    return f"Q: What colour is a {fruit}?\nA:", f" A {fruit} is {COLOURS[fruit]}."


def count(rng: random.Random) -> tuple[str, str]:
    start = rng.randint(1, 20)
    return f"Q: Count from {start} to {start + 4}.\nA:", " " + ", ".join(str(n) for n in range(start, start + 5)) + "."


def shout(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Q: Shout the word '{word}'.\nA:", f" {word.upper()}!"


def add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"Q: What is {NUMBER_WORDS[a]} plus {NUMBER_WORDS[b]}?\nA:", f" {a} + {b} = {a + b}."


def repeat(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Q: Say '{word}' three times.\nA:", f" {word} {word} {word}."


TASKS = [colour, count, shout, add, repeat]


def make_records(count_: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    records = []
    for _ in range(count_):
        prompt, response = rng.choice(TASKS)(rng)
        records.append({"prompt": prompt, "response": response})
    return records


def write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
    path.write_text(text, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/tiny"), help="output folder (default: data/tiny)")
    parser.add_argument("--train", type=int, default=2000, help="training records (default: 2000)")
    parser.add_argument("--eval", type=int, default=200, help="evaluation records (default: 200)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    write_jsonl(args.out / "train.jsonl", make_records(args.train, args.seed))
    write_jsonl(args.out / "eval.jsonl", make_records(args.eval, args.seed + 1))
    print(f"wrote {args.train} + {args.eval} records to {args.out}/train.jsonl and eval.jsonl")


if __name__ == "__main__":
    main()

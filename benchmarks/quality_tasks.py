"""The quality benchmark's tasks, as byte sequences (the frozen base reads bytes, see quality_base.py).

- **Multi-task suite**: `<marker> x_1 .. x_n = y_1 .. y_n`; the marker (one byte) says which of six transformations
  of the symbols x gives y: copy, reverse, sort, shift (+1 in the alphabet), complement (mirror in the alphabet),
  running maximum. Only the context says which task a row is, which is what routing may use.
- **Single-task control**: the same format with one task (running maximum) only: routing has nothing to choose
  between.
- **Multi-query associative recall** (Zoology's MQAR): `k_1 v_1 .. k_P v_P | q_1 a_1 .. q_Q a_Q`, each query a key
  from the pairs and its answer that key's value; with a gap, `gap` filler bytes (none a key or a value) between
  the pairs and the bar, which puts the pairs beyond a windowed base's reach.

A batch is (ids, answer mask): the loss and the score read the positions the mask marks (the answer tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ALPHABET = [ord(c) for c in "abcdefghijklmnop"]  # the symbols x and y of the multi-task suite, and MQAR's keys
VALUES = [ord(c) for c in "0123456789ABCDEF"]  # MQAR's values
FILLER = [ord(c) for c in "qrstuvwxyz"]  # MQAR's gap, neither keys nor values
EQUALS, BAR = ord("="), ord("|")

TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # rows of symbol indices -> answers
    "copy": lambda x: x,
    "reverse": lambda x: x.flip(-1),
    "sort": lambda x: x.sort(-1).values,
    "shift": lambda x: (x + 1) % len(ALPHABET),
    "complement": lambda x: len(ALPHABET) - 1 - x,
    "running_max": lambda x: x.cummax(-1).values,
}
MARKERS = {name: ord(marker) for name, marker in zip(TRANSFORMS, "CRSIXM")}


@dataclass(frozen=True)
class TransformSuite:
    """Rows of `length` symbols under one of `tasks` each (by the row's marker)."""

    tasks: tuple[str, ...] = tuple(TRANSFORMS)
    length: int = 8

    @property
    def sequence_length(self) -> int:
        return 2 * self.length + 2

    def batch(self, size: int, generator: torch.Generator, task: str | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids (size, 2 length + 2), answer mask, each row's task index); `task` fixes every row's task."""
        alphabet = torch.tensor(ALPHABET)
        if task is None:
            which = torch.randint(0, len(self.tasks), (size,), generator=generator)
        else:
            which = torch.full((size,), self.tasks.index(task))
        x = torch.randint(0, len(ALPHABET), (size, self.length), generator=generator)
        y = torch.stack([TRANSFORMS[self.tasks[int(t)]](row) for t, row in zip(which, x)])
        markers = torch.tensor([MARKERS[self.tasks[int(t)]] for t in which])[:, None]
        ids = torch.cat([markers, alphabet[x], torch.full((size, 1), EQUALS), alphabet[y]], dim=1)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, self.length + 2:] = True
        return ids, mask, which


@dataclass(frozen=True)
class RecallSuite:
    """Multi-query associative recall: `pairs` key-value pairs, then `queries` of their keys with the values."""

    pairs: int = 8
    queries: int = 4
    gap: int = 0  # filler bytes between the last pair and the bar

    @property
    def sequence_length(self) -> int:
        return 2 * self.pairs + self.gap + 1 + 2 * self.queries

    def batch(self, size: int, generator: torch.Generator, task: str | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys = torch.stack([torch.randperm(len(ALPHABET), generator=generator)[:self.pairs] for _ in range(size)])
        values = torch.randint(0, len(VALUES), (size, self.pairs), generator=generator)
        asked = torch.stack([torch.randperm(self.pairs, generator=generator)[:self.queries] for _ in range(size)])
        alphabet, digits = torch.tensor(ALPHABET), torch.tensor(VALUES)
        context = torch.stack([alphabet[keys], digits[values]], dim=-1).flatten(1)
        answers = torch.stack([alphabet[keys.gather(1, asked)], digits[values.gather(1, asked)]], dim=-1).flatten(1)
        filler = torch.tensor(FILLER)[torch.randint(0, len(FILLER), (size, self.gap), generator=generator)]
        ids = torch.cat([context, filler, torch.full((size, 1), BAR), answers], dim=1)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, 2 * self.pairs + self.gap + 2::2] = True  # the values after each queried key
        return ids, mask, torch.zeros(size, dtype=torch.long)


def chance(suite) -> float:
    """Per-token accuracy of a uniform guess over the answer symbols."""
    return 1.0 / (len(VALUES) if isinstance(suite, RecallSuite) else len(ALPHABET))

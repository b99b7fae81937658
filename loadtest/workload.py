"""What a load test sends: prompts (ShareGPT replay or synthetic lengths), SLO classes, arrivals."""

from __future__ import annotations

import random
from dataclasses import dataclass

from engines.datasets import read_prompt_file, sharegpt_prompts

# Words for synthetic prompts: roughly one token each for the embedded model's tokenizer.
_WORDS = "the of and to in is that for it as was with be by on not he this are or his from at which".split()


@dataclass(frozen=True)
class ChatJob:
    """One request to send: its messages, output limit and SLO class (None: no `slo` field); greedy unless
    it has a temperature (and then a seed, when given)."""

    messages: list[dict[str, str]]
    max_tokens: int
    slo_class: str | None = None
    temperature: float = 0.0
    seed: int | None = None


def load_prompts(source: str, num: int, seed: int = 0, input_words: int = 64) -> list[list[dict[str, str]]]:
    """Conversations to replay: `sharegpt` (the dataset package), `synthetic` (random words,
    `input_words` long), or a JSON Lines prompt file ({'id', 'messages'} per line)."""
    if source == "sharegpt":
        return [r["messages"] for r in sharegpt_prompts(num, max_chars=1500)]
    if source == "synthetic":
        rng = random.Random(seed)
        return [
            [{"role": "user", "content": " ".join(rng.choice(_WORDS) for _ in range(input_words))}] for _ in range(num)
        ]
    return [r["messages"] for r in read_prompt_file(source)][:num]


def parse_mix(spec: str | None) -> list[tuple[str | None, float]]:
    """`interactive:0.5,batch:0.5` -> [(class, weight)]; None or '' -> one class-less stream."""
    if not spec:
        return [(None, 1.0)]
    out = []
    for part in spec.split(","):
        name, _, weight = part.partition(":")
        out.append((name.strip(), float(weight) if weight else 1.0))
    if any(w < 0 for _, w in out) or sum(w for _, w in out) <= 0:
        raise ValueError(f"bad SLO mix {spec!r}: weights must be non-negative and not all zero")
    return out


@dataclass
class Workload:
    """An endless, seeded stream of jobs over the prompts, each with a class drawn from the mix."""

    prompts: list[list[dict[str, str]]]
    max_tokens: int
    mix: list[tuple[str | None, float]]
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("no prompts to send")
        self._rng = random.Random(self.seed)
        self._next = 0

    def next_job(self) -> ChatJob:
        """The next prompt in order (wrapping) with a random class."""
        messages = self.prompts[self._next % len(self.prompts)]
        self._next += 1
        names, weights = zip(*self.mix, strict=True)
        return ChatJob(messages, self.max_tokens, self._rng.choices(names, weights)[0])

    def interarrival_s(self, rate: float) -> float:
        """A Poisson process's gap at `rate` requests per second."""
        return self._rng.expovariate(rate)

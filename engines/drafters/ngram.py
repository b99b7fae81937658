"""N-gram drafter: prompt lookup over the request's own tokens (and optionally recent requests'),
proposing a multi-branch tree of the continuations that followed earlier occurrences of the
current suffix. No model and no training."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engines.draft_tree import DraftTree
from engines.drafters.base import Drafter
from engines.request import Request
from engines.spec_params import SpecParams

SEPARATOR = -1  # between sequences in a shared index; never a real token


class NgramIndex:
    """For every n-gram (n = 1..max_n) of a token stream, the positions right after its occurrences."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.follow: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens and index the n-grams that end at each of them."""
        for tok in tokens:
            self.tokens.append(tok)
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                self.follow.setdefault(tuple(self.tokens[end - n :]), []).append(end)

    def continuations(self, suffix: list[int], depth: int, max_matches: int) -> list[list[int]]:
        """Up to `max_matches` continuations (most recent first, each <= depth tokens) of `suffix`."""
        out = []
        for start in reversed(self.follow.get(tuple(suffix), ())):
            cont = self.tokens[start : start + depth]
            if SEPARATOR in cont:  # a continuation never runs into the next sequence
                cont = cont[: cont.index(SEPARATOR)]
            if cont:
                out.append(cont)
                if len(out) == max_matches:
                    break
        return out


def request_index(indexes: dict[str, NgramIndex], req: Request, max_n: int) -> NgramIndex:
    """The request's index in `indexes` (made on first use), extended with the tokens it gained since."""
    idx = indexes.get(req.request_id)
    if idx is None:
        idx = indexes[req.request_id] = NgramIndex(max_n)
    have = len(idx.tokens)
    if have < req.num_tokens:
        idx.extend(req.token_ids(have, req.num_tokens))
    return idx


@dataclass
class _Trie:
    count: int = 0
    children: dict[int, _Trie] = field(default_factory=dict)


def tree_from_continuations(root: int, conts: list[list[int]], width: int, budget: int) -> DraftTree | None:
    """Merge continuations into a trie and keep the `budget` most frequent prefixes, `width` per node.

    A node's score is the fraction of matches that share its prefix, an estimate of the chance the
    target follows it.
    """
    if not conts:
        return None
    trie = _Trie()
    for cont in conts:
        node = trie
        for tok in cont:
            node = node.children.setdefault(tok, _Trie())
            node.count += 1
    total = len(conts)
    tokens, parents, scores = [root], [-1], [1.0]
    frontier: list[tuple[float, int, int, _Trie]] = [(1.0, 0, 0, trie)]  # (-score, order, index, node)
    order = 0
    while frontier and len(tokens) - 1 < budget:
        frontier.sort(key=lambda f: (-f[0], f[1]))
        _, _, index, node = frontier.pop(0)
        best = sorted(node.children.items(), key=lambda kv: -kv[1].count)[:width]
        for tok, child in best:
            if len(tokens) - 1 == budget:
                break
            tokens.append(tok)
            parents.append(index)
            scores.append(child.count / total)
            order += 1
            frontier.append((child.count / total, order, len(tokens) - 1, child))
    return DraftTree(tokens, parents, scores) if len(tokens) > 1 else None


class NgramDrafter(Drafter):
    """Prompt-lookup / suffix-match drafter with multi-branch trees.

    The longest suffix of the request (max_n down to min_n tokens) that occurred before selects the
    matches; their continuations form the tree. With `share_across_requests`, requests that finished
    recently are searched too when the request itself has no match (not for seeded requests, whose
    output must not depend on other traffic).
    """

    name = "ngram"

    def __init__(
        self,
        min_n: int = 1,
        max_n: int = 4,
        max_matches: int = 16,
        share_across_requests: bool = True,
        shared_tokens: int = 100_000,
    ):
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self.indexes: dict[str, NgramIndex] = {}
        self.share = share_across_requests
        self.shared_tokens = shared_tokens
        self.recent: deque[list[int]] = deque()
        self.shared = NgramIndex(max_n)

    def _index(self, req: Request) -> NgramIndex:
        return request_index(self.indexes, req, self.max_n)

    def propose(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        trees = []
        for req, spec in zip(requests, specs, strict=True):
            idx = self._index(req)
            root = idx.tokens[-1]
            tree = None
            # A seeded request drafts from its own tokens only: drafts that depended on other requests
            # would change how its random numbers are consumed, and so its output.
            shared = self.share and req.params.seed is None
            for source in (idx, self.shared) if shared else (idx,):
                for n in range(min(self.max_n, len(idx.tokens)), self.min_n - 1, -1):
                    conts = source.continuations(idx.tokens[-n:], spec.depth, self.max_matches)
                    if conts:
                        tree = tree_from_continuations(root, conts, spec.width, spec.budget)
                        break
                if tree is not None:
                    break
            trees.append(tree)
        return trees

    def forget_recent(self) -> None:
        self.recent.clear()
        self.shared = NgramIndex(self.max_n)

    def on_finished(self, request: Request) -> None:
        idx = self.indexes.pop(request.request_id, None)
        if not self.share or idx is None:
            return
        self.recent.append(idx.tokens)
        self.shared.extend([*idx.tokens, SEPARATOR])
        if len(self.shared.tokens) > 2 * self.shared_tokens:  # rebuild rarely, from the newest sequences
            while sum(len(t) + 1 for t in self.recent) > self.shared_tokens:
                self.recent.popleft()
            self.shared = NgramIndex(self.max_n)
            for toks in self.recent:
                self.shared.extend([*toks, SEPARATOR])

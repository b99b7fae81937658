"""Suffix drafter (SuffixDecoding, Oliaro et al. 2024): drafts from the text itself.

The longest suffix of a request that occurred before, in its own prompt and output or in recent
requests' outputs, selects every earlier occurrence of it; what followed them, merged into a trie,
is the draft tree, each node scored by how often the occurrences continued that way (the share of
its parent's occurrences). The longer the match, the more it may speculate: at most `length_factor`
times the match length. Drafting costs microseconds and needs no model, so on text a model copies
(code edits, quoting, extraction, an agent's repeated calls) it pays even where verifying is not free.

Recent requests' outputs sit in one shared index bounded by `shared_tokens` tokens (the oldest
dropped first; `shared_size` reports it). A seeded request drafts from its own tokens only, so what
it drafts never depends on other traffic.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engines.draft_tree import DraftTree
from engines.drafters.base import Drafter
from engines.drafters.ngram import SEPARATOR, NgramIndex, request_index
from engines.request import Request
from engines.spec_params import SpecParams

SCAN_FACTOR = 4  # occurrences of the longest n-gram looked at: this many times those kept (the most recent)


@dataclass
class SuffixMatch:
    """Where a request's suffix occurred before: its length and the positions right after each occurrence."""

    length: int
    ends: list[int] = field(default_factory=list)


def longest_match(index: NgramIndex, query: list[int], max_length: int, max_occurrences: int) -> SuffixMatch | None:
    """The longest suffix of `query` (at most `max_length` tokens) that occurs in `index` with a continuation,
    and up to `max_occurrences` of its occurrences (most recent first); None if not even its last token does."""
    limit = len(index.tokens)
    for n in range(min(index.max_n, len(query)), 0, -1):
        ends = [e for e in index.follow.get(tuple(query[-n:]), ()) if e < limit and index.tokens[e] != SEPARATOR]
        if not ends:
            continue
        best, kept = 0, []
        for end in reversed(ends[-SCAN_FACTOR * max_occurrences :]):  # each extended backwards as far as it matches
            m = n
            while m < max_length and m < len(query) and end - m - 1 >= 0:
                token = index.tokens[end - m - 1]
                if token != query[-m - 1] or token == SEPARATOR:
                    break
                m += 1
            if m > best:
                best, kept = m, [end]
            elif m == best and len(kept) < max_occurrences:
                kept.append(end)
        return SuffixMatch(best, kept)
    return None


def tree_from_match(
    index: NgramIndex, match: SuffixMatch, root: int, depth: int, width: int, budget: int, min_score: float
) -> DraftTree | None:
    """The continuations after a match's occurrences as a tree: up to `width` children a node, `budget` nodes
    in all, best first by score (the product of each step's continuation share along the path), nodes scored
    below `min_score` left out."""
    children: dict[tuple[int, ...], dict[int, int]] = {}  # path -> next token -> occurrences
    for end in match.ends:
        path: tuple[int, ...] = ()
        for token in index.tokens[end : end + depth]:
            if token == SEPARATOR:
                break
            counts = children.setdefault(path, {})
            counts[token] = counts.get(token, 0) + 1
            path += (token,)
    tokens, parents, scores = [root], [-1], [1.0]
    frontier: list[tuple[float, tuple[int, ...], int]] = [(1.0, (), 0)]  # (score, path, node index)
    while frontier and len(tokens) - 1 < budget:
        frontier.sort(key=lambda f: -f[0])
        score, path, index_of = frontier.pop(0)
        counts = children.get(path)
        if not counts:
            continue
        total = sum(counts.values())
        for token, count in sorted(counts.items(), key=lambda kv: -kv[1])[:width]:
            child_score = score * count / total
            if child_score < min_score or len(tokens) - 1 == budget:
                break
            tokens.append(token)
            parents.append(index_of)
            scores.append(child_score)
            frontier.append((child_score, (*path, token), len(tokens) - 1))
    return DraftTree(tokens, parents, scores) if len(tokens) > 1 else None


class SuffixDrafter(Drafter):
    """Drafts the continuations of the longest earlier occurrence of a request's suffix (its own tokens
    first, then recent requests' outputs), speculating longer the longer the match."""

    name = "suffix"

    def __init__(
        self,
        max_match: int = 32,
        length_factor: float = 1.0,
        min_score: float = 0.1,
        max_occurrences: int = 16,
        share_across_requests: bool = True,
        shared_tokens: int = 200_000,
    ):
        self.max_match, self.length_factor, self.min_score = max_match, length_factor, min_score
        self.max_occurrences = max_occurrences
        self.share = share_across_requests
        self.shared_tokens = shared_tokens
        self.indexes: dict[str, NgramIndex] = {}
        self.recent: deque[list[int]] = deque()  # the outputs in `shared`, oldest first
        self.shared = NgramIndex(max_n=4)

    @property
    def shared_size(self) -> int:
        """Tokens the shared index over recent requests' outputs holds (at most about 2 x `shared_tokens`)."""
        return len(self.shared.tokens)

    def draft(self, req: Request, spec: SpecParams) -> DraftTree | None:
        """The request's tree within `spec`, or None where its suffix never occurred before."""
        idx = request_index(self.indexes, req, max_n=4)
        sources = (idx, self.shared) if self.share and req.params.seed is None else (idx,)
        for source in sources:
            match = longest_match(source, idx.tokens, self.max_match, self.max_occurrences)
            if match is None or not match.ends:
                continue
            depth = min(spec.depth, max(1, round(self.length_factor * match.length)))
            tree = tree_from_match(source, match, idx.tokens[-1], depth, spec.width, spec.budget, self.min_score)
            if tree is not None:
                return tree
        return None

    def propose(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        return [self.draft(req, spec) for req, spec in zip(requests, specs, strict=True)]

    def forget_recent(self) -> None:
        self.recent.clear()
        self.shared = NgramIndex(max_n=4)

    def on_finished(self, request: Request) -> None:
        idx = self.indexes.pop(request.request_id, None)
        if not self.share or idx is None:
            return
        output = idx.tokens[request.num_prompt_tokens :]
        if not output:
            return
        self.recent.append(output)
        self.shared.extend([*output, SEPARATOR])
        if len(self.shared.tokens) > 2 * self.shared_tokens:  # rebuild rarely, from the newest outputs
            while sum(len(t) + 1 for t in self.recent) > self.shared_tokens:
                self.recent.popleft()
            self.shared = NgramIndex(max_n=4)
            for tokens in self.recent:
                self.shared.extend([*tokens, SEPARATOR])

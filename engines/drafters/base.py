"""The interface every drafter implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engines.draft_tree import DraftTree
from engines.request import Request
from engines.spec_params import SpecParams
from engines.verification import VerifyResult


class Drafter(ABC):
    """Proposes a draft tree per request each step and learns from the verification outcome.

    `propose` may return None for a request (no speculation this step); trees may differ in size
    across requests. The engine prunes each tree to the request's budget and depth limit.
    """

    name: str = "drafter"
    wants_hidden: bool = False  # whether the engine should call `on_prefill` with target hidden states

    @property
    def cache_lookahead(self) -> int:
        """Tokens past a KV block that the prefix cache's block hash must cover because this drafter keeps
        state in the target's blocks that depends on them (0: none)."""
        return 0

    @abstractmethod
    def propose(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        """One tree per request, rooted at its last token (not yet in the KV cache)."""

    def catch_up(self, requests: list[Request]) -> list[int]:
        """Read whatever context each request's next draft needs, all requests at once (`propose` would
        otherwise read it request by request); per request, how many tokens it read (prompt included)."""
        return [0] * len(requests)

    def on_verified(  # noqa: B027 - optional hook, stateless drafters ignore it
        self, request: Request, tree: DraftTree, result: VerifyResult, hidden: torch.Tensor
    ) -> None:
        """The accepted path of `tree`, its bonus token, and the target's hidden states on the path
        ([len(path), hidden]). Called in the step, before the engine applies it: the request's
        `num_computed_tokens` is still the root's position and the path's tokens are not appended."""

    def on_prefill(  # noqa: B027 - optional hook for drafters that read the target's hidden states
        self, requests: list[Request], hidden: torch.Tensor, row_starts: list[int]
    ) -> None:
        """Target hidden states of a step's non-draft rows (prefill chunks and plain decode steps), every
        such request at once: request i's positions from its `num_computed_tokens` on are rows
        row_starts[i]:row_starts[i + 1] of `hidden` ([rows, hidden]). Called only when `wants_hidden`
        is set, with every such request (also those that do not speculate: their blocks may serve
        others from the prefix cache)."""

    def on_cached_prefix(self, request: Request, num_cached: int) -> None:  # noqa: B027 - optional hook
        """The request was admitted with its first `num_cached` tokens' K/V from the prefix cache (the
        target never ran over them for it): set up the context state the drafter keeps for them. Called
        in the step that admits it, before drafting and before `on_prefill`."""

    def on_finished(self, request: Request) -> None:  # noqa: B027 - optional hook
        """The request ended (finished, aborted or preempted); drop per-request state."""

    def forget_recent(self) -> None:  # noqa: B027 - optional hook
        """Drop what it keeps of finished requests (drafters that draft from recent outputs)."""

"""A model drafter with the suffix drafter beside it (`drafter: lyanna+suffix`).

Each step the executor first asks the suffix drafter, which costs microseconds, for every request
granted a draft; the speculation policy keeps the parts of the text drafts that pay (by expected tokens
per second, `SpeculationPolicy.choose_text_drafts`), and only a step that keeps none goes to the model
drafter (its catch-up, its levels) and its plan. The model drafter still reads every verified position's
hidden states, so a request moves between the two from one step to the next without reading its
context again.
"""

from __future__ import annotations

import torch

from engines.draft_tree import DraftTree
from engines.drafters.base import Drafter
from engines.drafters.suffix import SuffixDrafter
from engines.request import Request
from engines.spec_params import SpecParams
from engines.verification import VerifyResult


class TextFirstDrafter(Drafter):
    """Drafts from the text itself where that pays, with a model drafter for the rest."""

    def __init__(self, model: Drafter, text: SuffixDrafter):
        self.model, self.text = model, text
        self.name = f"{model.name}+{text.name}"
        self.wants_hidden = model.wants_hidden
        self.text_requests: set[str] = set()  # requests whose tree this step is the text drafter's
        self.num_text_trees = 0  # text drafter's trees verified since start

    @property
    def cache_lookahead(self) -> int:
        return self.model.cache_lookahead

    def propose_text(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        """The suffix drafter's tree per request (None where its suffix never occurred before)."""
        return self.text.propose(requests, specs)

    def use_text(self, request_ids: set[str]) -> None:
        """This step verifies the text drafter's trees for these requests."""
        self.text_requests = request_ids
        self.num_text_trees += len(request_ids)

    def propose(self, requests: list[Request], specs: list[SpecParams]) -> list[DraftTree | None]:
        return self.model.propose(requests, specs)

    def catch_up(self, requests: list[Request]) -> list[int]:
        return self.model.catch_up(requests)

    def on_verified(self, request: Request, tree: DraftTree, result: VerifyResult, hidden: torch.Tensor) -> None:
        if request.request_id not in self.text_requests:
            self.model.on_verified(request, tree, result, hidden)
        elif self.model.wants_hidden:  # the accepted path's hidden states, as a prefill's from the root on
            self.model.on_prefill([request], hidden, [0, hidden.shape[0]])

    def on_prefill(self, requests: list[Request], hidden: torch.Tensor, row_starts: list[int]) -> None:
        self.model.on_prefill(requests, hidden, row_starts)

    def on_cached_prefix(self, request: Request, num_cached: int) -> None:
        self.model.on_cached_prefix(request, num_cached)

    def on_finished(self, request: Request) -> None:
        self.model.on_finished(request)
        self.text.on_finished(request)

    def forget_recent(self) -> None:
        self.model.forget_recent()
        self.text.forget_recent()

"""Structured outputs: a request's grammar, compiled once per (kind, spec) with xgrammar, and the token
masks that hold its output to it, with speculation on.

- `StructuredOutputCompiler` turns `StructuredOutputParams` (JSON schema, any JSON object, regex, EBNF
  grammar, choice) into an xgrammar `CompiledGrammar` for the engine's tokenizer, caches it (LRU,
  thread-safe: admission runs off the engine thread) and raises `InvalidRequestError` naming
  `params.param` for a spec xgrammar cannot compile. docs/structured-outputs.md says why xgrammar
  (measured against llguidance).
- `GrammarState` is one request's matcher: the engine advances it with every emitted token
  (`LLMEngine.append_tokens`) and the request finishes when the grammar ends; the tokenizer's stop
  tokens are allowed only where the grammar accepts.
- Under speculation the executor calls `prune_draft` right after the policy's allocation (draft tokens
  the grammar forbids, and their subtrees, are dropped: they could never be accepted) and
  `mask_logits` at the start of sampling and verification: every row a constrained request samples or
  verifies gets the mask of the grammar state after its path (root..node), filled on the host with
  accept/rollback over the tree, copied to the device once and applied in place. Verification then
  runs unchanged against the masked target, so the output follows the constrained target law exactly
  (tests/engines/test_structured_output.py enumerates it on a tiny vocabulary).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engines.draft_tree import DraftTree
from engines.errors import InvalidRequestError
from engines.structured_params import StructuredOutputParams

if TYPE_CHECKING:
    import xgrammar

    from engines.sampling import SamplingParams

log = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users get the message after it.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


def _bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit t of word t // 32: token t is allowed)."""
    return (vocab_size + 31) // 32


def _error_message(exc: BaseException) -> str:
    text = str(exc).strip()
    text = _CPP_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)
    return text.removeprefix("Check failed: (error.empty()) is false: ")


def cache_key(params: StructuredOutputParams) -> tuple[str, Any]:
    """The compile cache's key: the constraint's kind and spec (a JSON schema with its whitespace
    normalised, its key order kept: it is the order of the output's properties)."""
    kind = params.kind
    if kind == "json_schema":
        try:
            return kind, json.dumps(json.loads(params.json_schema), separators=(",", ":"))
        except (TypeError, ValueError):
            return kind, params.json_schema  # compiling reports it
    if kind == "choice":
        return kind, tuple(params.choice)
    return kind, getattr(params, kind)


@dataclass
class _Entry:
    """A cache slot: filled once by the thread that compiles it, waited on by the others."""

    done: threading.Event = field(default_factory=threading.Event)
    grammar: xgrammar.CompiledGrammar | None = None
    error: InvalidRequestError | None = None


class StructuredOutputCompiler:
    """Compiles structured-output constraints for one tokenizer, once per (kind, spec), and makes
    per-request matchers. Thread-safe.

    `tokenizer_info` builds xgrammar's view of the vocabulary (done on first use: it costs ~0.1 s);
    `vocab_size` is the logits' width (the model's vocabulary, which bounds the masks).
    """

    def __init__(
        self,
        tokenizer_info: Callable[[], xgrammar.TokenizerInfo],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_size: int = 256,
    ):
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self.hits = 0
        self.misses = 0
        self._make_info = tokenizer_info
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, Any], _Entry] = OrderedDict()

    @classmethod
    def for_hf_tokenizer(
        cls, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> StructuredOutputCompiler:
        """For a transformers tokenizer; the grammar's end is marked by any of `stop_token_ids`."""

        def info() -> xgrammar.TokenizerInfo:
            import xgrammar as xgr

            return xgr.TokenizerInfo.from_huggingface(
                hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
            )

        return cls(info, vocab_size, stop_token_ids)

    @classmethod
    def for_vocabulary(cls, tokens: Sequence[str], stop_token_ids: Sequence[int]) -> StructuredOutputCompiler:
        """For a raw vocabulary: token i is the string tokens[i] (tiny test vocabularies)."""

        def info() -> xgrammar.TokenizerInfo:
            import xgrammar as xgr

            return xgr.TokenizerInfo(list(tokens), vocab_type=xgr.VocabType.RAW, stop_token_ids=list(stop_token_ids))

        return cls(info, len(tokens), stop_token_ids)

    def _grammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                threads = max(1, min(8, os.cpu_count() or 1))
                # our own cache holds the compiled grammars; xgrammar's would keep a second copy
                self._compiler = xgr.GrammarCompiler(self._make_info(), max_threads=threads, cache_enabled=False)
            return self._compiler

    def compile(self, params: StructuredOutputParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `params` (from the cache when compiled before); InvalidRequestError
        naming `params.param` when xgrammar cannot compile it."""
        key = cache_key(params)
        with self._lock:
            entry = self._cache.get(key)
            owner = entry is None
            if owner:
                entry = self._cache[key] = _Entry()
                self.misses += 1
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
                self.hits += 1
        if owner:
            try:
                entry.grammar = self._compile(params)
            except InvalidRequestError as e:
                entry.error = e
            except Exception as e:  # xgrammar raises RuntimeError (and others) for what it cannot compile
                entry.error = InvalidRequestError(
                    f"{params.param}: the {params.kind} cannot be compiled: {_error_message(e)}", param=params.param
                )
            finally:
                entry.done.set()
        else:
            entry.done.wait()
        if entry.error is not None:
            raise InvalidRequestError(entry.error.message, param=params.param)
        return entry.grammar

    def _compile(self, params: StructuredOutputParams) -> xgrammar.CompiledGrammar:
        compiler = self._grammar_compiler()
        kind = params.kind
        if kind == "json_schema":
            try:
                schema = json.loads(params.json_schema)
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(
                    f"{params.param}: the json_schema is not valid JSON: {e}", param=params.param
                ) from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError(f"{params.param}: the json_schema must be a JSON object", param=params.param)
            # compact separators (", " and ": "): free whitespace lets a small model loop on blanks
            return compiler.compile_json_schema(params.json_schema, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        # choice: one EBNF alternative per string (JSON string escapes are EBNF's)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))

    def matcher(self, params: StructuredOutputParams) -> GrammarState:
        """A fresh matcher for one request (compiling `params` unless cached)."""
        return GrammarState(self.compile(params), self.vocab_size, self.stop_token_ids)


class GrammarState:
    """One request's position in its grammar (an xgrammar matcher), advanced token by token."""

    def __init__(self, grammar: xgrammar.CompiledGrammar, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(grammar)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._row = torch.empty(1, _bitmask_width(vocab_size), dtype=torch.int32)  # for `ended`

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: nothing more may follow."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by one token if the grammar allows it (else the state is unchanged); whether it did."""
        return self.matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        self.matcher.rollback(num_tokens)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the mask of the tokens allowed next into bitmask[row] ([rows, words] int32 on the host);
        all tokens once terminated (such a row is never emitted: the request stops at its stop token)."""
        if self.matcher.is_terminated():
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def ended(self) -> bool:
        """Whether the output so far is complete and nothing but a stop token may follow."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        self.matcher.fill_next_token_bitmask(self._row, 0)
        allowed = unpack_bitmask(self._row, self.vocab_size)[0]
        allowed[self.stop_token_ids] = False
        return not bool(allowed.any())

    def advance(self, token: int) -> bool:
        """Accept an emitted token; True when generation must end here (the grammar terminated or
        allows nothing but a stop token). A token the grammar refuses ends it too (logged: masking
        makes it impossible)."""
        if not self.matcher.accept_token(token):
            log.warning("an emitted token (%d) is outside the request's grammar; ending the request", token)
            return True
        return self.ended()

    def reachable(self, tree: DraftTree) -> list[bool]:
        """Per node of `tree` (rooted at this state): whether the grammar allows its path root..node."""
        ok = [False] * tree.size
        ok[0] = True
        children = tree.child_lists()
        stack: list[tuple[int, int]] = [(0, 0)]  # (node, index of its next child to try)
        while stack:
            node, k = stack.pop()
            if k < len(children[node]):
                stack.append((node, k + 1))
                child = children[node][k]
                if self.matcher.accept_token(tree.tokens[child]):
                    ok[child] = True
                    stack.append((child, 0))
            elif node != 0:
                self.matcher.rollback(1)
        return ok

    def fill_tree(self, tree: DraftTree, bitmask: torch.Tensor, start: int) -> None:
        """bitmask[start + i] = the mask after the path root..node i, for every node of `tree`; nodes
        the grammar does not reach (only in stochastic chains, which are not pruned) allow all tokens:
        the verifier rejects the forbidden token above them with certainty and never reads them."""
        children = tree.child_lists()
        self.fill(bitmask, start)
        stack: list[tuple[int, int]] = [(0, 0)]
        while stack:
            node, k = stack.pop()
            if k < len(children[node]):
                stack.append((node, k + 1))
                child = children[node][k]
                if self.matcher.accept_token(tree.tokens[child]):
                    self.fill(bitmask, start + child)
                    stack.append((child, 0))
                else:
                    for i in _subtree(children, child):
                        bitmask[start + i] = -1
            elif node != 0:
                self.matcher.rollback(1)


def _subtree(children: list[list[int]], node: int) -> list[int]:
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(children[n])
    return out


def prune_draft(state: GrammarState, tree: DraftTree, params: SamplingParams) -> DraftTree | None:
    """`tree` without the tokens the grammar forbids and their subtrees (None when no draft token is
    left). A deterministic tree (top-k or n-gram) is fixed before the target's randomness, so any subtree
    of it is verified losslessly. A stochastic chain (tokens drawn from q) at temperature > 0 is kept
    whole: cutting it where a token is forbidden would change what its verification emits there (the
    residual of p - q instead of p); the masked target rejects that token with certainty anyway."""
    if tree.draft_probs is not None and not params.greedy:
        return tree
    ok = state.reachable(tree)
    if all(ok):
        return tree
    kept = [i for i, keep in enumerate(ok) if keep]
    return tree.subtree(kept) if len(kept) > 1 else None


@dataclass
class MaskedRows:
    """The rows of one step's logits that constrained requests sample or verify, as (state, tree,
    first row): a tree's nodes occupy rows first..first + size - 1, a plain row is one row (tree None)."""

    items: list[tuple[GrammarState, DraftTree | None, int]] = field(default_factory=list)

    def add(self, state: GrammarState, tree: DraftTree | None, first_row: int) -> None:
        """One request's rows: a sampled row (`tree` None) or a verified tree's nodes."""
        self.items.append((state, tree, first_row))

    @property
    def num_rows(self) -> int:
        """Rows masked."""
        return sum(1 if t is None else t.size for _, t, _ in self.items)

    def fill(self, bitmask: torch.Tensor, compact: bool) -> list[int]:
        """Fill every row's mask into `bitmask` ([rows, words] int32 on the host): at 0, 1, ... in order
        (`compact`), else at the logits row itself. Returns the logits rows, in that order."""
        rows: list[int] = []
        for state, tree, first in self.items:
            at = len(rows) if compact else first
            if tree is None:
                state.fill(bitmask, at)
                rows.append(first)
            else:
                state.fill_tree(tree, bitmask, at)
                rows.extend(range(first, first + tree.size))
        return rows

    def host_masks(self, vocab_size: int, pin: bool = False) -> torch.Tensor:
        """Every row's bitmask and then the rows' indices, flat in one int32 host buffer: [R * words + R]."""
        words, num = _bitmask_width(vocab_size), self.num_rows
        buf = torch.empty(num * words + num, dtype=torch.int32, pin_memory=pin)
        rows = self.fill(buf[: num * words].view(num, words), compact=True)
        buf[num * words :] = torch.tensor(rows, dtype=torch.int32)
        return buf


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] int32 bitmasks -> [R, vocab_size] bool (True: allowed), on the bitmasks' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab_size].bool()


def apply_masks(logits: torch.Tensor, packed: torch.Tensor, num_rows: int) -> None:
    """Set logits[row, t] = -inf in place for every token t a row's bitmask forbids, in tensor ops on the
    logits' device. logits: [N, vocab]; packed: `MaskedRows.host_masks`' buffer, on the same device."""
    vocab = logits.shape[-1]
    words = _bitmask_width(vocab)
    bits = packed[: num_rows * words].view(num_rows, words)
    rows = packed[num_rows * words :].long()
    allowed = unpack_bitmask(bits, vocab)  # [R, vocab]
    with torch.inference_mode(logits.is_inference()):  # the forward's logits are inference tensors
        logits.index_put_((rows,), logits.index_select(0, rows).masked_fill_(~allowed, -math.inf))


_XGRAMMAR_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def mask_logits(logits: torch.Tensor, rows: MaskedRows) -> None:
    """Mask `rows` of logits ([N, vocab]) in place; nothing is copied back to the host. On the CPU
    xgrammar's kernel applies the host bitmasks where they are filled (~10 us a row against ~0.5 ms for
    the tensor ops); on an accelerator the masks go to the device in one copy and `apply_masks` runs."""
    if not rows.items:
        return
    vocab = logits.shape[-1]
    if logits.device.type == "cpu" and logits.dtype in _XGRAMMAR_CPU_DTYPES and logits.is_contiguous():
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

        bitmask = torch.empty(logits.shape[0], _bitmask_width(vocab), dtype=torch.int32)  # rows it names only
        indices = rows.fill(bitmask, compact=False)
        apply_token_bitmask_inplace_cpu(logits, bitmask, vocab, indices)
        return
    pin = logits.device.type == "cuda"
    packed = rows.host_masks(vocab, pin=pin).to(logits.device, non_blocking=True)
    apply_masks(logits, packed, rows.num_rows)

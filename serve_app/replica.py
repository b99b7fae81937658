"""The LLM replica deployment: one engine (target + drafter) with its continuous-batching loop.

The loop runs in a background thread (`AsyncEngine`); `generate` is a streaming method the ingress
calls through a DeploymentHandle. Its first item is either an error (a dict with `error` and
`status`, for bad requests) or the request's first delta, so the ingress can answer with the right
status before it starts a stream. Cancelling the call (a client that went away) aborts the request
in the engine and frees its KV blocks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict
from ray import serve

from engines.async_engine import AsyncEngine
from engines.engine import EngineConfig, LLMEngine
from engines.errors import InvalidRequestError
from engines.spec_params import SpecParams
from serve_app.schemas import ChatCompletionRequest

log = logging.getLogger("serve_app.replica")


class EngineSettings(BaseModel):
    """Engine settings as application arguments (serve_config.yaml)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None = the embedded SmolLM2-135M-Instruct
    served_model_name: str = "smollm2-135m-instruct"
    dtype: str = "bfloat16"
    device: str = "cpu"
    drafter: str = "lyanna"
    draft_model: str | None = None
    num_kv_blocks: int | None = None
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    spec_depth: int = SpecParams.depth
    spec_width: int = SpecParams.width
    spec_budget: int = SpecParams.budget

    def engine_config(self) -> EngineConfig:
        """The engine's own config."""
        spec = SpecParams(depth=self.spec_depth, width=self.spec_width, budget=self.spec_budget)
        fields = self.model_dump(exclude={"served_model_name", "spec_depth", "spec_width", "spec_budget"})
        return EngineConfig(**fields, spec=spec)


def error_item(err: InvalidRequestError) -> dict[str, Any]:
    """A bad request as the stream's first item (OpenAI's error object plus the HTTP status)."""
    status = 400
    kind = "invalid_request_error"
    return {
        "status": status,
        "error": {"message": err.message, "type": kind, "param": err.param, "code": err.code},
    }


@serve.deployment(name="LLMReplica", ray_actor_options={"num_cpus": 1})
class LLMReplica:
    """Hosts one engine; streams deltas for chat requests."""

    def __init__(self, settings: dict[str, Any] | None = None):
        self.settings = EngineSettings.model_validate(settings or {})
        self.engine = LLMEngine(self.settings.engine_config())
        self.async_engine = AsyncEngine(self.engine)

    async def generate(self, body: dict[str, Any], request_id: str) -> AsyncIterator[dict[str, Any]]:
        """Deltas of one chat completion: {text, token_ids, finish_reason, usage, speculation}."""
        try:
            req = ChatCompletionRequest.model_validate(body)
            params = req.sampling_params(self.engine.model_config.vocab_size)
            spec = req.spec_params(self.engine.config.spec)
            stream = self.async_engine.generate(req.conversation(), params, request_id, spec=spec)
            first = await anext(stream)
        except InvalidRequestError as e:
            yield error_item(e)
            return
        out = first
        while True:
            yield {
                "text": out.new_text,
                "finish_reason": out.finish_reason.value if out.finish_reason else None,
                "prompt_tokens": out.num_prompt_tokens,
                "completion_tokens": out.num_output_tokens,
                "target_forwards": out.num_forwards,
                "draft_tokens": out.num_draft_tokens,
                "accepted_tokens": out.num_accepted_tokens,
                "spec_steps": out.num_spec_steps,
            }
            if out.finished:
                return
            out = await anext(stream)

    def stats(self) -> dict[str, Any]:
        """Engine load: running/waiting requests and KV blocks (tests and debugging)."""
        s = self.engine.stats()
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_free_blocks": s.kv_free_blocks,
            "kv_cache_usage": s.kv_cache_usage,
        }

    def check_health(self) -> None:
        """Ray Serve's health check: the engine loop must be alive."""
        if not self.async_engine.is_running:
            raise RuntimeError("engine loop is not running")

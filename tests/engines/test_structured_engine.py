"""Structured outputs in the engine, on the embedded model: outputs parse and match their constraint, a
grammar ends its request, speculation (Lyanna fixed and adaptive, EAGLE, n-gram) gives the very outputs of
plain decoding, greedy and seeded, and a spec the grammar library cannot compile is refused at admission
without harming the requests in flight."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engines.engine import Completion, EngineConfig, LLMEngine
from engines.errors import InvalidRequestError
from engines.request import FinishReason
from engines.sampling import SamplingParams
from engines.structured_params import StructuredOutputParams
from tests.engines.test_seeded_speculation import ADAPTIVE

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ANSWER = 'root ::= "The answer is " [0-9]+ "."'


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# (conversation, constraint, check of the finished text)
CASES = [
    (
        ask("Describe a fictional person as JSON with name, age, city and hobbies."),
        StructuredOutputParams(json_schema=json.dumps(PERSON)),
        lambda text: jsonschema.validate(json.loads(text), PERSON),
    ),
    (
        ask("Give a JSON object with the name and color of a banana."),
        StructuredOutputParams(json_object=True),
        lambda text: isinstance(json.loads(text), dict) or pytest.fail(text),
    ),
    (
        ask("What is a typical US phone number format? Give one example."),
        StructuredOutputParams(regex=PHONE, param="guided_regex"),
        lambda text: re.fullmatch(PHONE, text) or pytest.fail(text),
    ),
    (
        ask("Is Paris the capital of France? Answer yes or no."),
        StructuredOutputParams(choice=("yes", "no"), param="guided_choice"),
        lambda text: text in ("yes", "no") or pytest.fail(text),
    ),
    (
        ask("What is 12 times 12?"),
        StructuredOutputParams(grammar=ANSWER, param="guided_grammar"),
        lambda text: re.fullmatch(r"The answer is [0-9]+\.", text) or pytest.fail(text),
    ),
]
MAX_TOKENS = 64


def params_for(kind: str, constraint: StructuredOutputParams, seed: int = 0) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=constraint)
    return SamplingParams(temperature=0.9, seed=seed, max_tokens=MAX_TOKENS, structured=constraint)


def run_batch(engine: LLMEngine, kind: str) -> list[Completion]:
    """Every case at once (one batch), plus one unconstrained request beside them."""
    convs = [c for c, _, _ in CASES] + [CASES[0][0]]
    params = [params_for(kind, s, seed=i) for i, (_, s, _) in enumerate(CASES)]
    return engine.generate(convs, [*params, SamplingParams(temperature=0, max_tokens=24)])


@pytest.fixture(scope="module")
def reference(engine_fp32):
    """Plain decoding of every case in one batch beside a free-text request, greedy and seeded: each
    constrained output is valid and ended with its grammar (no stop token emitted)."""
    out = {}
    for kind in ("greedy", "seeded"):
        done = run_batch(engine_fp32, kind)
        for (_, constraint, check), d in zip(CASES, done, strict=False):
            assert d.finish_reason == FinishReason.STOP, (kind, constraint.kind, d.text)
            check(d.text)
            assert not set(d.token_ids) & engine_fp32.tokenizer.stop_token_ids
        assert not done[-1].text.startswith("{")  # the free row was not held to the schema
        out[kind] = [d.token_ids for d in done]
    return out


def test_a_batched_output_equals_the_same_request_alone(engine_fp32, reference):
    """Every row keeps its own mask: requests alone give what they gave beside the others."""
    for i in (0, 3):
        conv, constraint, _ = CASES[i]
        for kind in ("greedy", "seeded"):
            alone = engine_fp32.generate([conv], params_for(kind, constraint, seed=i))[0].token_ids
            assert alone == reference[kind][i], (kind, constraint.kind)


def test_a_grammar_ends_its_request_even_with_ignore_eos(engine_fp32):
    params = SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, structured=StructuredOutputParams(choice=("yes", "no"))
    )
    done = engine_fp32.generate([CASES[3][0]], params)[0]
    assert done.finish_reason == FinishReason.STOP and done.text in ("yes", "no")


def test_a_bad_spec_is_refused_at_admission_and_the_engine_keeps_serving(engine_fp32, reference):
    engine = engine_fp32
    conv, constraint, check = CASES[0]
    good = engine.add_request(conv, params_for("greedy", constraint))
    engine.step()
    bad = [
        (
            StructuredOutputParams(json_schema='{"type": "object", "properties": {"a": {"type": "nope"}}}'),
            "json_schema",
        ),
        (StructuredOutputParams(json_schema="{not json"), "json_schema"),
        (StructuredOutputParams(regex="([0-9]", param="guided_regex"), "regex"),
        (StructuredOutputParams(grammar="root ::= ( ", param="guided_grammar"), "grammar"),
    ]
    for spec, kind in bad:
        with pytest.raises(InvalidRequestError) as err:
            engine.add_request(conv, SamplingParams(max_tokens=8, structured=spec))
        assert err.value.param == spec.param and kind in err.value.message
    assert len(engine.requests) == 1
    while engine.has_unfinished():
        engine.step()
    assert good.output_token_ids == reference["greedy"][0]
    check(good.output_text)


SPEC_ENGINES = {
    "lyanna": {"drafter": "lyanna", "spec_depth": 3, "spec_width": 2, "spec_budget": 6},
    "lyanna-adaptive": {"drafter": "lyanna", "spec_policy": "adaptive", "adaptive": ADAPTIVE},
    "eagle": {"drafter": "eagle", "spec_depth": 3, "spec_width": 2, "spec_budget": 6},
    "ngram": {"drafter": "ngram", "spec_depth": 4, "spec_width": 2, "spec_budget": 8},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPEC_ENGINES))
def test_speculation_gives_plain_decodings_constrained_outputs(name, reference, monkeypatch):
    """Greedy and seeded, in one batch with a free-text request: token for token the outputs of plain
    decoding; drafts held tokens the grammar forbids and were pruned, and drafts were accepted."""
    import engines.spec_decode.executor as executor_module

    pruned = []
    prune = executor_module.prune_draft

    def counted(state, tree, params):
        kept = prune(state, tree, params)
        pruned.append(tree.size - (kept.size if kept is not None else 1))
        return kept

    monkeypatch.setattr(executor_module, "prune_draft", counted)
    engine = LLMEngine(EngineConfig(dtype="float32", num_kv_blocks=512, **SPEC_ENGINES[name]))
    for kind in ("greedy", "seeded"):
        assert [c.token_ids for c in run_batch(engine, kind)] == reference[kind], kind
    assert engine.stats().spec.num_accepted_tokens > 0
    assert sum(pruned) > 0 and len(pruned) > 0


@pytest.mark.slow
def test_the_structured_benchmark_reports_validity_and_the_ratio(capsys):
    """`python -m engines.bench.structured` on one prompt: a valid record, both sides timed, the grammar's
    time counted, and the engine's hooks unwrapped afterwards."""
    import engines.spec_decode.executor as executor_module
    from engines.bench.structured import main
    from engines.structured_output import GrammarState

    hooks = (executor_module._prune_for_grammar, executor_module._mask_for_grammar, GrammarState.advance)
    argv = ["--num-prompts", "1", "--max-new-tokens", "96", "--drafter", "ngram"]
    out = main([*argv, "--warmup", "0"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    assert out["valid"] == 1.0 and out["num_prompts"] == 1 and out["tokens_per_s_ratio"] > 0
    constrained, free = out["configs"]["json_schema"], out["configs"]["free"]
    assert constrained["finish_reasons"] == {"stop": 1} and constrained["grammar_s"] > free["grammar_s"]
    assert (executor_module._prune_for_grammar, executor_module._mask_for_grammar, GrammarState.advance) == hooks

"""Beam search at the gateway: the step rule (``BeamSearch``, transformers') on hand-made
distributions, and the REST routes driving it through ``GatewayService`` over an engine that answers
each one-token request from a table of next-token probabilities.

transformers' equality on real models is ``tests/integration/test_beam_search_matches_hf.py``.
"""

from __future__ import annotations

import json
import math

import pytest

from gridserve.services.gateway.beam_search import BeamSearch, BeamSearchParams
from gridserve.services.gateway.routes import OpenAIRoutes
from gridserve.services.gateway.service import GatewayService
from gridserve.services.gateway.tokenizer import GatewayTokenizer
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.scheduler_output import TokenLogprobs
from tests.unit.gateway.fake_engine_client import FakeEngineClient
from tests.unit.gateway.scripted_engine import run

A, B, C, D, E, F, G, H, X, Y = range(300, 310)
EOS = 2
# next-token probabilities after each generated prefix: greedy takes A then E (0.5 x 0.35 = 0.175);
# the best two-token sequence is B X (0.4 x 0.9 = 0.36)
TABLE = {(): {A: 0.5, B: 0.4, C: 0.06, D: 0.04}, (A,): {E: 0.35, F: 0.3, G: 0.2, H: 0.15},
         (B,): {X: 0.9, Y: 0.05, C: 0.03, D: 0.02}}
ELSEWHERE = {E: 0.4, F: 0.3, G: 0.2, H: 0.1}


def _log(options: dict[int, float]) -> dict[int, float]:
    return {t: math.log(p) for t, p in options.items()}


def _search(width: int, max_tokens: int = 4, **options) -> BeamSearch:
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, **options)
    return BeamSearch(params, [1], [EOS], 100, lambda ids: " ".join(map(str, ids)))


def _drive(search: BeamSearch, table: dict, elsewhere: dict = ELSEWHERE) -> list:
    while not search.done:
        search.advance([_log(table.get(tuple(b.tokens), elsewhere)) for b in search.live])
    return search.results()


def test_the_best_sequence_is_found_where_greedy_misses_it():
    best, second = _drive(_search(2, max_tokens=2), TABLE)
    assert best.tokens == [B, X] and best.cum_logprob == pytest.approx(math.log(0.36))
    assert second.tokens == [A, E] and best.finish_reason == "length"
    assert best.score == pytest.approx(math.log(0.36) / 2)  # length_penalty 1: per token


def test_width_one_is_greedy():
    (only,) = _drive(_search(1, max_tokens=2), TABLE)
    assert only.tokens == [A, E]


def test_an_eos_outside_the_steps_best_width_does_not_finish_a_hypothesis():
    # transformers' rule: only the step's `width` best candidates may end; the rest back up live beams
    table = {(): {A: 0.6, EOS: 0.3, C: 0.1}}
    search = _search(1, max_tokens=3)
    search.advance([_log(table[()])])
    assert search.finished == [] and [b.tokens for b in search.live] == [[A]]


def test_an_eos_among_the_best_finishes_with_its_eos_counted_in_the_length():
    table = {(): {EOS: 0.5, A: 0.4, C: 0.1}, (A,): {B: 0.9, EOS: 0.05, C: 0.05}}
    results = _drive(_search(2, max_tokens=2, length_penalty=0.0), table)
    assert [r.tokens for r in results] == [[EOS], [A, B]]
    assert results[0].finish_reason == "stop" and results[0].text == ""
    # a length penalty that favours length puts the two-token sequence first: log .36 / 2 > log .5
    results = _drive(_search(2, max_tokens=2, length_penalty=2.0, early_stopping="never"), table)
    assert [r.tokens for r in results] == [[A, B], [EOS]]


def test_ignore_eos_makes_eos_an_ordinary_token():
    table = {(): {EOS: 0.5, A: 0.4, C: 0.1}}
    results = _drive(_search(2, max_tokens=2, ignore_eos=True), table, {A: 0.9, B: 0.1})
    assert [r.tokens for r in results] == [[EOS, A], [A, A]]


def test_early_stopping_true_ends_once_width_hypotheses_finished():
    table = {(): {EOS: 0.5, A: 0.3, C: 0.2}, (A,): {EOS: 0.6, B: 0.4}}
    search = _search(2, max_tokens=10, early_stopping=True)
    _drive(search, table, {B: 1.0})
    assert [r.tokens for r in search.results()] == [[EOS], [A, EOS]]
    assert search.live and len(search.live[0].tokens) == 2  # stopped with a live beam left


def test_a_stop_string_ends_a_beam_and_is_cut_from_its_text():
    search = _search(1, max_tokens=5, stop=[f"{E} "])
    (result,) = _drive(search, {(): {A: 1.0}}, {E: 0.9, F: 0.1})  # text "300 304 304 ..."
    assert result.finish_reason == "stop" and result.stop_reason == f"{E} "
    assert result.text == f"{A} " and result.tokens == [A, E, E]


def test_a_stop_token_ends_a_beam_naming_it():
    (result,) = _drive(_search(1, max_tokens=5, stop_token_ids=[F]), {(): {A: 1.0}}, {F: 0.9, E: 0.1})
    assert result.tokens == [A, F] and result.stop_reason == F and result.finish_reason == "stop"


def test_the_width_is_capped_by_max_logprobs_naming_the_field():
    with pytest.raises(InvalidArgumentError) as refused:
        BeamSearchParams(beam_width=11, max_tokens=4).check_width(20)
    assert refused.value.field == "beam_width"
    with pytest.raises(InvalidArgumentError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)


# ---- through the REST routes ---------------------------------------------------------------------
class TableEngine(FakeEngineClient):
    """Answers a one-token request with the table's distribution after its generated tokens (the
    prompt is the first request's): the arg-max token and the requested number of top logprobs."""

    def __init__(self) -> None:
        super().__init__("table:1")
        self.prompt_len: int | None = None
        self.requests: list[tuple[list[int], object]] = []

    async def add_request(self, request_id, token_ids, params, **_):
        self.requests.append((list(token_ids), params))
        self.prompt_len = self.prompt_len or len(token_ids)
        options = TABLE.get(tuple(token_ids[self.prompt_len:]), ELSEWHERE)
        top = sorted(_log(options).items(), key=lambda item: -item[1])[:params.logprobs]
        ids, lps = [t for t, _ in top], [lp for _, lp in top]
        self.queues[request_id].put_nowait(EngineCoreOutput(
            request_id, [ids[0]], [TokenLogprobs([ids[0], *ids], [lps[0], *lps], 1)], [], FinishReason.LENGTH))


def _post(tokenizer_dir, route: str, body: dict):
    async def go():
        tokenizer = GatewayTokenizer(str(tokenizer_dir))
        engine = TableEngine()
        service = GatewayService(tokenizer, [engine], "m", 4096, tokenizer.backend_tokenizer.get_vocab_size(), 20)
        response = await getattr(OpenAIRoutes(service, "m"), route)(json.dumps(body).encode())
        return response.status, json.loads(b"".join(response.chunks)), engine, tokenizer

    return run(go())


@pytest.mark.parametrize("route", ["completions", "chat_completions"])
def test_use_beam_search_answers_the_n_best_sequences_best_first(llama_tiny, route):
    base = {"prompt": "say"} if route == "completions" else {"messages": [{"role": "user", "content": "say"}]}
    status, body, engine, tokenizer = _post(llama_tiny, route, {**base, "use_beam_search": True, "n": 2,
                                                                "max_tokens": 2})
    assert status == 200, body
    texts = [c["text"] if "text" in c else c["message"]["content"] for c in body["choices"]]
    assert texts == [tokenizer.decode([B, X]), tokenizer.decode([A, E])]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 4
    # one prompt request, then one per live beam continuing it: one token each, 2 x n logprobs
    prompt = engine.requests[0][0]
    assert sorted(ids[len(prompt):] for ids, _ in engine.requests[1:]) == [[A], [B]]
    assert all(p.max_tokens == 1 and p.logprobs == 4 and p.temperature == 0 for _, p in engine.requests)


def test_several_prompts_each_get_their_beams(llama_tiny):
    status, body, _, _ = _post(llama_tiny, "completions", {"prompt": ["say", "say"], "use_beam_search": True,
                                                           "n": 2, "best_of": 2, "max_tokens": 1})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("fragment, field", [({"stream": True}, "stream"), ({"n": 11}, "n"),
                                             ({"n": 2, "best_of": 3}, "best_of"), ({"logprobs": 1}, "logprobs"),
                                             ({"top_p": 0.5}, "top_p"), ({"echo": True}, "echo")])
def test_what_beam_search_cannot_honour_is_refused_naming_the_field(llama_tiny, fragment, field):
    status, body, engine, _ = _post(llama_tiny, "completions", {"prompt": "say", "use_beam_search": True,
                                                                "max_tokens": 2, **fragment})
    assert status == 400 and body["error"]["param"] == field, body
    assert engine.requests == []


def test_neutral_sampling_values_are_accepted_with_beam_search(llama_tiny):
    status, body, _, _ = _post(llama_tiny, "completions", {"prompt": "say", "use_beam_search": True, "max_tokens": 2,
                                                           "temperature": 0, "top_p": 1.0, "presence_penalty": 0,
                                                           "stream": False})
    assert status == 200, body

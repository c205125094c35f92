"""The gateway's side of pooling models (issue 37): ``/v1/embeddings``, ``/score``, ``/rerank``,
``/classify`` and the typed ``Embed`` / ``Score`` RPCs over in-memory engines that answer pooling
requests (services/gateway/pooling*.py). Checked: every endpoint's shape, base64 embeddings as
OpenAI's client decodes them, BERT pair tokenization with token type ids, rerank order and top_n,
truncation, and the refusals naming the field (an empty or too long input list, an input longer than
the context, ``dimensions`` of a model without Matryoshka support, a pooling request to a generative
model and a generate request to a pooling model)."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from typing import Optional

import pytest
from tokenizers import Tokenizer, processors
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from gridserve.api.engine.v1 import engine_pb2
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.services.gateway.limits import RequestLimits
from gridserve.services.gateway.openapi import openapi_document
from gridserve.services.gateway.pooling import ModelInfo, encode_pair, encode_text
from gridserve.services.gateway.service import GatewayService
from gridserve.services.gateway.servicer import GatewayServicer
from gridserve.services.gateway.tokenizer import GatewayTokenizer
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError
from gridserve.shared.outputs import EngineCoreOutput, FinishReason
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.rpc.authz import RULES
from gridserve.shared.rpc.engine_client import EngineClient, EngineLostError
from tests.unit.gateway.fake_engine_client import FakeEngineClient

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "what", "is", "a", "list", "mutable", "sequence", "hi", "import",
         "os", "cat", "dog", "the", "sat", "on", "mat", "x"]
CLS, SEP = 2, 3
HIDDEN = 8
MAX_MODEL_LEN = 16


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> GatewayTokenizer:
    """A BERT-style word tokenizer: ``[CLS] a [SEP]`` alone, ``[CLS] a [SEP] b [SEP]`` (type ids 0 / 1) as a pair."""
    folder = tmp_path_factory.mktemp("bert-tokenizer")
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"cls_token": "[CLS]", "sep_token": "[SEP]"}))
    return GatewayTokenizer(str(folder))


EMBEDDER = ModelInfo("pooling", ("embed",), HIDDEN, {"architectures": ["BertModel"]})
MATRYOSHKA = ModelInfo("pooling", ("embed",), HIDDEN, {"architectures": ["BertModel"], "matryoshka_dimensions": [4, 8]})
CROSS_ENCODER = ModelInfo("pooling", ("classify", "score"), HIDDEN,
                          {"architectures": ["BertForSequenceClassification"], "id2label": {"0": "relevant"}})
CLASSIFIER = ModelInfo("pooling", ("classify",), HIDDEN,
                       {"architectures": ["BertForSequenceClassification"],
                        "id2label": {"0": "negative", "1": "neutral", "2": "positive"}})
GENERATIVE = ModelInfo()


def embedding_of(token_ids: list[int]) -> list[float]:
    """The fake engines' embedding: a vector that tells inputs apart (exact in float32)."""
    return [float((sum(token_ids) * (i + 1)) % 11) - 5.0 + 0.25 * i for i in range(HIDDEN)]


class _PoolingEngine(FakeEngineClient):
    """Answers each pooling request at once: an embedding (``embedding_of``, cut to ``dimensions``), a
    score (the pair's token ids summed / 100, raw or through a fake 'activation' that adds 1), or three
    class probabilities; ``lose``: requests to drop with the engine lost instead."""

    def __init__(self, name: str = "e0", lose: int = 0) -> None:
        super().__init__(name)
        self.lose = lose

    async def add_request(self, request_id, token_ids, params, parent_request_id="", traceparent="",
                          mm_features=None, output_token_ids=None, continuation=False, lora_name=None,
                          pooling_params=None, token_type_ids=None):
        self.added.append({"id": request_id, "token_ids": list(token_ids), "params": params,
                           "pooling_params": pooling_params, "token_type_ids": token_type_ids})
        if self.lose:
            self.lose -= 1
            self.queues[request_id].put_nowait(EngineLostError("gone", self, request_id, self.sessions))
            return
        p = pooling_params
        if p.task == "embed":
            values = embedding_of(token_ids)[:p.dimensions or HIDDEN]
        elif p.task == "score":
            values = [sum(token_ids) / 100 + (0.0 if p.activation is False else 1.0)]
        else:
            values = [0.25, 0.125, 0.625]
        self.queues[request_id].put_nowait(EngineCoreOutput(request_id=request_id, new_token_ids=[],
                                                            finish_reason=FinishReason.STOP, pooler_output=values))


_LOOP = asyncio.new_event_loop()  # one loop for the module: engines and services are built on it


def _run(coro):
    return _LOOP.run_until_complete(coro)


@pytest.fixture(scope="module", autouse=True)
def _close_loop():
    yield
    _LOOP.run_until_complete(_LOOP.shutdown_asyncgens())
    _LOOP.close()


async def _on_loop(fn, *args):
    return fn(*args)


def _engines(*specs) -> list:
    """Fake engines built on the module's loop (``FakeEngineClient`` takes the running loop)."""
    return [_run(_on_loop(_PoolingEngine, *spec)) for spec in specs]


def _service(tokenizer, info: ModelInfo, *engines, limits: Optional[RequestLimits] = None) -> GatewayService:
    return GatewayService(tokenizer, list(engines) or _engines(("e0",)), "model-path", MAX_MODEL_LEN, len(WORDS),
                          20, limits=limits, model_info=info)


def _servicer(tokenizer, info: ModelInfo, *engines, **kw) -> GatewayServicer:
    return GatewayServicer(_service(tokenizer, info, *engines, **kw), "served")


def _call(servicer: GatewayServicer, route: str, body: dict) -> tuple[int, dict]:
    api = servicer.pooling

    async def go():
        handler = {"embeddings": api.embeddings, "score": api.score_route, "rerank": api.rerank,
                   "classify": api.classify_route}[route]
        response = await handler(json.dumps(body).encode())
        return response.status, json.loads(b"".join(response.chunks))

    return _run(go())


def _engine(servicer: GatewayServicer) -> _PoolingEngine:
    return servicer.service.engines[0]


# ---- /v1/embeddings ----------------------------------------------------------------------------
def test_embeddings_answer_openais_shape_one_engine_request_per_input(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER)
    status, body = _call(servicer, "embeddings", {"model": "served", "input": ["hi", "what is a list"]})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "served"
    hi, lst = [CLS, 10, SEP], [CLS, 4, 5, 6, 7, SEP]
    assert [d["object"] for d in body["data"]] == ["embedding", "embedding"]
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][0]["embedding"] == embedding_of(hi) and body["data"][1]["embedding"] == embedding_of(lst)
    assert body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    added = _engine(servicer).added
    assert [a["token_ids"] for a in added] == [hi, lst]
    assert all(a["params"] is None and a["pooling_params"] == PoolingParams(task="embed") for a in added)
    assert all(a["token_type_ids"] is None for a in added)  # all 0: not sent


def test_embeddings_take_one_string_and_token_ids(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER)
    status, body = _call(servicer, "embeddings", {"input": "the cat"})
    assert status == 200 and len(body["data"]) == 1 and body["usage"]["prompt_tokens"] == 4
    status, body = _call(servicer, "embeddings", {"input": [4, 5, 6]})
    assert status == 200 and len(body["data"]) == 1 and body["data"][0]["embedding"] == embedding_of([4, 5, 6])
    status, body = _call(servicer, "embeddings", {"input": [[4, 5], [13, 14, 15]]})
    assert status == 200 and [d["embedding"] for d in body["data"]] == [embedding_of([4, 5]),
                                                                         embedding_of([13, 14, 15])]
    assert [a["token_ids"] for a in _engine(servicer).added[-2:]] == [[4, 5], [13, 14, 15]]


def test_base64_embeddings_are_little_endian_float32_as_openais_client_decodes_them(tokenizer):
    np = pytest.importorskip("numpy")
    servicer = _servicer(tokenizer, EMBEDDER)
    status, body = _call(servicer, "embeddings", {"input": ["hi", "the cat sat"], "encoding_format": "base64"})
    assert status == 200
    for item, text in zip(body["data"], ["hi", "the cat sat"]):
        raw = base64.b64decode(item["embedding"])
        assert raw == struct.pack(f"<{HIDDEN}f", *embedding_of(tokenizer.encode(text)))
        # the openai package's own decoding: np.frombuffer(base64.b64decode(data), dtype="float32")
        assert np.frombuffer(raw, dtype="float32").tolist() == embedding_of(tokenizer.encode(text))


def test_dimensions_normalize_and_user_reach_the_engine_on_a_matryoshka_model(tokenizer):
    servicer = _servicer(tokenizer, MATRYOSHKA)
    status, body = _call(servicer, "embeddings", {"input": "hi", "dimensions": 4, "normalize": False, "user": "u1"})
    assert status == 200 and len(body["data"][0]["embedding"]) == 4
    assert _engine(servicer).added[0]["pooling_params"] == PoolingParams(task="embed", dimensions=4, normalize=False)


def test_dimensions_of_a_model_without_matryoshka_support_is_a_400_naming_dimensions(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER)
    status, body = _call(servicer, "embeddings", {"input": "hi", "dimensions": 4})
    assert status == 400 and body["error"]["param"] == "dimensions" and "Matryoshka" in body["error"]["message"]
    status, body = _call(_servicer(tokenizer, MATRYOSHKA), "embeddings", {"input": "hi", "dimensions": 6})
    assert status == 400 and body["error"]["param"] == "dimensions"
    assert not _engine(servicer).added


@pytest.mark.parametrize("body, message", [
    ({"input": []}, "expected"),
    ({"input": ["hi", ""]}, "expected"),
    ({"input": [[]]}, "expected"),
    ({"input": ["hi"] * 5}, "--max-prompts-per-request"),
    ({"input": [4, 99]}, "out of range"),
])
def test_bad_inputs_are_400s_naming_input(tokenizer, body, message):
    servicer = _servicer(tokenizer, EMBEDDER, limits=RequestLimits(max_prompts_per_request=4))
    status, answer = _call(servicer, "embeddings", body)
    assert status == 400 and answer["error"]["param"] == "input", answer
    assert message in answer["error"]["message"]
    assert not _engine(servicer).added


def test_unknown_fields_and_a_bad_encoding_format_are_refused_naming_them(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER)
    status, body = _call(servicer, "embeddings", {"input": "hi", "encoding": "float"})
    assert status == 400 and body["error"]["param"] == "encoding"
    status, body = _call(servicer, "embeddings", {"input": "hi", "encoding_format": "int8"})
    assert status == 400 and body["error"]["param"] == "encoding_format"


def test_an_input_longer_than_max_model_len_is_a_400_unless_truncated_keeping_the_last_tokens(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER)
    words = WORDS[4:]  # 16 words: 18 tokens with [CLS] / [SEP], over 16
    long_text = " ".join(words)
    status, body = _call(servicer, "embeddings", {"input": ["hi", long_text]})
    assert status == 400 and body["error"]["param"] == "input"
    assert "input[1] is 18 tokens" in body["error"]["message"]
    assert "truncate_prompt_tokens" in body["error"]["message"]
    assert not _engine(servicer).added

    status, body = _call(servicer, "embeddings", {"input": long_text, "truncate_prompt_tokens": 6})
    assert status == 200, body
    ids = [WORDS.index(w) for w in words]
    assert _engine(servicer).added[-1]["token_ids"] == [CLS, *ids[-4:], SEP]  # the specials stay
    status, body = _call(servicer, "embeddings", {"input": long_text, "truncate_prompt_tokens": -1})
    assert status == 200 and _engine(servicer).added[-1]["token_ids"] == [CLS, *ids[-14:], SEP]
    status, body = _call(servicer, "embeddings", {"input": list(range(4, 20)) + [4, 5], "truncate_prompt_tokens": 5})
    assert status == 200 and _engine(servicer).added[-1]["token_ids"] == [17, 18, 19, 4, 5]  # token ids: the last 5
    status, body = _call(servicer, "embeddings", {"input": "hi", "truncate_prompt_tokens": 0})
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens"


def test_the_inputs_tokens_together_are_bounded_by_the_per_request_token_cap(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER, limits=RequestLimits(max_prompt_tokens_per_request=10))
    status, body = _call(servicer, "embeddings", {"input": ["what is a list", "the cat sat on the mat"]})
    assert status == 400 and body["error"]["param"] == "input" and "--max-prompt-tokens-per-request" in \
        body["error"]["message"]
    status, body = _call(servicer, "embeddings", {"input": ["the cat sat on the mat"]})  # one input always fits
    assert status == 200


# ---- the runner: pooling vs generate -----------------------------------------------------------
@pytest.mark.parametrize("route, body", [
    ("embeddings", {"input": "hi"}),
    ("score", {"text_1": "hi", "text_2": "os"}),
    ("rerank", {"query": "hi", "documents": ["os"]}),
    ("classify", {"input": "hi"}),
])
def test_a_pooling_request_to_a_generative_model_is_a_400_saying_it_generates(tokenizer, route, body):
    servicer = _servicer(tokenizer, GENERATIVE)
    status, answer = _call(servicer, route, body)
    assert status == 400 and answer["error"]["param"] == "model", answer
    assert "generates text" in answer["error"]["message"] and "does not support" in answer["error"]["message"]
    assert not _engine(servicer).added


def test_a_generate_request_to_a_pooling_model_is_a_400_naming_the_runner_and_the_endpoints(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER)

    async def go():
        out = []
        for handler, body in ((servicer.openai.completions, {"model": "served", "prompt": "hi"}),
                              (servicer.openai.chat_completions,
                               {"model": "served", "messages": [{"role": "user", "content": "hi"}]}),
                              (servicer.responses.create, {"model": "served", "input": "hi"})):
            response = await handler(json.dumps(body).encode())
            out.append((response.status, json.loads(b"".join(response.chunks))))
        return out

    for status, body in _run(go()):
        assert status == 400 and body["error"]["param"] == "model", body
        assert "pooling runner" in body["error"]["message"] and "/v1/embeddings" in body["error"]["message"]
    assert not _engine(servicer).added


def test_a_task_the_model_does_not_serve_is_a_400_naming_its_endpoints(tokenizer):
    status, body = _call(_servicer(tokenizer, CROSS_ENCODER), "embeddings", {"input": "hi"})
    assert status == 400 and body["error"]["param"] == "model"
    assert "Embeddings API" in body["error"]["message"] and "/score" in body["error"]["message"]
    status, body = _call(_servicer(tokenizer, EMBEDDER), "classify", {"input": "hi"})
    assert status == 400 and body["error"]["param"] == "model" and "/v1/embeddings" in body["error"]["message"]


def test_another_model_name_is_a_404(tokenizer):
    status, body = _call(_servicer(tokenizer, EMBEDDER), "embeddings", {"model": "other", "input": "hi"})
    assert status == 404 and body["error"]["param"] == "model"


# ---- /score and /rerank --------------------------------------------------------------------------
def test_a_cross_encoder_scores_each_pair_tokenized_as_a_pair_with_token_type_ids(tokenizer):
    servicer = _servicer(tokenizer, CROSS_ENCODER)
    status, body = _call(servicer, "score", {"text_1": "what is a list", "text_2": ["a mutable sequence", "hi"]})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "served" and body["id"].startswith("score-")
    first = [CLS, 4, 5, 6, 7, SEP, 6, 8, 9, SEP]
    second = [CLS, 4, 5, 6, 7, SEP, 10, SEP]
    added = _engine(servicer).added
    assert [a["token_ids"] for a in added] == [first, second]
    assert added[0]["token_type_ids"] == [0] * 6 + [1] * 4 and added[1]["token_type_ids"] == [0] * 6 + [1] * 2
    assert all(a["pooling_params"] == PoolingParams(task="score") for a in added)
    assert body["data"] == [{"index": 0, "object": "score", "score": sum(first) / 100 + 1},
                            {"index": 1, "object": "score", "score": sum(second) / 100 + 1}]
    assert body["usage"] == {"prompt_tokens": 18, "total_tokens": 18}
    # the tokenizer's own pair encoding (transformers' tokenizer(text_1, text_2) reads the same template)
    reference = tokenizer.backend_tokenizer.encode("what is a list", "a mutable sequence")
    assert reference.ids == first and reference.type_ids == added[0]["token_type_ids"]


def test_score_pairs_up_one_to_one_and_refuses_mismatched_lists_naming_text_2(tokenizer):
    servicer = _servicer(tokenizer, CROSS_ENCODER)
    status, body = _call(servicer, "score", {"text_1": ["hi", "the cat"], "text_2": ["os", "the mat"]})
    assert status == 200 and len(body["data"]) == 2
    assert [a["token_ids"] for a in _engine(servicer).added] == [[CLS, 10, SEP, 12, SEP],
                                                                 [CLS, 15, 13, SEP, 15, 18, SEP]]
    status, body = _call(servicer, "score", {"text_1": ["hi", "the cat"], "text_2": ["os", "the mat", "x"]})
    assert status == 400 and body["error"]["param"] == "text_2"
    status, body = _call(servicer, "score", {"text_1": [], "text_2": "os"})
    assert status == 400 and body["error"]["param"] == "text_1"


def test_activation_false_asks_for_raw_logits_under_both_of_vllms_names(tokenizer):
    for name in ("activation", "use_activation"):
        servicer = _servicer(tokenizer, CROSS_ENCODER)
        status, body = _call(servicer, "score", {"text_1": "hi", "text_2": "os", name: False})
        assert status == 200 and body["data"][0]["score"] == sum([CLS, 10, SEP, 12, SEP]) / 100
        assert _engine(servicer).added[0]["pooling_params"] == PoolingParams(task="score", activation=False)
    status, body = _call(servicer, "score", {"text_1": "hi", "text_2": "os", "activation": True,
                                             "use_activation": False})
    assert status == 400 and body["error"]["param"] == "use_activation"


def test_a_long_pair_is_refused_unless_truncated_longest_first(tokenizer):
    servicer = _servicer(tokenizer, CROSS_ENCODER)
    long_doc = " ".join(WORDS[4:])
    status, body = _call(servicer, "score", {"text_1": "hi", "text_2": long_doc})
    assert status == 400 and body["error"]["param"] == "text_2" and "truncate_prompt_tokens" in body["error"]["message"]
    status, body = _call(servicer, "score", {"text_1": "what is a list", "text_2": long_doc, "truncate_prompt_tokens": 11})
    assert status == 200
    sent = _engine(servicer).added[-1]
    # 11 - 3 specials = 8 tokens: the query (4) and the document's first 4 (the longer loses its tail)
    assert sent["token_ids"] == [CLS, 4, 5, 6, 7, SEP, 4, 5, 6, 7, SEP]


def test_an_embedding_model_scores_by_cosine_similarity(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER)
    status, body = _call(servicer, "score", {"text_1": "hi", "text_2": ["hi", "the cat"]})
    assert status == 200, body
    a, b = embedding_of([CLS, 10, SEP]), embedding_of([CLS, 15, 13, SEP])
    cos = sum(x * y for x, y in zip(a, b)) / (sum(x * x for x in a) ** 0.5 * sum(y * y for y in b) ** 0.5)
    assert body["data"][0]["score"] == pytest.approx(1.0)
    assert body["data"][1]["score"] == pytest.approx(cos)
    added = _engine(servicer).added
    assert len(added) == 2 and all(x["pooling_params"].task == "embed" for x in added)  # "hi" embedded once


def test_rerank_sorts_by_relevance_keeps_top_n_and_returns_documents(tokenizer):
    servicer = _servicer(tokenizer, CROSS_ENCODER)
    documents = ["hi", "the cat sat on the mat", {"text": "a mutable sequence"}, "os"]
    status, body = _call(servicer, "rerank", {"model": "served", "query": "what is a list", "documents": documents,
                                              "top_n": 3})
    assert status == 200, body
    texts = ["hi", "the cat sat on the mat", "a mutable sequence", "os"]
    scores = [sum(tokenizer.backend_tokenizer.encode("what is a list", t).ids) / 100 + 1 for t in texts]
    order = sorted(range(4), key=lambda i: -scores[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    assert [r["relevance_score"] for r in body["results"]] == [scores[i] for i in order]
    assert [r["document"] for r in body["results"]] == [{"text": texts[i]} for i in order]
    assert body["model"] == "served" and body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    status, body = _call(servicer, "rerank", {"query": "hi", "documents": texts, "return_documents": False})
    assert status == 200 and len(body["results"]) == 4 and all("document" not in r for r in body["results"])
    status, body = _call(servicer, "rerank", {"query": "hi", "documents": []})
    assert status == 400 and body["error"]["param"] == "documents"


# ---- /classify -----------------------------------------------------------------------------------
def test_classify_answers_labels_from_id2label_and_probabilities(tokenizer):
    servicer = _servicer(tokenizer, CLASSIFIER)
    status, body = _call(servicer, "classify", {"input": ["hi", "the cat"]})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "served"
    assert body["data"] == [{"index": i, "label": "positive", "probs": [0.25, 0.125, 0.625], "num_classes": 3}
                            for i in range(2)]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert _engine(servicer).added[0]["pooling_params"] == PoolingParams(task="classify")


# ---- engines -------------------------------------------------------------------------------------
def test_a_request_whose_engine_is_lost_is_sent_again_to_a_live_one(tokenizer):
    lost, live = _engines(("e0", 1), ("e1",))
    servicer = _servicer(tokenizer, EMBEDDER, lost, live)
    lost.serving = True

    async def go():
        servicer.service.router.choose = lambda candidates, in_flight, rank, prefix_keys=(): 0 if not lost.added else 1
        return await servicer.pooling.embeddings(json.dumps({"input": "hi"}).encode())

    response = _run(go())
    _run(asyncio.sleep(0.01))  # the abort on the lost engine runs on the loop
    assert response.status == 200
    assert len(lost.added) == 1 and len(live.added) == 1 and live.added[0]["id"] != lost.added[0]["id"]
    assert lost.aborted == [lost.added[0]["id"]] and not lost.queues and not live.queues


def test_pooling_requests_count_in_the_gateways_request_metrics(tokenizer):
    from gridserve.services.gateway.observability import GatewayMetrics

    metrics = GatewayMetrics("served")
    service = GatewayService(tokenizer, _engines(("e0",)), "model-path", MAX_MODEL_LEN, len(WORDS), 20,
                             metrics=metrics, model_info=EMBEDDER)
    response = _run(GatewayServicer(service, "served").pooling.embeddings(json.dumps({"input": ["hi", "x"]}).encode()))
    assert response.status == 200
    registry = metrics.registry
    assert registry.get_sample_value("vllm:request_success_total",
                                     {"model_name": "served", "finished_reason": "stop"}) == 2
    assert registry.get_sample_value("vllm:e2e_request_latency_seconds_count", {"model_name": "served"}) == 2
    assert registry.get_sample_value("gridserve:gateway_requests_in_flight", {"model_name": "served",
                                                                              "engine": "0"}) == 0


def test_no_engine_is_a_503(tokenizer):
    engine, = _engines(("e0",))
    servicer = _servicer(tokenizer, EMBEDDER, engine)
    engine.ready.clear()
    status, body = _call(servicer, "embeddings", {"input": "hi"})
    assert status == 503


def test_the_engine_client_sends_pooling_params_and_token_type_ids_without_sampling_params():
    sent = []

    class _Stub:
        async def AddRequest(self, message, timeout=None, metadata=None):
            sent.append(message)

    client = EngineClient.__new__(EngineClient)
    client.address, client.gateway_id, client.stub = "e0", "g", _Stub()
    client.ready = __import__("threading").Event()
    client.ready.set()
    _run(client.add_request("r1", [2, 4, 3, 5, 3], None, pooling_params=PoolingParams(task="score", activation=False),
                                   token_type_ids=[0, 0, 0, 1, 1]))
    message: engine_pb2.AddRequestRequest = sent[0]
    assert not message.HasField("sampling_params") and message.HasField("pooling_params")
    assert message.pooling_params.task == "score" and message.pooling_params.activation is False
    assert not message.pooling_params.HasField("dimensions")
    assert list(message.token_type_ids) == [0, 0, 0, 1, 1]


# ---- the typed gRPC API, authorization and OpenAPI -----------------------------------------------
class _Context:
    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()


def test_embed_and_score_rpcs(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER)
    request = gateway_pb2.EmbedRequest(inputs=[gateway_pb2.EmbedInput(text="hi"),
                                               gateway_pb2.EmbedInput(token_ids=gateway_pb2.TokenIds(ids=[4, 5]))])
    response = _run(servicer.Embed(request, _Context()))
    assert [e.index for e in response.embeddings] == [0, 1]
    assert list(response.embeddings[1].values) == pytest.approx(embedding_of([4, 5]))
    assert response.usage.prompt_tokens == 5
    with pytest.raises(InvalidArgumentError) as info:
        _run(servicer.Embed(gateway_pb2.EmbedRequest(inputs=[gateway_pb2.EmbedInput(text="hi")], dimensions=4),
                                   _Context()))
    assert info.value.field == "dimensions"
    with pytest.raises(InvalidArgumentError) as info:
        _run(servicer.Embed(gateway_pb2.EmbedRequest(), _Context()))
    assert info.value.field == "inputs"

    cross = _servicer(tokenizer, CROSS_ENCODER)
    response = _run(cross.Score(gateway_pb2.ScoreRequest(text_1=["hi"], text_2=["os", "x"]), _Context()))
    assert list(response.scores) == pytest.approx([sum([CLS, 10, SEP, 12, SEP]) / 100 + 1,
                                                   sum([CLS, 10, SEP, 19, SEP]) / 100 + 1])
    with pytest.raises(InvalidArgumentError) as info:
        _run(_servicer(tokenizer, GENERATIVE).Score(gateway_pb2.ScoreRequest(text_1=["a"], text_2=["b"]),
                                                           _Context()))
    assert info.value.field == "model"


def test_generate_rpcs_to_a_pooling_model_are_refused_naming_model(tokenizer):
    servicer = _servicer(tokenizer, EMBEDDER)

    async def go():
        return await servicer.Complete(gateway_pb2.CompleteRequest(text="hi"), _Context())

    with pytest.raises(InvalidArgumentError) as info:
        _run(go())
    assert info.value.field == "model" and "pooling runner" in info.value.message


def test_the_pooling_rpcs_have_authorization_rows_for_the_edge_and_admin():
    for method in ("Embed", "Score", "OpenAIEmbeddings", "OpenAIScore", "OpenAIRerank", "OpenAIClassify"):
        assert RULES[f"/gridserve.gateway.v1.Gateway/{method}"] == {"edge", "admin"}


def test_openapi_documents_the_pooling_routes():
    paths = json.loads(openapi_document("1"))["paths"]
    for path in ("/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify",
                 "/v1/classify"):
        assert "post" in paths[path]


def test_model_info_from_an_engines_getinfo_and_the_model_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"0": "no", "1": "yes"}, "is_matryoshka": True}))
    info = ModelInfo.from_engine_info(engine_pb2.GetInfoResponse(model_path=str(tmp_path), runner="pooling",
                                                                 supported_tasks=["classify"], hidden_size=32))
    assert info.pooling and info.supported_tasks == ("classify",) and info.hidden_size == 32
    assert info.labels() == {0: "no", 1: "yes"}
    old = ModelInfo.from_engine_info(engine_pb2.GetInfoResponse(model_path=str(tmp_path / "none")))
    assert not old.pooling and old.supported_tasks == ("generate",) and old.hf_config == {}


def test_text_truncation_keeps_the_specials(tokenizer):
    assert encode_text(tokenizer, "the cat sat on the mat", True, 4).token_ids == [CLS, 15, 18, SEP]
    assert encode_text(tokenizer, "the cat sat on the mat", False, 2).token_ids == [15, 18]
    pair = encode_pair(tokenizer, "the cat sat", "on the mat", 7)
    assert pair.token_ids == [CLS, 15, 13, SEP, 17, 15, SEP] and pair.token_type_ids == [0, 0, 0, 0, 1, 1, 1]


def test_engine_dead_error_is_the_no_engine_answer(tokenizer):
    async def go():
        service = _service(tokenizer, EMBEDDER, _PoolingEngine("e0"))
        service.engines[0].ready.clear()
        from gridserve.services.gateway.pooling import PoolingInput

        await service.pool(PoolingInput([2, 3]), PoolingParams())

    with pytest.raises(EngineDeadError):
        _run(go())

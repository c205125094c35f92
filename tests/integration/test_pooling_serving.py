"""Pooling models served end to end (issue 37): worker, engine, gateway and the Envoy edge on
loopback, the tiny random checkpoints of ``test_pooling_models`` (a BERT embedder with mean pooling
and a Normalize module; an XLM-R cross-encoder of one label), driven with the official ``openai``
client and plain HTTP.

``gridserve serve`` picks the pooling runner for an encoder by itself. Checked: ``embeddings.create``
(the client's default base64 and ``float``) equals ``SentenceTransformer.encode`` within 1e-5
cosine; ``/score`` on the cross-encoder equals ``CrossEncoder.predict``; ``/rerank`` orders the
documents as those scores do; the refusals naming the field through the edge (``dimensions`` of a
model without Matryoshka support, an input longer than the context, an empty input list, a
generate request to a pooling model, a score request to an embedder that is not a cross-encoder
answered by cosine similarity instead).
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gridserve.launcher import free_port

from .services import ENGINE_ARGS, deployment
from .test_pooling_models import PAIRS, TEXTS, pooling_checkpoints

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
np = pytest.importorskip("numpy")
pytest.importorskip("sentence_transformers")

ENGINE = [*ENGINE_ARGS, "--dtype", "float32"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return pooling_checkpoints(tmp_path_factory.mktemp("pooling"))


def _stack(folder: Path, logs: Path, name: str):
    return deployment(folder, logs, edge_port=free_port(), engine_args=ENGINE, served_model_name=name)


@pytest.fixture(scope="module")
def embedder(folders, tmp_path_factory):
    with _stack(folders["bert"], tmp_path_factory.mktemp("logs-bert"), "minilm") as launcher:
        yield launcher


@pytest.fixture(scope="module")
def reranker(folders, tmp_path_factory):
    with _stack(folders["xlmr-reranker"], tmp_path_factory.mktemp("logs-rerank"), "reranker") as launcher:
        yield launcher


def _client(stack):
    return openai.OpenAI(base_url=f"http://{stack.edge_address}/v1", api_key="-", max_retries=0, timeout=120)


def _post(stack, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{stack.edge_address}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _cosines(ours, reference):
    import torch

    ours, reference = torch.as_tensor(ours, dtype=torch.float32), torch.as_tensor(reference, dtype=torch.float32)
    return torch.nn.functional.cosine_similarity(ours, reference, dim=-1)


def test_openai_embeddings_equal_sentence_transformers(embedder, folders):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(folders["bert"]), device="cpu").encode(TEXTS, convert_to_numpy=True)
    with _client(embedder) as client:
        for encoding in ("base64", "float"):
            reply = client.embeddings.create(model="minilm", input=TEXTS, encoding_format=encoding)
            assert reply.model == "minilm" and [d.index for d in reply.data] == list(range(len(TEXTS)))
            vectors = [d.embedding for d in reply.data]
            if encoding == "base64":  # asked for explicitly, the client hands the text over as is
                vectors = [np.frombuffer(base64.b64decode(v), dtype="<f4").tolist() for v in vectors]
            cosine = _cosines(vectors, reference)
            assert float((1 - cosine).abs().max()) < 1e-5, (encoding, cosine)
            assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS)
        # no encoding_format: the client asks for base64 itself and decodes it with numpy
        default = client.embeddings.create(model="minilm", input=TEXTS[1])
        assert float(1 - _cosines([default.data[0].embedding], reference[1:2])[0]) < 1e-5


def test_embedding_refusals_name_the_field_through_the_edge(embedder):
    status, body = _post(embedder, "/v1/embeddings", {"input": "hi", "dimensions": 16})
    assert status == 400 and body["error"]["param"] == "dimensions" and "Matryoshka" in body["error"]["message"]
    status, body = _post(embedder, "/v1/embeddings", {"input": []})
    assert status == 400 and body["error"]["param"] == "input"
    long_text = " ".join(["return self._value + other"] * 100)  # far over max_model_len (128)
    status, body = _post(embedder, "/v1/embeddings", {"input": ["hi", long_text]})
    assert status == 400 and body["error"]["param"] == "input" and "truncate_prompt_tokens" in body["error"]["message"]
    status, body = _post(embedder, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 32})
    assert status == 200 and body["usage"]["prompt_tokens"] == 32
    status, body = _post(embedder, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "model" and "pooling runner" in body["error"]["message"]


def test_an_embedder_scores_by_cosine_similarity(embedder, folders):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folders["bert"]), device="cpu")
    status, body = _post(embedder, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:3]})
    assert status == 200, body
    reference = _cosines(st.encode([TEXTS[0]] * 2), st.encode(TEXTS[1:3]))
    assert [d["score"] for d in body["data"]] == pytest.approx(reference.tolist(), abs=1e-5)


def test_score_equals_cross_encoder_predict(reranker, folders):
    from sentence_transformers import CrossEncoder

    predicted = CrossEncoder(str(folders["xlmr-reranker"]), device="cpu").predict(PAIRS)
    status, body = _post(reranker, "/score", {"model": "reranker", "text_1": [a for a, _ in PAIRS],
                                              "text_2": [b for _, b in PAIRS]})
    assert status == 200, body
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(PAIRS)))
    assert [d["score"] for d in body["data"]] == pytest.approx([float(p) for p in predicted], abs=1e-5)
    status, v1 = _post(reranker, "/v1/score", {"text_1": PAIRS[0][0], "text_2": PAIRS[0][1]})
    assert status == 200 and v1["data"][0]["score"] == pytest.approx(float(predicted[0]), abs=1e-5)


def test_rerank_orders_documents_as_the_cross_encoder_scores_them(reranker, folders):
    from sentence_transformers import CrossEncoder

    query = PAIRS[0][0]
    documents = [b for _, b in PAIRS] + [TEXTS[2]]
    predicted = [float(s) for s in CrossEncoder(str(folders["xlmr-reranker"]), device="cpu").predict(
        [(query, d) for d in documents])]
    order = sorted(range(len(documents)), key=lambda i: -predicted[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, body = _post(reranker, path, {"query": query, "documents": documents, "top_n": 3})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == order[:3]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([predicted[i] for i in order[:3]],
                                                                                abs=1e-5)
        assert [r["document"]["text"] for r in body["results"]] == [documents[i] for i in order[:3]]


def test_the_typed_embed_and_score_rpcs_through_the_edge(embedder, reranker, folders):
    """Native gRPC through the edge's port: ``Embed`` equals the REST route's vectors, ``Score`` the
    cross-encoder's; a generate RPC to the pooling model is INVALID_ARGUMENT naming ``model``."""
    import grpc
    from sentence_transformers import CrossEncoder

    from gridserve.api.gateway.v1 import gateway_pb2

    from .services import gateway_stub

    status, rest = _post(embedder, "/v1/embeddings", {"input": TEXTS[:2]})
    with grpc.insecure_channel(embedder.edge_address) as channel:
        stub = gateway_stub(channel)
        reply = stub.Embed(gateway_pb2.EmbedRequest(inputs=[gateway_pb2.EmbedInput(text=t) for t in TEXTS[:2]]),
                           timeout=60)
        assert [list(e.values) for e in reply.embeddings] == [pytest.approx(d["embedding"], abs=1e-6)
                                                               for d in rest["data"]]
        assert reply.usage.prompt_tokens == rest["usage"]["prompt_tokens"]
        with pytest.raises(grpc.RpcError) as refused:
            stub.Complete(gateway_pb2.CompleteRequest(text="hi"), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in refused.value.details()
    predicted = CrossEncoder(str(folders["xlmr-reranker"]), device="cpu").predict(PAIRS)
    with grpc.insecure_channel(reranker.edge_address) as channel:
        reply = gateway_stub(channel).Score(gateway_pb2.ScoreRequest(text_1=[a for a, _ in PAIRS],
                                                                     text_2=[b for _, b in PAIRS]), timeout=60)
    assert list(reply.scores) == pytest.approx([float(p) for p in predicted], abs=1e-5)


def test_embeddings_of_a_cross_encoder_are_refused_naming_model(reranker):
    status, body = _post(reranker, "/v1/embeddings", {"input": "hi"})
    assert status == 400 and body["error"]["param"] == "model" and "/score" in body["error"]["message"]


def test_the_in_process_engine_client_serves_a_pooling_request(folders):
    """``LocalEngineClient`` (``AsyncLLM``'s in-process engine) takes the same pooling keywords as the
    gateway's remote client: a BERT pair with its segment ids scores as the classifier's logits do offline."""
    import asyncio

    from gridserve.local_engine_client import LocalEngineClient
    from gridserve.services.gateway.pooling import encode_pair
    from gridserve.services.gateway.tokenizer import GatewayTokenizer
    from gridserve.shared.config import GridserveConfig
    from gridserve.shared.pooling import PoolingParams

    folder = folders["bert-classifier"]
    pair = encode_pair(GatewayTokenizer(str(folder)), PAIRS[0][0], PAIRS[0][1], None)
    assert pair.token_type_ids and 1 in pair.token_type_ids

    async def go():
        config = GridserveConfig.from_kwargs(model=str(folder), dtype="float32").finalize()
        client = await asyncio.to_thread(LocalEngineClient, config, asyncio.get_running_loop())
        try:
            outputs: asyncio.Queue = asyncio.Queue()
            client.register("r", outputs)
            await client.add_request("r", pair.token_ids, None, pooling_params=PoolingParams(task="classify"),
                                     token_type_ids=pair.token_type_ids)
            while not (out := await asyncio.wait_for(outputs.get(), 60)).finished:
                pass
            return out.pooler_output
        finally:
            await client.close()

    values = asyncio.run(go())
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([pair.token_ids]), token_type_ids=torch.tensor([pair.token_type_ids]),
                       attention_mask=torch.ones(1, len(pair.token_ids), dtype=torch.long)).logits[0]
    assert values == pytest.approx(logits.softmax(-1).tolist(), abs=1e-5)  # three labels: softmax

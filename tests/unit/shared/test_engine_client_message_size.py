"""A request whose images make its ``AddRequest`` larger than the gRPC message limit is the caller's
error (INVALID_ARGUMENT / HTTP 400 naming ``mm_features``), found before sending: not a full queue
(RESOURCE_EXHAUSTED / 429, which tells the client to retry the same thing later)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.services.gateway.api_errors import to_api_error
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.rpc import client
from gridserve.shared.rpc.engine_client import EngineClient
from gridserve.shared.sampling_params import SamplingParams

LIMIT = 1 << 20  # the channels' send limit in this test (64 MiB in a deployment)


class _Engine(engine_pb2_grpc.EngineCoreServicer):
    def __init__(self) -> None:
        self.added: list[str] = []

    async def AddRequest(self, request, context):
        self.added.append(request.request_id)
        return engine_pb2.AddRequestResponse()

    async def StreamOutputs(self, request, context):
        yield engine_pb2.StreamOutputsResponse()
        await asyncio.Event().wait()

    async def GetInfo(self, request, context):
        return engine_pb2.GetInfoResponse()


def _image(num_bytes: int) -> ImageFeature:
    side = int((num_bytes // 12) ** 0.5)
    return ImageFeature(bytes(4 * 3 * side * side), (3, side, side), offset=0, length=4)


def test_images_over_the_message_limit_are_invalid_argument_before_sending(monkeypatch):
    options = [(name, LIMIT if name == "grpc.max_send_message_length" else value)
               for name, value in client.CHANNEL_OPTIONS]
    monkeypatch.setattr(client, "CHANNEL_OPTIONS", options)

    async def go():
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4 * LIMIT)])
        engine = _Engine()
        engine_pb2_grpc.add_EngineCoreServicer_to_server(engine, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        engines = EngineClient(f"127.0.0.1:{port}", "gw")
        try:
            for _ in range(500):
                if engines.ready.is_set():
                    break
                await asyncio.sleep(0.01)
            params = SamplingParams(max_tokens=2)
            await engines.add_request("small", [1, 2, 3, 4, 5], params, mm_features=[_image(LIMIT // 2)])
            with pytest.raises(InvalidArgumentError) as error:
                await engines.add_request("big", [1, 2, 3, 4, 5], params, mm_features=[_image(2 * LIMIT)])
            assert error.value.field == "mm_features" and str(LIMIT) in str(error.value)
            assert to_api_error(error.value).status == 400
            assert engine.added == ["small"]
        finally:
            await engines.close()
            await server.stop(None)

    asyncio.run(go())

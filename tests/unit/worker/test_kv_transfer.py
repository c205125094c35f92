"""Disaggregated prefill / decode, the worker's side: KV blocks pulled over ``KVTransfer.PullBlocks``
between two KV caches (chunked, checksummed, token-checked, released once pulled), every KV cache
group of a hybrid cache (a window group's null entries neither sent nor written), the step hook's
fallback when a pull fails, and the authorization row: only this deployment's workers may pull."""

from __future__ import annotations

import dataclasses
import time

import grpc
import pytest
import torch

from gridserve.api.worker.v1 import worker_pb2, worker_pb2_grpc
from gridserve.certificates import LocalCA
from gridserve.services.worker.kv_connector import (
    GrpcKVConnector,
    KVCacheView,
    KVTransferError,
    Receipt,
)
from gridserve.services.worker.kv_transfer import SERVICE, KVStepHook, KVTransferServicer
from gridserve.shared.kv_transfer import KVSend, KVTransferParams
from gridserve.shared.readiness import State
from gridserve.shared.rpc import authz
from gridserve.shared.rpc.client import make_channel
from gridserve.shared.rpc.kv_convert import (
    kv_params_from_pb,
    kv_params_to_pb,
    kv_send_from_pb,
    kv_send_to_pb,
)
from gridserve.shared.rpc.server import RpcServer
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput

NUM_BLOCKS, BLOCK_SIZE = 12, 4


def _caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8, generator=g) for _ in range(3)]  # K/V layers
    return [*full, torch.randn(NUM_BLOCKS, BLOCK_SIZE, 24, generator=g).to(torch.bfloat16)]  # an MLA latent


def _serve(connector: GrpcKVConnector, tls=None) -> RpcServer:
    server = RpcServer("127.0.0.1", 0, role="worker", tls=tls)
    servicer = KVTransferServicer(connector)
    server.add_service(SERVICE, lambda s: worker_pb2_grpc.add_KVTransferServicer_to_server(servicer, s))
    server.start()
    server.readiness.set(State.READY)
    return server


def _params(address: str, send: KVSend, token: str | None = None) -> KVTransferParams:
    return KVTransferParams(send.transfer_id, token or send.token, (address,), send.block_ids,
                            len(send.block_ids) * BLOCK_SIZE, send.deadline_unix_s, BLOCK_SIZE, "auto", "m")


@pytest.fixture()
def pair():
    producer_caches, consumer_caches = _caches(0), _caches(1)
    producer = GrpcKVConnector(KVCacheView(lambda: producer_caches), chunk_bytes=600)  # several chunks a layer
    consumer = GrpcKVConnector(KVCacheView(lambda: consumer_caches))
    server = _serve(producer)
    yield producer, consumer, producer_caches, consumer_caches, server.address
    consumer.close()
    server.shutdown()


def test_pulled_blocks_equal_the_producer_s_and_the_transfer_is_released(pair):
    producer, consumer, theirs, mine, address = pair
    send = KVSend("t1", "secret", (7, 2, 9), time.time() + 30)
    producer.register(send)
    received = consumer.pull(_params(address, send), [1, 5, 3])
    for p, c in zip(theirs, mine):
        dim = 1 if p.dim() == 5 else 0
        assert torch.equal(c.index_select(dim, torch.tensor([1, 5, 3])), p.index_select(dim, torch.tensor([7, 2, 9])))
    expected = sum(t.element_size() * t.numel() // NUM_BLOCKS * 3 for t in theirs)
    assert received == expected  # the KV bytes of exactly the prompt's blocks
    assert producer.take_sent() == (["t1"], expected)
    with pytest.raises(KVTransferError, match="NOT_FOUND"):  # pulled once: released
        consumer.pull(_params(address, send), [1, 5, 3])


def test_a_wrong_token_is_refused_and_an_expired_transfer_is_gone(pair):
    producer, consumer, _, mine, address = pair
    before = [t.clone() for t in mine]
    send = KVSend("t2", "secret", (4,), time.time() + 30)
    producer.register(send)
    with pytest.raises(KVTransferError, match="PERMISSION_DENIED"):
        consumer.pull(_params(address, send, token="guess"), [0])
    producer.register(KVSend("t3", "s", (4,), time.time() - 1))
    with pytest.raises(KVTransferError, match="NOT_FOUND"):
        consumer.pull(_params(address, KVSend("t3", "s", (4,), time.time() + 5)), [0])
    with pytest.raises(KVTransferError, match="expired"):
        consumer.pull(_params(address, KVSend("t2", "secret", (4,), time.time() - 1)), [0])
    assert all(torch.equal(a, b) for a, b in zip(before, mine))


def test_a_corrupted_chunk_fails_its_checksum(pair):
    producer, consumer, _, _, address = pair
    send = KVSend("t4", "secret", (3,), time.time() + 30)
    producer.register(send)
    msg = next(iter(worker_pb2_grpc.KVTransferStub(make_channel(address)).PullBlocks(
        worker_pb2.PullBlocksRequest(transfer_id="t4", token="secret"), timeout=5))).chunk
    msg.data.data = bytes([msg.data.data[0] ^ 1]) + msg.data.data[1:]
    with pytest.raises(KVTransferError, match="checksum"):
        Receipt(consumer.view, ((3,),), ([0],)).write(msg)


def test_a_failed_pull_leaves_the_request_out_until_the_engine_forgets_it(pair):
    producer, consumer, _, _, address = pair
    hook = KVStepHook(consumer)
    params = _params(address, KVSend("nope", "x", (1, 2), time.time() + 30))
    new = NewRequestData("r", list(range(9)), SamplingParams(max_tokens=4), ([4, 5, 6],), 8, kv_load=params)
    other = NewRequestData("o", [1, 2], SamplingParams(max_tokens=4), ([7],), 0)
    plan = hook.before_step(SchedulerOutput(scheduled_new_reqs=[new, other], num_scheduled_tokens={"r": 1, "o": 2},
                                            total_num_scheduled_tokens=3))
    assert [r.req_id for r in plan.scheduled_new_reqs] == ["o"] and plan.total_num_scheduled_tokens == 2
    out = ModelRunnerOutput()
    hook.after_step(out)
    assert list(out.kv_load_failed) == ["r"] and "NOT_FOUND" in out.kv_load_failed["r"]
    later = hook.before_step(SchedulerOutput(num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=1))
    assert later.is_empty  # still out of the step
    hook.after_step(out := ModelRunnerOutput())
    assert out.kv_load_failed == {}  # reported once
    again = hook.before_step(SchedulerOutput(finished_req_ids={"r"}, num_scheduled_tokens={"r": 1},
                                             total_num_scheduled_tokens=1))
    assert again.total_num_scheduled_tokens == 1  # forgotten: back in the step as a new request would be


def test_each_rank_pulls_from_the_producer_worker_of_its_rank(pair):
    producer, consumer, theirs, mine, address = pair
    send = KVSend("t5", "secret", (3, 4), time.time() + 30)
    producer.register(send)
    params = dataclasses.replace(_params(address, send), worker_addresses=("127.0.0.1:1", address), world_size=2)
    assert consumer.pull(params, [8, 9], rank=1) > 0  # rank 1's address, not the first (unreachable) one
    assert torch.equal(mine[0][:, [8, 9]], theirs[0][:, [3, 4]])
    with pytest.raises(KVTransferError, match="none of rank 2"):
        consumer.pull(params, [8, 9], rank=2)


def test_ranks_agree_on_failed_pulls_and_other_ranks_report_what_they_served(pair):
    """A pull that succeeded here but failed on another rank (the agreement says so) leaves the
    request out here too; a non-output rank reports its served transfers and bytes."""
    producer, consumer, _, _, address = pair
    send = KVSend("t6", "secret", (1,), time.time() + 30)
    producer.register(send)
    hook = KVStepHook(consumer)
    seen = []
    hook.agree = lambda flags: (seen.append(list(flags)), [True for _ in flags])[1]  # the other rank failed
    new = NewRequestData("r", list(range(4)), SamplingParams(max_tokens=4), ([2],), 4, kv_load=_params(address, send))
    plan = hook.before_step(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"r": 1},
                                            total_num_scheduled_tokens=1))
    assert seen == [[False]] and plan.is_empty  # this rank's pull worked, but the group's did not
    hook.after_step(out := ModelRunnerOutput())
    assert "another worker" in out.kv_load_failed["r"]
    serving = KVStepHook(producer)
    assert serving.report() is not None and serving.report() is None  # t6 served once: reported once
    assert KVStepHook(GrpcKVConnector(KVCacheView(lambda: []))).report() is None


def test_sends_and_releases_in_the_plan_reach_the_connector(pair):
    producer, _, _, _, _ = pair
    hook = KVStepHook(producer)
    hook.before_step(SchedulerOutput(kv_sends=[KVSend("a", "t", (1,), time.time() + 9)]))
    assert producer.num_registered == 1
    hook.before_step(SchedulerOutput(kv_releases=["a"]))
    assert producer.num_registered == 0


def _hybrid_caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8, generator=g) for _ in range(3)]


# Slot tensors 0 and 1 hold a layer of group 0 (full) and one of group 1 (window); tensor 2 only a
# layer of group 0 (a kind's last group may have fewer layers than the others).
HYBRID_GROUPS = [(0, 1), (0, 1), (0,)]


def test_every_kv_cache_group_is_pulled_and_a_window_group_s_null_blocks_are_skipped():
    theirs, mine = _hybrid_caches(0), _hybrid_caches(1)
    # 3 blocks a chunk: group 0's four blocks go in two chunks, group 1's two in one (first_block 2)
    producer = GrpcKVConnector(KVCacheView(lambda: theirs, lambda: HYBRID_GROUPS), chunk_bytes=3 * 512)
    consumer = GrpcKVConnector(KVCacheView(lambda: mine, lambda: HYBRID_GROUPS))
    server = _serve(producer)
    try:
        full, window = (7, 2, 9, 4), (0, 0, 5, 11)  # the window group's first two blocks: out of the window
        send = KVSend("h", "secret", full, time.time() + 30, (window,))
        producer.register(send)
        params = dataclasses.replace(_params(server.address, send), more_group_block_ids=(window,))
        local = ([1, 3, 6, 8, 5], [10, 2, 4, 9, 7])  # a block more than the prompt's in each group
        before = [t.clone() for t in mine]
        hook = KVStepHook(consumer)
        new = NewRequestData("r", list(range(16)), SamplingParams(max_tokens=4), local, 16, kv_load=params)
        plan = hook.before_step(SchedulerOutput(scheduled_new_reqs=[new], num_scheduled_tokens={"r": 1},
                                                total_num_scheduled_tokens=1))
        assert plan.scheduled_new_reqs == [new]
        hook.after_step(out := ModelRunnerOutput())
        assert out.kv_load_failed == {}
        for t, groups in enumerate(HYBRID_GROUPS):
            for g in (0, 1):
                for position, (src, dst) in enumerate(zip((full, window)[g], local[g])):
                    copied = torch.equal(mine[t][:, dst], theirs[t][:, src])
                    untouched = torch.equal(mine[t][:, dst], before[t][:, dst])
                    if g in groups and src != 0:
                        assert copied, (t, g, position)
                    else:  # null on the producer, or a group that does not use this tensor
                        assert untouched and not copied, (t, g, position)
        assert all(torch.equal(m[:, [5, 7]], b[:, [5, 7]]) for m, b in zip(mine, before))  # past the prompt
        per_block = 2 * BLOCK_SIZE * 2 * 8 * 4
        expected = per_block * (4 + 2 + 4 + 2 + 4)  # the non-null blocks of each tensor's groups
        assert out.kv_bytes_received == expected
        assert producer.take_sent() == (["h"], expected)
    finally:
        consumer.close()
        server.shutdown()


def test_a_pull_whose_groups_do_not_match_the_local_blocks_fails():
    caches = _hybrid_caches(1)
    consumer = GrpcKVConnector(KVCacheView(lambda: caches, lambda: HYBRID_GROUPS))
    send = KVSend("x", "s", (1, 2), time.time() + 30, ((0, 3),))
    params = dataclasses.replace(_params("127.0.0.1:1", send), more_group_block_ids=((0, 3),))
    with pytest.raises(KVTransferError, match="2 KV cache group.*local ones of 1"):
        consumer.pull(params, [4, 5])
    with pytest.raises(KVTransferError, match="KV cache group 1: 2 producer blocks for 1 local"):
        consumer.pull(params, ([4, 5], [6]))
    with pytest.raises(KVTransferError, match="1 KV cache group.*cache has 2"):  # the producer's plan: 1 group
        Receipt(consumer.view, ((1, 2),), ([4, 5],))


def test_every_group_s_block_ids_survive_the_wire():
    send = KVSend("w", "s", (0, 3), 1e12, ((1, 2), (0, 5)))
    params = dataclasses.replace(_params("h:1", send), more_group_block_ids=send.more_group_block_ids)
    assert kv_send_from_pb(kv_send_to_pb(send)) == send
    msg = worker_pb2.NewRequestData(kv_load=kv_params_to_pb(params))
    assert kv_params_from_pb(msg, "kv_load") == params
    assert kv_params_from_pb(msg, "kv_load").group_block_ids == ((0, 3), (1, 2), (0, 5))


def test_only_this_deployment_s_workers_may_pull(tmp_path, monkeypatch):
    deployment = "pd.test"
    monkeypatch.setattr(authz, "_deployment", authz._UNSET)  # read from the variable, as a worker does
    monkeypatch.setenv("GRIDSERVE_TLS_DEPLOYMENT", deployment)
    monkeypatch.delenv("GRIDSERVE_TLS_TRUST_DOMAIN", raising=False)
    ca = LocalCA(tmp_path, deployment=deployment)
    caches = _caches(0)
    producer = GrpcKVConnector(KVCacheView(lambda: caches))
    server = _serve(producer, tls=ca.issue("worker", name="producer"))
    send = KVSend("t", "secret", (1,), time.time() + 30)
    producer.register(send)
    request = worker_pb2.PullBlocksRequest(transfer_id="t", token="secret")
    try:
        for files, allowed in ((ca.issue("engine"), False), (ca.issue("gateway"), False),
                               (ca.issue("worker", name="foreign", deployment="other.test"), False),  # another deployment's
                               (ca.issue("worker", name="consumer"), True)):
            with make_channel(server.address, files) as channel:
                stub = worker_pb2_grpc.KVTransferStub(channel)
                if allowed:
                    assert len(list(stub.PullBlocks(request, timeout=5))) == len(caches)
                    continue
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.PullBlocks(request, timeout=5))
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert {identity for _, identity in server.authorization.denied} >= {"engine", "gateway"}
    finally:
        server.shutdown()

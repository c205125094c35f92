"""Metrics, traces and logs without processes: vLLM's names and values from the engine's stats,
counting rules, merging engines into the gateway's exposition, span trees, JSON log lines."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.metrics import EngineMetrics
from gridserve.services.engine.observability import EngineObserver
from gridserve.services.engine.request import Request, RequestStatus
from gridserve.services.engine.scheduler import Scheduler, StepStats
from gridserve.shared.config import GridserveConfig, ModelConfig, SchedulerConfig
from gridserve.shared.load import EngineLoad
from gridserve.shared.observability.logs import JsonFormatter
from gridserve.shared.observability.metrics import (
    fetch_families,
    merge_families,
    one_two_five_buckets,
)
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput


def make_scheduler(num_blocks: int, budget: int, max_model_len: int = 512) -> Scheduler:
    config = GridserveConfig(model=ModelConfig(max_model_len=max_model_len),
                             scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))
    return Scheduler(config, KVCacheManager(num_blocks, 16, True))


def make_request(rid: str, n_prompt: int, max_tokens: int, first_token: int = 100) -> Request:
    prompt = list(range(first_token, first_token + n_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(s: Scheduler, token: int = 7) -> None:
    """Schedule, then answer like a worker: one token for every request that reached its end."""
    out = s.schedule()
    sampled = [rid for rid in out.num_scheduled_tokens
               if s.requests.get(rid) and s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens]
    s.update_from_output(out, ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[token] * len(sampled),
                                                logprobs=[None] * len(sampled)))


def _samples(registry) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _stats(**kw) -> EngineLoad:
    base = dict(num_waiting=2, num_running=3, kv_cache_usage=0.25, prefix_cache_queries=100,
                prefix_cache_hits=32, num_preemptions=1, num_prompt_tokens=80, num_generation_tokens=40)
    return EngineLoad(**{**base, **kw})


def test_engine_gauges_and_counters_come_from_one_scheduler_snapshot_with_vllm_names():
    config = GridserveConfig()
    config.model.model = "m"
    metrics = EngineMetrics(config, _stats)
    samples = _samples(metrics.registry)
    labels = {"model_name": "m", "engine": "0"}
    expected = {
        "vllm:num_requests_running": 3, "vllm:num_requests_waiting": 2, "vllm:kv_cache_usage_perc": 0.25,
        "vllm:prompt_tokens_total": 80, "vllm:generation_tokens_total": 40, "vllm:num_preemptions_total": 1,
        "vllm:prefix_cache_queries_total": 100, "vllm:prefix_cache_hits_total": 32,
    }
    for name, value in expected.items():
        (sample,) = samples[name]
        assert sample.value == value and sample.labels == labels, name
    assert samples["vllm:cache_config_info"][0].labels["block_size"] == "16"
    assert not any(name.endswith("_created") for name in samples)


def test_each_kv_cache_group_has_its_share_of_the_pool_beside_the_pools_total():
    config = GridserveConfig()
    config.model.model = "m"
    groups = (("full", 30), ("sliding_window_16", 10))
    metrics = EngineMetrics(config, lambda: _stats(kv_total_blocks=100, kv_cache_groups=groups))
    samples = _samples(metrics.registry)
    (total,) = samples["vllm:kv_cache_usage_perc"]  # unchanged: the pool, no group label
    assert total.value == 0.25 and total.labels == {"model_name": "m", "engine": "0"}
    by_group = {s.labels["kv_cache_group"]: (s.labels["kv_cache_group_name"], s.value)
                for s in samples["gridserve:kv_cache_group_usage_perc"]}
    assert by_group == {"0": ("full", 0.3), "1": ("sliding_window_16", 0.1)}
    # A kind split into several groups: the names repeat, the index tells them apart.
    split = EngineMetrics(config, lambda: _stats(kv_total_blocks=0, kv_cache_groups=(("full", 0), ("full", 0))))
    assert [(s.labels["kv_cache_group"], s.labels["kv_cache_group_name"], s.value)
            for s in _samples(split.registry)["gridserve:kv_cache_group_usage_perc"]] == [
        ("0", "full", 0.0), ("1", "full", 0.0)]
    assert "gridserve:kv_cache_group_usage_perc" not in _samples(EngineMetrics(config, _stats).registry)


def test_speculative_decoding_counters_are_vllm_s_and_bench_serve_reads_them_back():
    from gridserve.benchmarks.serve import parse_spec_decode_counters, spec_decode_delta

    config = GridserveConfig()
    stats = {"spec_num_drafts": 10, "spec_num_draft_tokens": 40, "spec_num_accepted_tokens": 25,
             "spec_accepted_per_pos": (9, 7, 5, 4)}
    text = generate_latest(EngineMetrics(config, lambda: _stats(**stats)).registry).decode()
    after = parse_spec_decode_counters(text)
    assert (after["drafts"], after["draft_tokens"], after["accepted_tokens"]) == (10, 40, 25)
    assert after["per_position"] == {0: 9, 1: 7, 2: 5, 3: 4}
    before = parse_spec_decode_counters(generate_latest(EngineMetrics(config, _stats).registry).decode())
    assert before["draft_tokens"] == 0 and before["per_position"] == {}  # speculation off: no families
    delta = spec_decode_delta(before, after)
    assert delta["acceptance_rate"] == 0.625 and delta["accepted_per_position"] == [0.9, 0.7, 0.5, 0.4]


def test_engine_without_a_snapshot_still_answers_a_scrape():
    metrics = EngineMetrics(GridserveConfig(), lambda: None)
    samples = _samples(metrics.registry)
    assert "vllm:cache_config_info" in samples and "vllm:num_requests_running" not in samples


def _finished(rid: str, prompt: int, output: int, t0: float) -> Request:
    request = Request(rid, list(range(prompt)), SamplingParams(max_tokens=output), arrival_time=t0)
    request.output_token_ids = list(range(output))
    request.scheduled_time, request.first_token_time, request.finished_time = t0 + 1, t0 + 3, t0 + 7
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return request


def test_engine_histograms_observe_each_finished_request_and_step_once():
    metrics = EngineMetrics(GridserveConfig(), _stats)
    step = StepStats(iteration_tokens=[10, 3], finished=[_finished("a", 10, 4, 100.0), _finished("b", 6, 2, 200.0)])
    EngineObserver(metrics).on_step(step, 0.01)
    samples = _samples(metrics.registry)

    def value(name):
        return samples[name][0].value

    assert value("vllm:request_queue_time_seconds_count") == 2 and value("vllm:request_queue_time_seconds_sum") == 2
    assert value("vllm:request_prefill_time_seconds_sum") == 4 and value("vllm:request_decode_time_seconds_sum") == 8
    assert value("vllm:request_prompt_tokens_sum") == 16 and value("vllm:request_generation_tokens_sum") == 6
    assert value("vllm:iteration_tokens_total_count") == 2 and value("vllm:iteration_tokens_total_sum") == 13
    assert value("gridserve:engine_step_seconds_count") == 1


def test_scheduler_counts_prompt_and_generation_tokens_once_even_across_a_preemption():
    s = make_scheduler(num_blocks=5, budget=256, max_model_len=64)
    s.take_step_stats()  # start collecting
    s.add_request(make_request("old", 30, max_tokens=20))
    s.add_request(make_request("new", 30, max_tokens=20, first_token=900))
    finished = []
    for _ in range(200):
        run_step(s, token=11)
        finished += s.take_step_stats().finished
        if not s.has_unfinished_requests():
            break
    stats = s.stats()
    assert stats.num_preemptions == 1
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (60, 40)
    # The resumed request's lookup is counted apart: only the two first admissions are queries.
    assert stats.prefix_cache_queries == 60 and s.kv.preempted_prefix_cache_queries > 0
    assert sorted(r.request_id for r in finished) == ["new", "old"]
    for r in finished:
        assert r.arrival_time <= r.scheduled_time <= r.first_token_time <= r.finished_time


def test_step_stats_are_not_collected_until_asked_for():
    s = make_scheduler(num_blocks=16, budget=64)
    s.add_request(make_request("a", 5, max_tokens=1))
    run_step(s)
    assert s.step_stats is None
    assert s.stats().num_generation_tokens == 1


def test_merge_families_stamps_each_engines_labels_into_one_family_per_name():
    from prometheus_client import CollectorRegistry, Counter

    def exposition(value: float):
        registry = CollectorRegistry()
        Counter("vllm:prompt_tokens", "doc", ["model_name", "engine"], registry=registry).labels("path", "0").inc(value)
        return list(text_string_to_metric_families(generate_latest(registry).decode()))

    merged = merge_families([(exposition(3), {"engine": "0", "model_name": "served"}),
                             (exposition(5), {"engine": "1", "model_name": "served"})])
    (family,) = merged
    values = {(s.labels["engine"], s.labels["model_name"]): s.value for s in family.samples
              if s.name == "vllm:prompt_tokens_total"}
    assert values == {("0", "served"): 3, ("1", "served"): 5}


def test_an_unreachable_engine_scrapes_as_nothing():
    from gridserve.launcher import free_port

    assert fetch_families(f"http://127.0.0.1:{free_port()}/metrics", timeout=1.0) == []


def test_gateway_observation_counts_ttft_per_sample_and_itl_per_later_token():
    from gridserve.services.gateway.observability import GatewayMetrics, RequestObservation
    from gridserve.shared.outputs import EngineCoreOutput

    metrics = GatewayMetrics("m")
    observation = RequestObservation("r1", "", metrics, None)
    observation.on_engine("0")
    for token in range(5):
        observation.on_output(EngineCoreOutput("r1", [token]))
    observation.on_output(EngineCoreOutput("r1", []))  # prompt logprobs only: no token, no latency
    observation.on_sample_finished("length")

    class Sample:
        finish_reason, token_ids = "length", [0] * 5

    observation.end({"r1": Sample()}, 7, None)
    samples = _samples(metrics.registry)
    assert samples["vllm:time_to_first_token_seconds_count"][0].value == 1
    assert samples["vllm:inter_token_latency_seconds_count"][0].value == 4
    assert samples["vllm:e2e_request_latency_seconds_count"][0].value == 1
    (success,) = samples["vllm:request_success_total"]
    assert success.value == 1 and success.labels["finished_reason"] == "length"
    assert samples["gridserve:gateway_requests_in_flight"][0].value == 0


def test_engine_spans_nest_queue_prefill_decode_under_the_request_span_of_the_callers_trace():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gridserve.shared.observability.tracing import Tracing

    exporter = InMemorySpanExporter()
    tracing = Tracing("engine", "", exporter=exporter)
    observer = EngineObserver(tracing=tracing)
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    now = time.monotonic()
    request = _finished("r", 4, 2, now - 10)
    request.traceparent = f"00-{trace_id}-{parent}-01"
    observer.on_add(request)
    assert request.traceparent.split("-")[1] == trace_id  # the workers' parent: the engine span
    observer.on_step(StepStats(finished=[request]), None)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"llm_request", "queue", "prefill", "decode"}
    root = spans["llm_request"]
    assert f"{root.parent.span_id:016x}" == parent and f"{root.context.trace_id:032x}" == trace_id
    for name in ("queue", "prefill", "decode"):
        assert spans[name].parent.span_id == root.context.span_id
    assert spans["prefill"].end_time - spans["prefill"].start_time == pytest.approx(2e9, rel=1e-3)
    assert root.attributes["gen_ai.request.id"] == "r"


def test_worker_links_each_step_to_the_requests_in_its_batch():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gridserve.services.worker.observability import WorkerObserver
    from gridserve.shared.observability.tracing import Tracing
    from gridserve.shared.scheduler_output import NewRequestData, SchedulerOutput

    exporter = InMemorySpanExporter()
    observer = WorkerObserver(None, Tracing("worker", "", exporter=exporter))
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    plan = SchedulerOutput([NewRequestData("r", [1, 2], SamplingParams(), [1], 0, traceparent=tp)],
                           num_scheduled_tokens={"r": 2}, total_num_scheduled_tokens=2)
    assert observer.execute(lambda p: "ran", plan, rank=0) == "ran"
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert f"{spans['worker_prefill'].parent.span_id:016x}" == "00f067aa0ba902b7"
    (link,) = spans["execute_model"].links
    assert f"{link.context.trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert spans["execute_model"].context.trace_id != link.context.trace_id


def test_traceparent_crosses_the_worker_contract():
    from gridserve.shared.rpc.worker_convert import scheduler_output_from_pb, scheduler_output_to_pb
    from gridserve.shared.scheduler_output import NewRequestData, SchedulerOutput

    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    plan = SchedulerOutput([NewRequestData("r", [1], SamplingParams(), [1], 0, traceparent=tp)],
                           num_scheduled_tokens={"r": 1}, total_num_scheduled_tokens=1)
    assert scheduler_output_from_pb(scheduler_output_to_pb(plan)).scheduled_new_reqs[0].traceparent == tp


def test_tracing_off_imports_no_opentelemetry_in_any_role():
    code = ("import sys; import gridserve.services.engine.main, gridserve.services.gateway.main, gridserve.cli; "
            "from gridserve.shared.observability.tracing import Tracing; "
            "assert Tracing.create('x', None) is None; print(any(m.startswith('opentelemetry') for m in sys.modules))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "GRIDSERVE_OTLP_TRACES_ENDPOINT"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert result.stdout.strip() == "False"


def test_json_log_lines_carry_the_request_fields():
    record = logging.LogRecord("gridserve.x", logging.INFO, __file__, 1, "request %s finished", ("r1",), None)
    record.request_id, record.generation_tokens = "r1", 4
    entry = json.loads(JsonFormatter("engine").format(record))
    assert entry["message"] == "request r1 finished" and entry["role"] == "engine"
    assert entry["request_id"] == "r1" and entry["generation_tokens"] == 4 and entry["level"] == "INFO"


def test_roles_take_metrics_tracing_and_log_flags_from_env(monkeypatch):
    from gridserve.cli import _parser

    monkeypatch.setenv("GRIDSERVE_METRICS_PORT", "9100")
    monkeypatch.setenv("GRIDSERVE_OTLP_TRACES_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("GRIDSERVE_LOG_FORMAT", "json")
    for role in ("worker", "engine", "gateway"):
        args = _parser().parse_args([role])
        assert (args.metrics_port, args.otlp_traces_endpoint, args.log_format) == (9100, "http://collector:4317", "json")


def test_edge_routes_get_metrics_to_the_gateways_metrics_ports():
    from gridserve.edge import METRICS_CLUSTER, envoy_config

    config = envoy_config("127.0.0.1", 8000, ["127.0.0.1:9000"], descriptor_set=__file__,
                          metrics_addresses=["127.0.0.1:9100"])
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    first = manager["route_config"]["virtual_hosts"][0]["routes"][0]
    assert first["match"] == {"path": "/metrics"} and first["route"]["cluster"] == METRICS_CLUSTER
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert "typed_extension_protocol_options" not in clusters[METRICS_CLUSTER]  # plain HTTP/1.1


def test_token_buckets_are_one_two_five():
    assert one_two_five_buckets(100) == [1, 2, 5, 10, 20, 50, 100]

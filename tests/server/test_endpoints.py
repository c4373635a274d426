"""/v1/models, /health, /metrics, /tokenize, /detokenize, /version."""

import httpx
from prometheus_client.parser import text_string_to_metric_families


def test_models_lists_the_served_model(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    raw = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert raw["max_model_len"] == 512 and raw["vocab_size"] == 384
    assert raw["quantization"] is None and raw["kv_cache_dtype"] == "float32"


def test_models_and_metrics_say_what_quantization_runs(launch):
    """A bf16/fp32 checkpoint quantized at load (--quantization fp8) with an fp8 KV cache: /v1/models and
    vllm:cache_config_info say so."""
    quantized = launch("--quantization", "fp8", "--kv-cache-dtype", "fp8")
    want = "fp8 (quantized at load): weights per channel, activations dynamic per token"
    model = httpx.get(quantized.url + "/v1/models").json()["data"][0]
    assert model["quantization"] == want and model["kv_cache_dtype"] == "float8_e4m3fn"
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(quantized.url + "/metrics").text)}
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["quantization"] == want and info.labels["cache_dtype"] == "float8_e4m3fn"
    quantized.stop()


def test_health_reports_engine_state(server):
    h = server.health()
    assert h["status"] == "ok"
    assert {"waiting", "running", "kv_blocks_used", "kv_blocks_total", "prefix_cache_hit_rate"} <= set(h)
    assert h["kv_blocks_total"] == 256


def test_metrics_parse_with_prometheus_parser(server):
    client = server.client()
    for _ in range(2):  # the same prompt twice: the second one hits the prefix cache
        client.completions.create(model="tiny-llama", prompt=list(range(2, 60)), max_tokens=4,
                                  extra_body={"ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    for name in ("nanoserve_num_requests_running", "nanoserve_num_requests_waiting",
                 "nanoserve_kv_cache_usage_perc", "nanoserve_prefix_cache_queries", "nanoserve_prefix_cache_hits",
                 "nanoserve_prompt_tokens", "nanoserve_generation_tokens", "nanoserve_time_to_first_token_seconds",
                 "nanoserve_inter_token_latency_seconds", "nanoserve_e2e_request_latency_seconds",
                 "nanoserve_request_queue_time_seconds", "nanoserve_request_success"):
        assert name in families, name

    def value(name, suffix="", **labels):
        return next(s.value for s in families[name].samples
                    if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("nanoserve_prefix_cache_hits", "_total") >= 48
    assert value("nanoserve_generation_tokens", "_total") >= 8
    assert value("nanoserve_time_to_first_token_seconds", "_count") >= 2
    assert value("nanoserve_inter_token_latency_seconds", "_count") >= 6
    assert value("nanoserve_request_success", "_total", finish_reason="length") >= 2


def test_tokenize_detokenize_roundtrip(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [999999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_version(server):
    assert "version" in httpx.get(server.url + "/version").json()

"""The CPU tier (--kv-offload-gb) as /health and /metrics show it, on a server whose GPU pool is too small to keep
a prompt's prefix: the second time, it comes back from the CPU tier."""

import httpx


def test_health_and_metrics_show_the_cpu_tier(launch):
    server = launch("--kv-offload-gb", "0.01", "--num-kv-blocks", "8", "--block-size", "16")
    health = server.health()
    assert health["cpu_kv_blocks_total"] > 0 and health["cpu_kv_blocks_used"] == 0
    client = server.client()
    first, other = [(7 * i) % 300 + 2 for i in range(70)], [(11 * i) % 300 + 2 for i in range(90)]
    for prompt in (first, other, first):  # 8 blocks of 16: the 90-token prompt evicts the first one's blocks
        client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0)
    health = server.wait_idle()
    assert health["cpu_kv_blocks_used"] > 0 and health["cpu_prefix_cache_hits"] > 0
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert f"nanoserve_cpu_prefix_cache_hits_total {float(health['cpu_prefix_cache_hits'])}" in metrics
    usage = next(line for line in metrics.splitlines() if line.startswith("nanoserve_cpu_kv_cache_usage_perc "))
    assert 0 < float(usage.split()[1]) <= 1
    assert server.stop() == 0

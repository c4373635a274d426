"""runtime/routing.py: prefix hashes, the LRU prefix index, and the three policies' choices."""

from collections import Counter

import pytest

from nanoserve.runtime.routing import PrefixIndex, RoutingConfig, RoutingPolicy, prefix_hashes

CONFIG = RoutingConfig()
LONG = "You are a careful assistant. Answer briefly and cite the manual where you can. " * 4  # 316 chars: 4 chunks


def test_hashes_name_prefixes():
    a = prefix_hashes(list(range(40)), CONFIG)
    b = prefix_hashes(list(range(32)) + [7] * 8, CONFIG)
    assert len(a) == 2  # 40 tokens: two full chunks of 16, the partial third left out
    assert a == b  # same first 32 tokens
    c = prefix_hashes([1] + list(range(1, 40)), CONFIG)
    assert c[0] != a[0] and c[1] != a[1]  # a chain: a change in chunk 0 renames every later chunk
    assert prefix_hashes(list(range(15)), CONFIG) == []
    text = prefix_hashes(LONG + "question one", CONFIG)
    assert (
        text[:4] == prefix_hashes(LONG + "another question", CONFIG)[:4]
        and text[4] != prefix_hashes(LONG + "x" * 20, CONFIG)[4]
    )
    # Non-ASCII text is cut by characters, as ASCII is.
    assert len(prefix_hashes("é" * 130, CONFIG)) == 2


def test_index_matches_leading_chunks_and_evicts_least_recently_used():
    index = PrefixIndex(max_chunks=4)
    first, second = prefix_hashes(list(range(48)), CONFIG), prefix_hashes(list(range(100, 148)), CONFIG)
    index.insert(first)
    assert index.match(first) == 3
    assert index.match(prefix_hashes(list(range(32)) + [9] * 16, CONFIG)) == 2
    index.insert(second)  # 6 chunks for 4 places: first's oldest two go
    assert len(index) == 4
    assert index.match(second) == 3
    assert index.match(first) == 0  # its chunk 0 is gone, so nothing of it matches


def test_cache_aware_follows_the_prefix_and_falls_back_to_least_load():
    policy = RoutingPolicy(RoutingConfig(), backends=[0, 1, 2])
    idle = {0: 0, 1: 0, 2: 0}
    first = policy.choose(LONG + "one", idle)
    assert all(policy.choose(LONG + f"q{i}", idle) == first for i in range(5))
    # A new prefix goes to the least loaded backend.
    loads = {0: 3, 1: 1, 2: 2} if first == 0 else {0: 1, 1: 3, 2: 3}
    assert policy.choose("a different prompt altogether. " * 5, loads) == min(loads, key=loads.get)
    # Too short a shared prefix (one chunk) is not followed.
    short_cfg = RoutingPolicy(RoutingConfig(), backends=["a", "b"])
    short_cfg.choose("x" * 64 + "tail", {"a": 0, "b": 5})
    assert short_cfg.choose("x" * 64 + "other tail", {"a": 5, "b": 0}) == "b"


def test_a_shared_prefix_spreads_and_each_conversation_stays():
    # Eight conversations behind one 10-chunk system prompt: once two have continued it differently it is shared,
    # so new ones spread by load (not all to the backend that saw it first), and each comes back to its own.
    policy = RoutingPolicy(RoutingConfig(), backends=range(4))
    system = list(range(1000, 1160))
    turns = [system + [i] * 32 for i in range(8)]
    loads = dict.fromkeys(range(4), 0)
    home = []
    for prompt in turns:
        home.append(policy.choose(prompt, loads))
        loads[home[-1]] += 1
    assert sorted(Counter(home).values()) == [2, 2, 2, 2]
    assert policy.shared_prefix(prefix_hashes(turns[0], CONFIG)) == 10
    idle = dict.fromkeys(range(4), 0)
    assert [policy.choose(prompt + [7] * 48, idle) for prompt in turns] == home


def test_a_shared_prefix_stays_shared_while_prompts_pass_through_it():
    policy = RoutingPolicy(RoutingConfig(max_chunks=64), backends=range(2))
    system = list(range(1000, 1160))
    idle = dict.fromkeys(range(2), 0)
    for i in range(2):
        policy.choose(system + [i] * 32, idle)
    for i in range(100):  # one-off prompts fill the bounded memory; a conversation keeps using the system prompt
        policy.choose([5000 + i] * 32, idle)
        policy.choose(system + [0] * 32 + [i] * 16, idle)
    assert policy.shared_prefix(prefix_hashes(system + [9] * 32, CONFIG)) == 10


def test_cache_aware_leaves_an_overloaded_backend():
    policy = RoutingPolicy(RoutingConfig(balance_abs=8, balance_rel=0.25), backends=["a", "b"])
    assert policy.choose(LONG, {"a": 0, "b": 0}) == "a"
    assert policy.choose(LONG, {"a": 8, "b": 0}) == "a"  # 8 above the least: still within balance_abs
    assert policy.choose(LONG, {"a": 9, "b": 0}) == "b"  # beyond both thresholds
    assert policy.choose(LONG, {"a": 100, "b": 85}) == "b"  # both have it now: the lighter wins
    assert policy.choose(LONG, {"a": 100, "b": 82}) == "b"
    fresh = RoutingPolicy(RoutingConfig(), backends=["a", "b"])
    fresh.choose(LONG, {"a": 0, "b": 0})
    assert fresh.choose(LONG, {"a": 100, "b": 81}) == "a"  # 100 <= 81 * 1.25: within balance_rel


def test_least_load_and_round_robin():
    least = RoutingPolicy(RoutingConfig(policy="least_load"), backends=[0, 1, 2])
    assert least.choose(LONG, {0: 2, 1: 0, 2: 1}) == 1
    assert least.choose(LONG, {0: 0, 1: 5, 2: 5}) == 0  # no prefix following
    assert sorted(least.choose(None, {0: 0, 1: 0, 2: 0}) for _ in range(3)) == [0, 1, 2]  # ties take turns
    rr = RoutingPolicy(RoutingConfig(policy="round_robin"), backends=["a", "b"])
    assert [rr.choose(LONG, {"a": 9, "b": 0}) for _ in range(4)] == ["a", "b", "a", "b"]


def test_backends_come_and_go_and_bad_input_is_refused():
    policy = RoutingPolicy(backends=["a"])
    assert policy.choose(LONG, {"a": 0}) == "a"
    policy.add_backend("b")
    policy.remove_backend("a")
    assert policy.backends == ["b"]
    assert policy.choose(LONG, {"b": 0}) == "b"
    policy.add_backend("a")  # back, cold: the prefix stays where it now is
    assert policy.choose(LONG, {"a": 0, "b": 0}) == "b"
    with pytest.raises(ValueError, match="backends"):
        policy.choose(LONG, {})
    with pytest.raises(ValueError, match="policy"):
        RoutingConfig(policy="random")
    with pytest.raises(ValueError, match="chunk_tokens"):
        RoutingConfig(chunk_tokens=0)
    with pytest.raises(ValueError, match="hot_children"):
        RoutingConfig(hot_children=0)

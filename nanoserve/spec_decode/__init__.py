"""Speculative decoding: cheap proposals of the next few tokens, verified by the target model in one forward pass.

config.py reads vLLM's speculative_config; ngram.py proposes by prompt lookup (host-side); rejection.py turns the
verify step's logits into the tokens to emit, keeping the target's distribution exactly. The engine (proposals,
lookahead slots) and the worker (verify rows, sampling) import these; the lower layers do not.
"""

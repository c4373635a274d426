"""Structured output and tool calling.

- params.py: StructuredOutputs, the constraint SamplingParams carries (JSON schema, json_object, regex, choice,
  grammar), checked on construction.
- backend.py: the grammar backend on llguidance: compiled grammars (an LRU cache), per-sample matcher states,
  batched token bitmasks.
- manager.py: the engine's side: compiles off the engine loop, masks while the device runs the forward pass.
- tools.py: tool_choice as a constraint, constrained replies read back as calls, streamed tool-call reading.
- tool_parsers/: one parser per model family's tool-call format (hermes, llama3_json, mistral, pythonic, nanochat).
"""

from nanoserve.structured.params import StructuredOutputs

__all__ = ["StructuredOutputs"]

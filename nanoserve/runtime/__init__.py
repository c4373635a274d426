"""runtime: the LLMEngine running behind an asyncio server, on a thread or in a process of its own.

engine/ is the engine proper (requests, scheduler, KV blocks, detokenizer, LLMEngine.step), driven by
whoever calls step(). This package is the plumbing between it and the server, in two sides:

- engine side, where the LLMEngine lives: EngineCore (engine_core.py), the loop that owns the engine and
  takes commands; EngineCoreProcess and run_engine_core_process (engine_core_process.py), the process it
  runs in; ChannelMux (channels.py), one pipe per API server into one EngineCore; DeltaEncoder
  (output_delta.py).
- client side, in the server's process: AsyncEngine (async_engine.py), what the server holds; behind it an
  EngineClient: ThreadEngineClient (thread_client.py: the EngineCore on a thread of this process) or
  ProcessEngineClient / ChannelEngineClient (process_client.py: over a pipe to the engine core process);
  RequestStream and RequestGroup (streams.py); OutputAssembler (output_delta.py).

It imports engine/ and nothing above it; server/ imports it.
"""

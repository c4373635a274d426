"""LLM: offline batch generation, the simplest way to use nanoserve from Python."""

import weakref
from collections.abc import Sequence
from contextlib import nullcontext

from tqdm import tqdm

from nanoserve.chat_engine import ToolLoop
from nanoserve.config import EngineArgs
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams

Prompt = str | list[int]

# LLM.chat's request ids start with this; the calculator tool loop runs on exactly these.
_CHAT_PREFIX = "offline-chat-"


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not an engine argument")
        if kwargs.get("engine_process"):
            raise ValueError("engine_process: only the server runs the engine in a process of its own")
        if kwargs.get("data_parallel_size", 1) != 1:
            # Replicas are separate engine processes, which only the server runs (AsyncEngine); offline, run one
            # LLM per GPU, or `nanoserve serve --data-parallel-size N` and send it the prompts.
            raise ValueError("data_parallel_size: only `nanoserve serve` runs replicas; LLM(...) runs one engine")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = 0
        # Tensor-parallel workers stop with the LLM object, or at exit at the latest.
        weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes now (nothing to do without them)."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Completions in the order of `prompts` (a string, token ids, or a list of either)."""
        return self._generate(prompts, sampling_params, use_tqdm, priority, "offline-")

    def _generate(self, prompts: Prompt | Sequence[Prompt],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
                  priority: Sequence[int] | None, prefix: str) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                request_id = f"{prefix}{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, p, priority[i] if priority else 0)
                ids.append(request_id)
        except Exception:  # none of this call's requests may stay behind without a caller
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        # No bar at all unless asked: even a disabled one costs ~10 us, a few % of a cached prompt's TTFT.
        with tqdm(total=len(ids), desc="generating") if use_tqdm else nullcontext() as bar:
            while len(done) < len(ids):
                for out in self.engine.step(final_only=True):
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template. On a model
        with the calculator's tokens (the bundled one) the calculator answers its calls, as in `nanoserve chat`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        ToolLoop.attach(self.engine, _CHAT_PREFIX)
        return self._generate(prompts, sampling_params, use_tqdm, None, _CHAT_PREFIX)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.engine.apply_chat_template(messages, add_generation_prompt)

"""LLM: synchronous offline generation over one Engine (no server, no threads).

from bitserve import LLM, SamplingParams
llm = LLM("smollm2-135m-instruct")
outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig
from bitserve.engine.devices import resolve_engine_config
from bitserve.engine.instance import ModelInstance
from bitserve.frontend.admission import check_request
from bitserve.frontend.output_processor import OutputProcessor
from bitserve.loader.catalog import DEFAULT_MODEL
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self, model: str = DEFAULT_MODEL, *, config: EngineConfig | None = None, **model_options: Any
    ) -> None:
        if config is None:
            # options name ModelConfig or SchedulerConfig fields (LLM(speculative="ngram", max_num_seqs=8))
            scheduler_fields = SchedulerConfig.__dataclass_fields__
            scheduler_options = {
                k: model_options.pop(k) for k in list(model_options) if k in scheduler_fields
            }
            config = EngineConfig(
                model=ModelConfig(model=model, **model_options),
                scheduler=SchedulerConfig(**scheduler_options),
            )
        # `device="auto"` (or "cuda") becomes a concrete device here: one engine, no replicas
        self.instance = ModelInstance.load(resolve_engine_config(config))
        self.tokenizer = self.instance.tokenizer
        self._num_requests = 0

    @property
    def engine(self):  # noqa: ANN201 - the Engine, for tests and benchmarks
        return self.instance.engine

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special=True, parse_special=True)
        return [int(token_id) for token_id in prompt]

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.instance.encode_chat(messages)

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return self._run([self.encode(p) for p in prompts], sampling_params or SamplingParams())

    def chat(
        self,
        conversations: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate."""
        if conversations and isinstance(conversations[0], Mapping):
            conversations = [conversations]  # type: ignore[list-item]
        prompt_ids = [self.encode_chat(messages) for messages in conversations]  # type: ignore[arg-type]
        return self._run(prompt_ids, sampling_params or SamplingParams())

    def _run(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        engine, tokenizer = self.instance.engine, self.tokenizer
        processor = OutputProcessor(tokenizer)
        results: dict[str, RequestOutput] = {}
        for ids in prompt_ids:
            check_request(
                ids, params, max_model_len=self.instance.max_model_len, vocab_size=tokenizer.vocab_size
            )
        if params.guide is not None:  # InvalidRequest here, as the server's 400, not an ended request
            self.instance.grammars.validate(params.guide)
        for ids in prompt_ids:
            parent_id = f"offline-{self._num_requests}"
            self._num_requests += 1
            results[parent_id] = RequestOutput(
                parent_id, ids, [CompletionOutput(i) for i in range(params.n)], False
            )
            for request in processor.add_choices(parent_id, ids, params):
                engine.add_request(request)
        while engine.has_unfinished_requests():
            step = engine.step()
            deltas, abort_ids = processor.process(step.outputs)
            if abort_ids:
                engine.abort_requests(abort_ids)
            for delta in deltas:
                results[delta.parent_id].add(delta.output, delta.num_cached_tokens)
        for result in results.values():
            result.finished = all(output.finish_reason is not None for output in result.outputs)
        return list(results.values())

    def close(self) -> None:
        self.instance.close()

"""A CUDA replica with no KV flags sizes its cache from the device's memory (issue 40,
runner/cuda_memory.py), and what it holds after the warm-up and graph capture stays inside the reserve the
profile step measured."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from bitserve.config import CUDA_KV_REPLICA_SHARE, EngineConfig, ModelConfig
from bitserve.llm import LLM
from bitserve.runner.kv_cache import kv_bytes_per_token
from bitserve.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_default_kv_cache_comes_from_device_memory(b158_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    llm = LLM(config=EngineConfig(model=ModelConfig(model=str(b158_file), device="cuda")))
    try:
        layout = llm.engine.runner.layout
        limits = llm.instance.scheduler_config
        _, total = torch.cuda.mem_get_info()
        # the small file's 256 sequences at full context are far below half the card: that cap binds
        most_useful = (
            limits.max_num_seqs
            * limits.max_model_len
            * kv_bytes_per_token(llm.instance.loaded.spec, "float16")
        )
        assert most_useful < CUDA_KV_REPLICA_SHARE * 0.9 * total
        assert layout.num_blocks == most_useful // layout.bytes_per_block
        assert "KV cache from device memory" in caplog.text
        assert "of KV cache: 90% of the device's" in caplog.text
        reserve_exceeded = [
            record
            for record in caplog.records
            if record.name.endswith("cuda_memory") and record.levelno >= logging.WARNING
        ]
        assert not reserve_exceeded, reserve_exceeded[0].getMessage()
        out = llm.generate(["The sea is"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        llm.close()

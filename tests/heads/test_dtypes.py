"""The frozen target's CPU dtype rule (heads/dtypes.py): fp32 without bf16 instructions, else the
faster of a measured fp32 and bf16 forward."""
from types import SimpleNamespace

import torch

from heads.dtypes import bf16_flags, choose_cpu_dtype
from tests.tiny import tiny_model


def test_no_bf16_instructions_means_fp32_without_measuring():
    calls = []
    choice = choose_cpu_dtype(tiny_model(), flags={"avx2", "fma"}, measure=lambda m, x: calls.append(1) or 1.0,
                              min_bytes=0)
    assert choice.dtype == "float32" and "no bf16 instructions" in choice.reason and not calls


def test_with_bf16_instructions_the_faster_measured_dtype_wins():
    model = tiny_model()
    bf16_faster = choose_cpu_dtype(model, flags={"avx512_bf16"}, min_bytes=0,
                                   measure=lambda m, x: 1.0 if next(m.parameters()).dtype == torch.bfloat16 else 2.0)
    fp32_faster = choose_cpu_dtype(model, flags={"amx_bf16"}, min_bytes=0,
                                   measure=lambda m, x: 3.0 if next(m.parameters()).dtype == torch.bfloat16 else 2.0)
    assert bf16_faster.dtype == "bfloat16" and bf16_faster.ms == {"float32": 2.0, "bfloat16": 1.0}
    assert fp32_faster.dtype == "float32" and "amx_bf16" in fp32_faster.reason
    assert next(model.parameters()).dtype == torch.float32  # measured on a copy: the model is untouched
    assert bf16_flags({"amx_bf16", "avx512_bf16", "avx2"}) == ["amx_bf16", "avx512_bf16"]


def test_a_tiny_target_stays_fp32():
    choice = choose_cpu_dtype(tiny_model(), flags={"amx_bf16"}, measure=lambda m, x: 0.0)
    assert choice.dtype == "float32" and "MB" in choice.reason


def test_the_job_casts_the_target_only_when_bf16_wins(monkeypatch):
    import heads.dtypes
    from heads.target import FrozenTarget
    from train.pipeline import frozen_target_dtype

    target = FrozenTarget(tiny_model(), None, name="tiny")
    job = SimpleNamespace(model=SimpleNamespace(dtype="float32"))
    assert frozen_target_dtype(job, target).dtype == "float32"  # an explicit dtype is kept
    job.model.dtype = "auto"
    monkeypatch.setattr(heads.dtypes, "choose_cpu_dtype", lambda model: heads.dtypes.DtypeChoice("bfloat16", "x"))
    assert frozen_target_dtype(job, target).dtype == "bfloat16" and target.dtype == torch.bfloat16

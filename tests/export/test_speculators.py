"""A real loader: vLLM's `speculators` 0.9.0, in its own venv (scripts/setup_speculators.sh, built
here on first use: ~4 min on a 2-core CPU, then reused), loads our `speculators` export with
`SpeculatorModel.from_pretrained` and our `eagle3` export through `speculators convert`, attached
to the dequantized SmolLM2 verifier, and its draft logits match our Eagle3Head's on the same real
features and tokens over three training-time-test steps; so do those of two EAGLE-3.1 heads
(norm_before_fc with norm_output, and fc_norm), whose input norms speculators reads by our names."""
from __future__ import annotations

import pytest

from tests.speculators_driver import driver
TOLERANCE = 1e-3  # float32 on both sides; what differs is only the order of float operations


def _clean(audit: dict) -> bool:
    return not any(audit[key] for key in ("unexpected_keys", "missing_keys", "changed_keys", "nan_keys"))


@pytest.mark.long(35)
@pytest.mark.integration
def test_speculators_loads_our_exports_and_matches_our_logits(tmp_path, smollm2):
    report = driver().compare(smollm2, tmp_path, steps=3, dtype="bfloat16", with_renamed_key=True,
                               with_eagle31=True)
    assert report["speculators"] == "0.9.0"
    spec, sgl, before_fc, fc_norm, renamed = report["cases"]
    for case in (spec, sgl, before_fc, fc_norm):
        print(f"{case['route']}: max abs logit diff per step {case['max_abs_diff_per_step']} "
              f"(logits up to {case['max_abs_logit']:.1f}), argmax agreement {case['argmax_agreement']}")
        assert case["attention"] == "sdpa" and case["steps"] == 3 and case["draft_vocab"] == 4096
        assert _clean(case) and case["embedding_is_verifiers"], case
        assert case["max_abs_diff"] < TOLERANCE, case
        assert case["argmax_agreement"] == 1.0, case
    # Aux layers in speculators' entering-layer numbering ([2, L//2, L-3] for L = 30), flags as written.
    assert spec["aux_layer_ids_loaded"] == sgl["aux_layer_ids_loaded"] == [2, 15, 27]
    assert spec["norm_before_residual_loaded"] is True and sgl["norm_before_residual_loaded"] is False
    # The EAGLE-3.1 flags as written; the audit above saw input_norm / fc_norm.{i} loaded unchanged.
    flags = ("norm_before_fc", "fc_norm", "norm_output")
    assert [spec[f"{flag}_loaded"] for flag in flags] == [False, False, False]
    assert [before_fc[f"{flag}_loaded"] for flag in flags] == [True, False, True]
    assert [fc_norm[f"{flag}_loaded"] for flag in flags] == [False, True, False]
    # The speculators folder names the hub id; the check points it at the local copy.
    assert spec["verifier_in_file"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # The converter took every key of the SGLang file, with the aux layers one higher.
    assert sgl["aux_layer_ids_passed"] == [2, 15, 27]
    assert sgl["converter_missing_keys"] == [] and sgl["converter_unexpected_keys"] == []
    assert _clean(sgl["against_export"]), sgl["against_export"]
    # A key named differently is caught three ways, though the converter loads with strict=False.
    assert renamed["converter_missing_keys"] == ["layers.0.hidden_norm.weight"]
    assert renamed["converter_unexpected_keys"] == ["layers.0.hidden_normx.weight"]
    against = renamed["against_export"]
    assert against["missing_keys"] == ["layers.0.hidden_norm.weight"]
    assert against["unexpected_keys"] == ["layers.0.hidden_normx.weight"]
    assert renamed["max_abs_diff"] > 100 * TOLERANCE

"""Manifests say where each recommended setting comes from: chosen from timings ("measured", with
the hardware that timed it), copied from the eval config ("configured"), or a default; a CPU
measurement is labelled as such and not offered as GPU serving advice."""
from __future__ import annotations

import json

from export import export_head
from export.manifest import recommended_runtime, runtime_from_manifest
from heads.recommended import RecommendedRuntime
from tests.export.conftest import make_eagle, make_medusa

CPU = {"device_type": "cpu", "hardware": "CPU x86_64, 2 threads"}
GPU = {"device_type": "cuda", "hardware": "NVIDIA H100 80GB HBM3"}
EVAL = {"top_k": 4, "depth": 3, "total_tokens": 12, "chain_depth": 3}


def record(**values) -> RecommendedRuntime:
    return RecommendedRuntime(**values)


def test_a_cpu_measured_tree_size_is_labelled_and_config_values_are_configured(tmp_path, target):
    head, config = make_eagle(target)
    runtime = record(**EVAL, measured=["total_tokens"], measured_on=CPU)
    folder = export_head(head, config, "eagle", tmp_path / "e", target, manifest_extra={"runtime": runtime})
    section = json.loads((folder / "specheads.json").read_text())["runtime"]
    assert section["sources"] == {"top_k": "configured", "depth": "configured", "total_tokens": "measured",
                                  "chain_depth": "configured"}
    assert section["source"] == "measured" and section["measured_on"] == CPU
    assert section["gpu_serving_advice"] is False and "NOT GPU serving advice" in section["advice"]
    assert section["sglang"]["speculative_num_draft_tokens"] == 12  # the values themselves are unchanged
    card = (folder / "README.md").read_text()
    assert "chain_depth configured" in card and "total_tokens measured" in card
    assert "CPU x86_64, 2 threads (cpu): NOT GPU serving advice" in card


def test_settings_timed_on_a_gpu_are_serving_advice_and_nothing_timed_has_no_hardware(target):
    _, config = make_eagle(target)
    on_gpu = recommended_runtime(config, record(**EVAL, measured=["total_tokens"], measured_on=GPU))
    assert on_gpu["gpu_serving_advice"] is True and on_gpu["measured_on"] == GPU
    fixed = recommended_runtime(config, record(**EVAL, measured=[], measured_on=CPU))  # a fixed tree size
    assert fixed["source"] == "configured" and set(fixed["sources"].values()) == {"configured"}
    assert fixed["measured_on"] is None and fixed["gpu_serving_advice"] is False
    nothing = recommended_runtime(config, None)
    assert nothing["source"] == "default (not measured)" and nothing["measured_on"] is None
    older = recommended_runtime(config, record(**EVAL))  # a record from before provenance: only the tree size was timed
    assert older["sources"]["chain_depth"] == "configured" and older["sources"]["total_tokens"] == "measured"
    assert older["measured_on"] == {"device_type": "unknown", "hardware": "not recorded"}


def test_medusa_provenance_and_a_reexport_keeps_it(target):
    _, config = make_medusa(target)
    choices = [[0], [0, 0], [1]]
    section = recommended_runtime(config, record(medusa_choices=choices, measured=["medusa_choices"],
                                                 measured_on=CPU))
    assert section["sources"] == {"medusa_choices": "measured"} and section["tensorrt_llm"]["max_draft_len"] == 3
    assert section["gpu_serving_advice"] is False
    assert recommended_runtime(config, runtime_from_manifest(section)) == section
    _, eagle = make_eagle(target)
    first = recommended_runtime(eagle, record(**EVAL, measured=["total_tokens"], measured_on=CPU))
    assert recommended_runtime(eagle, runtime_from_manifest(first)) == first


def test_a_reexport_keeps_each_label_and_reads_older_sections(target):
    """Defaults stay defaults and configured values stay configured through a re-export; a section
    written before sections labelled each setting (the first release head's) reads as before."""
    _, config = make_eagle(target)
    partial = recommended_runtime(config, record(total_tokens=6, measured=["total_tokens"], measured_on=CPU))
    assert partial["sources"] == {"top_k": "default (not measured)", "depth": "default (not measured)",
                                  "total_tokens": "measured", "chain_depth": "default (not measured)"}
    back = runtime_from_manifest(partial)
    assert back == record(total_tokens=6, measured=("total_tokens",), measured_on=CPU)
    assert recommended_runtime(config, back) == partial
    unlabelled = {"tree": {"top_k": 2, "depth": 3, "total_tokens": 2}, "chain_depth": 4, "source": "measured"}
    section = recommended_runtime(config, runtime_from_manifest(unlabelled))
    assert section["sources"]["total_tokens"] == "measured" and section["sources"]["top_k"] == "configured"
    assert section["tree"] == unlabelled["tree"] and section["measured_on"]["hardware"] == "not recorded"
    assert runtime_from_manifest({**partial, "source": "configured"}) is None  # nothing timed: not carried
    checkpoint = {"top_k": 3, "depth": 2, "total_tokens": 7, "chain_depth": 2}  # a checkpoint's own record
    assert runtime_from_manifest(checkpoint) == record(**checkpoint)
    assert RecommendedRuntime.from_dict(back.to_dict()) == back

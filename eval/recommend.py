"""What a report recommends: the runtime settings eval ran the head's drafters with, naming those
chosen from this run's timings, and the head's fields. The one-batch measurement (`eval.run`) and
the batch-size sweep (`eval.batch_eval`) both write them, so both import them from here."""
from __future__ import annotations

from dataclasses import asdict

from eval.config import RuntimeConfig
from heads.recommended import RecommendedRuntime


def head_fields(config) -> dict:
    """A head config's fields for a report, less the target fingerprint (the report names it once)."""
    values = asdict(config)
    values.pop("target_fingerprint", None)
    return values


def recommended_runtime(rows: list[dict], runtime: RuntimeConfig, extra: dict, where: dict) -> RecommendedRuntime | None:
    """The settings eval ran with for the head's drafters, naming those chosen from this run's
    timings (the rest are configured) and the hardware that timed them; None without a head drafter."""
    trees = [r for r in rows if r["name"].startswith("eagle_tree")]
    if trees:
        best = max(trees, key=lambda r: r["tokens_per_second"])
        chosen = len(trees) > 1 or best["settings"].get("total_tokens_auto", False)
        return RecommendedRuntime(top_k=runtime.tree_top_k, depth=runtime.tree_depth,
                                  total_tokens=best["settings"]["total_tokens"], chain_depth=runtime.chain_depth,
                                  measured=("total_tokens",) if chosen else (), measured_on=where)
    peagle = [r for r in rows if r["name"] == "peagle_tree"]
    if peagle:  # P-EAGLE: the tree's size over the head's K slots (one forward drafts them all; no top_k)
        best = max(peagle, key=lambda r: r["tokens_per_second"])
        chosen = best["settings"].get("total_tokens_auto", False)
        return RecommendedRuntime(depth=best["settings"]["depth"], total_tokens=best["settings"]["total_tokens"],
                                  chain_depth=runtime.chain_depth, measured=("total_tokens",) if chosen else (),
                                  measured_on=where)
    if "medusa" in extra:
        return RecommendedRuntime(medusa_choices=extra["medusa"]["choices"],
                                  measured=("medusa_choices",) if runtime.medusa_choices == "auto" else (),
                                  measured_on=where)
    return None

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
    for family in ("eagle_tree", "peagle_tree"):
        trees = [r for r in rows if r["name"].split("@")[0] == family]
        if not trees:
            continue
        best = max(trees, key=lambda r: r["tokens_per_second"])
        chosen = len(trees) > 1 or best["settings"].get("total_tokens_auto", False)
        # P-EAGLE's tree spans its slots (one forward drafts them all) and has no top_k
        shape = ({"top_k": runtime.tree_top_k, "depth": runtime.tree_depth} if family == "eagle_tree"
                 else {"depth": best["settings"]["depth"]})
        return RecommendedRuntime(**shape, total_tokens=best["settings"]["total_tokens"],
                                  chain_depth=runtime.chain_depth, measured=("total_tokens",) if chosen else (),
                                  measured_on=where)
    if "medusa" in extra:
        return RecommendedRuntime(medusa_choices=extra["medusa"]["choices"],
                                  measured=("medusa_choices",) if runtime.medusa_choices == "auto" else (),
                                  measured_on=where)
    return None

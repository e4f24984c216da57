"""Run prompts through vLLM's offline API, plainly and with speculative drafts, and report what the
engine accepted. Runs in the venv of scripts/setup_vllm.sh, never the project's: it imports only
vLLM and the standard library. eval/engine.py writes the job and reads the answer.

    .venv-vllm/bin/python scripts/vllm_check.py JOB.json OUT.json

JOB.json: {"target": local folder of the base model, "dtype": "float32" | "bfloat16",
"prompts": [[token ids], ...], "max_tokens": int, "temperature": float, "seed": int,
"plain": bool (also run the engine without a draft), "cases": [{"name", "method" (eagle3 | eagle |
medusa | dflash | peagle: eagle3 with parallel drafting), "model" (draft folder), "k", "prompts" (how many of the prompts; null: all)}]}.

OUT.json: per run its output token ids per prompt, its seconds in `generate` and, for a speculative
run, the engine's spec-decode counters per prompt: drafts (speculative steps), draft_tokens,
accepted_tokens and accepted_per_position_counts (accepted at draft position i), with the engine's
version.
Prompts go in as token ids, one request at a time, so the engine sees exactly the tokens our
runtime sees and no batching changes its numerics.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(llm) -> dict:
    """The engine's cumulative spec-decode counters, summed over its engines' labels."""
    from vllm.v1.metrics.reader import Counter, Vector

    totals = {name: 0 for name in SPEC_COUNTERS.values()}
    per_position: list[int] = []
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name == PER_POSITION:
            per_position = [a + b for a, b in zip(per_position + [0] * len(metric.values), metric.values)]
    totals["accepted_per_position_counts"] = per_position
    return totals


def difference(after: dict, before: dict) -> dict:
    """The counters one request added: drafts, draft_tokens, accepted_tokens, accepted per position."""
    spec = {key: after[key] - before[key] for key in SPEC_COUNTERS.values()}
    counts, previous = after["accepted_per_position_counts"], before["accepted_per_position_counts"]
    previous = previous + [0] * (len(counts) - len(previous))
    spec["accepted_per_position_counts"] = [a - b for a, b in zip(counts, previous)]
    return spec


def run_one(job: dict, case: dict | None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(p) for p in job["prompts"]) + job["max_tokens"] + 64
    options = dict(model=job["target"], dtype=job["dtype"], max_model_len=longest, seed=job["seed"],
                   disable_log_stats=False, enforce_eager=True, max_num_seqs=1,
                   distributed_executor_backend="uni")
    if case is not None:
        config = {"method": case["method"], "num_speculative_tokens": case["k"]}
        if case["method"] == "peagle":  # P-EAGLE runs as eagle3 drafting all K positions in one pass
            config.update(method="eagle3", parallel_drafting=True)
        config["model"] = case["model"]
        options["speculative_config"] = config
    llm = LLM(**options)
    params = SamplingParams(temperature=job["temperature"], max_tokens=job["max_tokens"], seed=job["seed"],
                            ignore_eos=False)
    tokens, per_prompt, seconds = [], [], []
    count = (case or {}).get("prompts") or len(job["prompts"])
    # first-call overheads (kernel selection, allocations) are paid here, outside the timed requests
    llm.generate([TokensPrompt(prompt_token_ids=list(job["prompts"][0]))],
                 SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for prompt in job["prompts"][:count]:  # one request at a time: no batch shapes in the numerics
        before = counters(llm) if case is not None else None
        start = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - start)
        tokens.append(list(output.outputs[0].token_ids))
        if case is not None:
            per_prompt.append(difference(counters(llm), before))
    result = {"name": "plain" if case is None else case["name"], "tokens": tokens, "seconds": sum(seconds),
              "per_prompt_seconds": seconds,
              "new_tokens": sum(len(t) for t in tokens)}
    if case is not None:
        result.update(case=case, per_prompt=per_prompt)
    del llm
    gc.collect()
    return result


def main() -> None:
    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as handle:
        job = json.load(handle)
    import vllm

    runs = [run_one(job, None)] if job.get("plain", True) else []
    for case in job["cases"]:
        try:
            runs.append(run_one(job, case))
        except Exception as error:  # a folder the engine refuses is an answer, not the end of the job
            runs.append({"name": case["name"], "case": case, "error": f"{type(error).__name__}: {error}"})
            gc.collect()
    answer = {"engine": "vllm", "version": vllm.__version__, "runs": runs}
    tmp = out_path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(answer, handle)
    os.replace(tmp, out_path)


if __name__ == "__main__":  # vLLM's engine process is spawned: the work must not run on import
    main()

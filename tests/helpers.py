"""Helpers that several test modules share (test modules never import each other)."""
from __future__ import annotations


def report_row(name, total_tokens=None, tau=2.0, tps=50.0, identical=True, lossy=False, sweep=False):
    """One drafter row of an eval report, as eval.run assembles it."""
    settings = {"total_tokens": total_tokens} if total_tokens else {}
    return {"name": name, "verification": "typical" if lossy else "lossless", "lossy": lossy, "sweep": sweep,
            "settings": settings, "tau": tau, "acceptance_per_depth": [0.8, 0.5, 0.2], "mean_tree_size": 7.0,
            "draft_ms_per_step": 5.0, "verify_ms_per_step": 40.0, "tokens_per_second": tps,
            "speedup_vs_plain": tps / 30.0, "speedup_vs_transformers": tps / 10.0, "greedy_identical": identical,
            "verify_cost_in_plain_steps": 40.0 * 30.0 / 1000.0, "break_even_tau": 45.0 * 30.0 / 1000.0}


def report(**overrides):
    """A hand-made eval report (eval.run.evaluate's layout): two EAGLE tree sizes, a chain, a lossy Medusa."""
    values = {
        "target": "tiny", "num_prompts": 2, "threads": 2, "sampling": {"temperature": 0.0},
        "runtime": {"max_new_tokens": 16},
        "notes": ["tau = tokens committed per target forward, bonus token INCLUDED"],
        "baselines": {"plain": {"tokens_per_second": 30.0, "speedup_vs_transformers": 3.0},
                      "transformers": {"tokens_per_second": 10.0, "greedy_identical": True}},
        "drafters": [report_row("eagle_tree", 16, tau=2.6, tps=60.0),
                     report_row("eagle_tree@4", 4, tau=1.8, tps=45.0, sweep=True),
                     report_row("eagle_chain", tau=2.1, tps=52.0), report_row("medusa", lossy=True, identical=None)],
    }
    values.update(overrides)
    return values

"""Helpers that several test modules share (test modules never import each other)."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval.runtime.drafters import Candidates
from eval.runtime.sampling import sample
from eval.runtime.verify import Verdict, children_lists


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


class OracleDrafter:
    """Knows the plain greedy continuation; `right` drafts are correct, then `wrong` wrong ones,
    optionally with a decoy sibling before every correct node (a tree)."""

    feature_layers = ()

    def __init__(self, reference: list[int], prompt_length: int, right: int, wrong: int, decoys: bool = False,
                 vocab: int = 128):
        self.reference, self.prompt_length, self.vocab = reference, prompt_length, vocab
        self.right, self.wrong, self.decoys = right, wrong, decoys
        self.accepted_log = []

    def reset(self, prompt):
        pass

    def propose(self, state):
        done = state.tokens.shape[0] - self.prompt_length  # tokens generated so far
        truth = self.reference[done: done + self.right + self.wrong]
        tokens, parents, previous = [], [], -1
        for i, token in enumerate(truth):
            if i >= self.right:
                token = (token + 1) % self.vocab
            if self.decoys:
                tokens.append((token + 7) % self.vocab)
                parents.append(previous)
            tokens.append(token)
            parents.append(previous)
            previous = len(tokens) - 1
        return Candidates(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def accept(self, state, accepted):
        self.accepted_log.append(len(accepted))


def random_parents(n: int, rng: random.Random, max_children: int | None = None) -> list[int]:
    """A random tree of n nodes as parent indices (node 0 the root), at most max_children per node."""
    parents, children = [-1], [0]
    for i in range(1, n):
        options = [j for j in range(i) if max_children is None or children[j] < max_children]
        parent = rng.choice(options)
        parents.append(parent)
        children[parent] += 1
        children.append(0)
    return parents


def tree_paths(parents) -> list[list[int]]:
    """Root-to-leaf node indices of the tree given by parent indices, one list per leaf, in leaf order."""
    parents = [int(p) for p in parents]
    leaves = [i for i in range(len(parents)) if i not in parents]
    paths = []
    for leaf in leaves:
        chain, node = [], leaf
        while node != -1:
            chain.append(node)
            node = parents[node]
        paths.append(chain[::-1])
    return paths


def chi_square_p_value(counts: dict, exact: dict, samples: int) -> float:
    """P-value of observed counts against exact probabilities (Pearson's chi-square)."""
    statistic = sum((counts.get(k, 0) - samples * e) ** 2 / (samples * e) for k, e in exact.items())
    dof = len(exact) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(statistic / 2.0, dtype=torch.float64)))


def pooled_rare(counts: dict, exact: dict, samples: int, least: float = 5.0) -> tuple[dict, dict]:
    """Sequences expected fewer than `least` times in `samples` pooled into one cell: Pearson's
    statistic is dominated by a single draw of a 1e-5 sequence otherwise (whatever the drafter, the
    first token comes from the target alone, and the random stream a drafter leaves decides which
    ones appear)."""
    rare = [key for key, p in exact.items() if p * samples < least]
    pooled_counts = {key: value for key, value in counts.items() if key not in rare}
    pooled_exact = {key: value for key, value in exact.items() if key not in rare}
    pooled_counts["rare"] = sum(counts.get(key, 0) for key in rare)
    pooled_exact["rare"] = sum(exact[key] for key in rare)
    return pooled_counts, pooled_exact


def broken_verify(tree, tokens, target_probs, draft_probs, generator=None) -> Verdict:
    """A broken sampler the chi-square checks must catch: accepts with min(1, p/q) like the real
    rule, but on rejection keeps sampling from p instead of the residual max(0, p - q) (or p with
    the rejected token zeroed)."""
    children = children_lists(tree.parents.tolist())
    node, accepted = 0, []
    while True:
        p = target_probs[node]
        for child in children[node]:
            x = tokens[child]
            q_x = 1.0 if draft_probs is None else float(draft_probs[child - 1][x])
            if float(torch.rand((), generator=generator)) * q_x < float(p[x]):
                accepted.append(child)
                node = child
                break
        else:
            return Verdict(accepted, sample(p, generator))


class ToyTokenizer:
    """Characters <-> ids 3..122; a chat template that writes 'U:' / 'A:' lines."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(("U:" if m["role"] == "user" else "A:") + m["content"] + "\n" for m in messages)
        return text + ("A:" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 120 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i < 3))

    def get_vocab(self):
        return {chr(c): 3 + c % 120 for c in range(32, 127)}


def tamper_weights(folder, file, change):
    """Rewrite a weights file and re-seal its hash, so the schema check (not the hash) must catch it."""
    tensors = load_file(str(folder / file))
    change(tensors)
    save_file(tensors, str(folder / file))
    reseal(folder, file)


def tamper_json(folder, file, change):
    """Rewrite a JSON file of an export and re-seal its hash."""
    values = json.loads((folder / file).read_text())
    change(values)
    (folder / file).write_text(json.dumps(values))
    reseal(folder, file)


def reseal(folder, file):
    """Record a changed file's sha256 in the export's manifest (a tampering the hash check misses)."""
    from heads.io import sha256_file

    manifest = json.loads((folder / "specheads.json").read_text())
    manifest["files"][file]["sha256"] = sha256_file(folder / file)
    (folder / "specheads.json").write_text(json.dumps(manifest))


def validation_problems(folder, target=None) -> str:
    """The problems validate_export reports for a folder that must fail, one per line."""
    from export import ExportValidationError, validate_export

    with pytest.raises(ExportValidationError) as info:
        validate_export(folder, target)
    return "\n".join(info.value.problems)


ARCH_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "intermediate_size", "vocab_size")


def pipeline_job(model_dir, tmp_path, run: str, steps: int, *extra: str, records: str = "null"):
    """A job on the tiny chat model (the `tiny_chat_model` fixture): its architecture read from the
    folder, a few training steps."""
    from train.__main__ import compose_job

    return compose_job([
        f"model.name_or_path={model_dir}", *(f"model.arch.{key}=null" for key in ARCH_KEYS),
        f"data.source={model_dir / 'data.jsonl'}", f"data.max_records={records}", "data.eval_fraction=0.25",
        "data.regenerate.enabled=false",  # the default job's self-distillation: on where a test asks
        f"data.cache_dir={tmp_path / 'cache'}", f"trainer.output_dir={tmp_path / run}",
        f"trainer.max_steps={steps}", f"trainer.eval_every={steps}", f"trainer.save_every={steps}",
        "trainer.eval_batches=1", "trainer.max_minutes=null", "trainer.schedule_clock=steps", "logger=none",
        *extra])

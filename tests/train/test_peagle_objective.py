import pytest
import torch
import torch.nn.functional as F

from data.collate import collate
from heads.config import HeadsConfig
from heads.eagle3 import init_from_target
from heads.peagle import PeagleConfig, PeagleHead
from train.eagle3_objective import feature_layers, split_features
from train.kinds import KINDS, PeagleKind, head_kind
from train.losses import eagle_position_mask, kl_divergence_chunked
from train.objectives import FrozenParts, OnlineFeatures
from train.peagle_objective import cod_chains, cod_rows, peagle_eval_counts, peagle_step
from tests.tiny import tiny_target

AUX, K = [0, 1, 3], 4


@pytest.fixture(scope="module")
def target():
    return tiny_target(num_hidden_layers=4)


def _head(target, vocab=None, seed=0):
    torch.manual_seed(seed)
    size = target.vocab_size if vocab is None else vocab.numel()
    config = PeagleConfig.from_target(target, draft_vocab_size=size, aux_layer_ids=AUX, speculative_tokens=K,
                                      norm_before_residual=True)
    return init_from_target(PeagleHead(config), target, vocab)


def _batch():
    rows = [{"id": "a", "input_ids": list(range(3, 19)), "loss_mask": [0] * 3 + [1] * 11 + [0, 1]},
            {"id": "b", "input_ids": list(range(60, 71)), "loss_mask": [0] * 2 + [1] * 9}]  # padded to 16
    batch = collate(rows, 0)
    batch["ids"] = [row["id"] for row in rows]
    return batch


def _drafted(head, parts, ids, aux, a, depth):
    """Row (a, depth) as the drafter computes it: the committed rows 0..a, then `depth` mask slots,
    one causal forward with no mask at all."""
    embeds = parts.embed(ids[None, 1:a + 2])
    hidden = head.project(aux[None, : a + 1])
    if depth:
        slot_embeds, slot_hidden = head.slot_inputs(parts.embed, depth, hidden.dtype)
        embeds, hidden = torch.cat([embeds, slot_embeds[None]], 1), torch.cat([hidden, slot_hidden[None]], 1)
    out, _ = head(embeds, hidden, torch.arange(a + 1 + depth)[None])
    return out[0, -1]


def test_cod_draw_follows_the_reference_counts():
    counted = torch.zeros(300, dtype=torch.bool)
    counted[10:290] = True
    counted[150] = False  # a hole: chains cannot cross it
    seeds = int(counted.sum())
    anchors, depths = cod_chains(counted, 8, 0.7, 0.2, 512, torch.Generator().manual_seed(0))
    rows = set(zip(anchors.tolist(), depths.tolist()))
    for d in range(1, 8):
        at = depths == d
        assert int(at.sum()) <= int((seeds - d) * max(0.7**d, 0.2))
        assert counted[anchors[at] + d].all()
    assert int((depths == 1).sum()) == int((seeds - 1) * 0.7)
    assert all((a, d - 1) in rows for a, d in rows if d >= 2)  # chains survive depth by depth
    few, _ = cod_chains(counted, 8, 0.7, 0.2, 16, torch.Generator().manual_seed(0))
    assert len(set(few.tolist())) <= 16
    none = cod_rows(torch.zeros(2, 5, dtype=torch.bool), 8, 0.7, 0.2, 512)
    assert none[0].shape == (2, 1) and (none[0] == -1).all()


def test_kl_is_torch_kl_div():
    torch.manual_seed(0)
    hidden, weight, teacher = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8), torch.randn(3, 11)
    rows = torch.tensor([0, 2, 2, 1, 0])
    kl, hits = kl_divergence_chunked(hidden, weight, teacher, rows, chunk_size=2)
    expected = F.kl_div(torch.log_softmax(hidden @ weight.T, -1), torch.softmax(teacher[rows], -1),
                        reduction="none").sum(-1)
    torch.testing.assert_close(kl, expected)
    assert torch.equal(hits, (hidden @ weight.T).argmax(-1) == teacher[rows].argmax(-1))


@pytest.mark.parametrize("vocab", [None, torch.tensor([3, 4, 5, 6, 7, 8, 10, 12, 20, 61, 62, 63, 64, 65, 90])])
def test_step_is_the_mean_kl_of_each_row_as_drafted(target, vocab):
    head, parts, batch = _head(target, vocab), FrozenParts.from_target(target), _batch()
    features = OnlineFeatures(target, feature_layers(AUX))(batch)
    options = HeadsConfig().peagle
    options.max_anchors = 6  # a real draw: fewer seeds than counted rows
    out = peagle_step(head, parts, batch, features, options, 7, torch.Generator().manual_seed(3))
    base = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])
    anchors, depths = cod_rows(base, K, 0.7, 0.2, 6, torch.Generator().manual_seed(3))
    aux, final = split_features(features, len(AUX))
    t2d = head.t2d
    per_depth = [[] for _ in range(K)]
    total = []
    with torch.no_grad():
        for b in range(2):
            rows = [(a, 0) for a in base[b].nonzero()[:, 0].tolist()]
            rows += [(a, d) for a, d in zip(anchors[b].tolist(), depths[b].tolist()) if a >= 0]
            for a, d in rows:
                state = _drafted(head, parts, batch["input_ids"][b], aux[b], a, d)
                q = torch.log_softmax(head.logits(state), -1)
                p = torch.softmax(parts.lm_head_weight[t2d] @ final[b, a + d + 1], -1)
                kl = float((p * (p.log() - q)).sum())
                per_depth[d].append(kl)
                total.append(kl)
    assert out["loss"].item() == pytest.approx(sum(total) / len(total), rel=1e-4)
    for d in range(K):
        assert out["step_losses"][d].item() == pytest.approx(sum(per_depth[d]) / len(per_depth[d]), rel=1e-4)
        assert out["hits"][d].numel() == len(per_depth[d])
    out["loss"].backward()
    for name in ("mask_hidden", "fc.weight", "midlayer.self_attn.q_proj.weight"):
        assert head.get_parameter(name).grad.abs().sum() > 0, name


def test_eval_counts_score_every_chain_as_drafted(target):
    head, parts, batch = _head(target), FrozenParts.from_target(target), _batch()
    features = OnlineFeatures(target, feature_layers(AUX))(batch)
    base = eagle_position_mask(batch["loss_mask"], batch["attention_mask"])
    aux, final = split_features(features, len(AUX))
    expected = torch.zeros(K, 3)
    with torch.no_grad():
        for b in range(2):
            for a in range(base.shape[1]):
                for d in range(K):
                    if a + d >= base.shape[1] or not base[b, a + d]:
                        continue
                    truth = int((parts.lm_head_weight @ final[b, a + d + 1]).argmax())
                    top = head.logits(_drafted(head, parts, batch["input_ids"][b], aux[b], a, d)).topk(5).indices
                    expected[d] += torch.tensor([float(top[0] == truth), float(truth in top.tolist()), 1.0])
    truths = []
    counts = peagle_eval_counts(head, parts, batch, features, 3, truths)  # 3 chains a forward: several chunks
    torch.testing.assert_close(counts, expected)
    torch.testing.assert_close(peagle_eval_counts(head, parts, batch, features, 64, truths), expected)


def test_kind_builds_trains_and_warm_starts(target):
    heads = HeadsConfig(type="peagle")
    heads.peagle.aux_layer_ids, heads.peagle.speculative_tokens = AUX, K
    heads.peagle.init_fc, heads.peagle.ridge_tokens, heads.peagle.fc_learning_rate_scale = "ridge", 50, 0.1
    kind = head_kind(heads)
    assert isinstance(kind, PeagleKind) and "peagle" in KINDS and kind.eval_rows == K
    assert kind.feature_layers(4) == (0, 1, 3, -1)
    head, config = kind.build(target, torch.arange(20, 60))
    assert isinstance(head, PeagleHead) and config.speculative_tokens == K and config.norm_before_residual
    groups = kind.param_groups(head, 1e-3)
    assert groups[0]["lr"] == pytest.approx(1e-4) and len(groups[0]["params"]) == 1
    heads.peagle.eagle3_learning_rate_scale = 0.5
    fc, shared, mask = head_kind(heads).param_groups(head, 1e-3)
    assert (fc["lr"], shared["lr"], mask["lr"]) == pytest.approx((5e-5, 5e-4, 1e-3))
    assert mask["params"] == [head.mask_hidden]
    assert sum(len(g["params"]) for g in (fc, shared, mask)) == len(list(head.parameters()))
    parts, batch = FrozenParts.from_target(target), _batch()
    source = OnlineFeatures(target, kind.feature_layers(4))
    kind.prepare(head, parts, source, [batch], 1, lambda x: x)
    assert head.midlayer.self_attn.o_proj.weight.abs().sum() == 0  # the ridge start: slot 0 is the linear fit
    out = kind.step(head, parts, batch, source(batch), 16)
    means, rates = kind.figures(out)
    assert set(means) == {f"loss_step{d}" for d in range(K)} and f"top1_step{K - 1}" in rates


def test_the_loop_trains_and_saves_a_peagle_head(tmp_path):
    import json

    from heads.io import load_head
    from train.loop import train_heads
    from tests.train.loop_fixtures import tiny_data, tiny_job

    job = tiny_job(tmp_path, "peagle", max_steps=2, eval_every=2, save_every=2)
    job.heads.peagle.aux_layer_ids, job.heads.peagle.speculative_tokens = [0, 1, 1], 3
    job.heads.draft_vocab_size = 64
    target = tiny_target()
    result = train_heads(job, target, tiny_data())
    assert result.head_type == "peagle"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {"eval/top1_step0", "eval/top1_step2", "eval/acceptance_length"} <= set(rows[-1])
    assert "train/top1_step2" in set().union(*(r for r in rows if "train/loss" in r))
    head, config, _ = load_head(result.last_checkpoint, target)
    assert isinstance(head, PeagleHead) and config.draft_vocab_size == 64 and config.speculative_tokens == 3


def test_the_dry_run_plans_a_big_peagle_job():
    from train.__main__ import compose_job
    from train.plan import format_plan, head_parameter_counts, make_plan, peagle_rows_per_token

    peagle = compose_job(["+recipe=eagle_llama3_8b", "heads=peagle", "runtime.drafters=[prompt_lookup]"])
    eagle3 = compose_job(["+recipe=eagle_llama3_8b"])
    assert peagle.heads.type == "peagle" and peagle.trainer.learning_rate == 1e-4
    assert head_parameter_counts(peagle)[0] == head_parameter_counts(eagle3)[0] + 3 * 4096  # + mask_hidden
    # T = 2048, 512 seeds: 512 x (0.7 + 0.49 + 0.343 + 0.2401 + 0.2 x 3) mask rows
    assert peagle_rows_per_token(peagle) == pytest.approx(1 + 512 * 2.3731 / 2048)
    plan = make_plan(peagle, num_records=1000, tokens_per_record=1000.0)
    assert plan.cache_layers == 4 and plan.cache_bytes > 0
    assert any(item.name == "block attention" for item in plan.training)
    assert "feature cache on disk" in format_plan(plan)


def test_an_eagle3_head_starts_a_peagle_head_and_other_starts_are_refused(tmp_path):
    from heads.eagle3 import Eagle3Head
    from heads.io import load_head
    from train.loop import build_head_for_job, train_heads
    from tests.train.loop_fixtures import tiny_data, tiny_job

    target, data = tiny_target(), tiny_data()
    job = tiny_job(tmp_path / "eagle3", "eagle3", max_steps=2)
    job.heads.eagle3.norm_before_fc = True
    job.heads.draft_vocab_size = 64
    source = train_heads(job, target, data).last_checkpoint
    eagle3, _, _ = load_head(source, target)

    def peagle_job(name, **trainer):
        job = tiny_job(tmp_path / name, "peagle", **trainer)
        job.heads.peagle.aux_layer_ids, job.heads.peagle.speculative_tokens = [0, 1, 1], 3
        return job

    head, config = build_head_for_job(peagle_job("p", init_from=str(source)), target)
    assert isinstance(head, PeagleHead) and not isinstance(eagle3, PeagleHead)
    assert config.norm_before_fc and config.speculative_tokens == 3 and config.draft_vocab_size == 64
    theirs = eagle3.state_dict()
    ours = {k: v for k, v in head.state_dict().items() if k != "mask_hidden"}
    assert ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())
    # slot 0 is EAGLE-3's first drafted step: the same logits on the same committed rows
    torch.manual_seed(1)
    embeds = torch.randn(1, 5, config.hidden_size)
    aux = torch.randn(1, 5, 3 * config.target_hidden_size)
    positions = torch.arange(5)[None]
    with torch.no_grad():
        mine = head.logits(head(embeds, head.project(aux), positions)[0])
        reference = eagle3.logits(eagle3(embeds, eagle3.project(aux), positions)[0])
    assert isinstance(eagle3, Eagle3Head) and torch.equal(mine, reference)
    # the loop trains it on, from the adopted weights; eagle3_learning_rate_scale holds them (0: frozen)
    # while mask_hidden trains at the full rate
    def trained(name, scale):
        job = peagle_job(name, init_from=str(source), max_steps=2, save_every=2)
        job.heads.peagle.eagle3_learning_rate_scale = scale
        result = train_heads(job, target, data)
        assert result.head_type == "peagle"
        return load_head(result.last_checkpoint, target)[0].state_dict()

    def moved(state):
        return {k for k, v in state.items() if k in theirs and not torch.equal(v, theirs[k])}

    held, free = trained("p_held", 0.0), trained("p_free", 1.0)
    assert moved(held) == set() and not torch.equal(held["mask_hidden"], head.state_dict()["mask_hidden"])
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight"} <= moved(free)

    wrong = peagle_job("wrong_layers", init_from=str(source))
    wrong.heads.peagle.aux_layer_ids = [0, 1]
    with pytest.raises(ValueError, match=r"reads target layers \[0, 1, 1\].*aux_layer_ids=\[0, 1, 1\]"):
        build_head_for_job(wrong, target)
    medusa = train_heads(tiny_job(tmp_path / "medusa", "medusa", max_steps=1), target, data).last_checkpoint
    with pytest.raises(ValueError, match="holds a MedusaConfig, but heads.type=peagle"):
        build_head_for_job(peagle_job("from_medusa", init_from=str(medusa)), target)

"""Never speculate at a loss: the gate's decisions, and lossless greedy output through
`FallbackDrafter` when speculation switches off and on mid-sequence (EAGLE-1/2 and EAGLE-3 heads
catching up on the features of plain steps in one batch)."""
import pytest
import torch

from eval.runtime.drafters import Candidates, DraftState
from eval.runtime.drafters.adaptive import DecayedRatio, FallbackDrafter, ProbeSchedule, SpeculationGate
from eval.runtime.drafters.eagle import EagleDrafter
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from eval.runtime.sampling import SamplingConfig
from heads.eagle3 import Eagle3Config, Eagle3Head
from tests.helpers import OracleDrafter
from tests.tiny import tiny_eagle_setup, tiny_target

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def setup():
    _, lean, head = tiny_eagle_setup()
    return lean, head


def prompts(count: int, length: int = 7):
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 128, (length,), generator=generator) for _ in range(count)]


class Ticks:
    """A fake clock: every call advances one second, so every step (propose -> accept) takes 1 s."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


class Script:
    """A gate that follows a fixed pattern of decisions (cycled) and records what it was told."""

    def __init__(self, pattern):
        self.pattern, self.calls, self.speculative, self.plain = pattern, 0, [], 0

    def speculate(self):
        self.calls += 1
        return self.pattern[(self.calls - 1) % len(self.pattern)]

    def record_speculative(self, tokens, seconds):
        self.speculative.append((tokens, seconds))

    def record_plain(self, seconds):
        self.plain += 1


def test_decayed_ratio_and_probe_schedule():
    ratio = DecayedRatio(initial=3.0, decay=0.5, prior_weight=1.0)
    assert ratio.value == 3.0
    ratio.add(1.0)
    assert ratio.value == pytest.approx((1.0 + 0.5 * 3.0) / (1.0 + 0.5))
    ratio.add(5.0)
    assert ratio.value == pytest.approx((0.5 * 1.0 + 5.0 + 0.25 * 3.0) / (0.5 + 1.0 + 0.25))
    assert DecayedRatio(prior_weight=0.0).value is None
    probe = ProbeSchedule(every=3)
    assert [probe.due() for _ in range(7)] == [False, False, True, False, False, True, False]
    backoff = ProbeSchedule(every=8, first=2)  # probes after 2, then 4, then every 8 idle steps
    due = [backoff.due() for _ in range(22)]
    assert [i + 1 for i, d in enumerate(due) if d] == [2, 6, 14, 22]
    backoff.reset()
    assert [backoff.due() for _ in range(2)] == [False, True]


def test_gate_switches_off_at_a_loss_probes_and_switches_back():
    gate = SpeculationGate(plain_seconds=0.01, initial_tau=2.0, probe_every=4, probe_first=4)
    assert gate.speculate() and gate.cost is None  # no speculative step measured yet: try it
    for _ in range(20):  # 1.2 tokens per step at 2 plain steps each: a loss
        gate.record_speculative(1, 0.02)
        gate.record_plain(0.01)
    assert gate.cost == pytest.approx(2.0) and not gate.pays()
    # a probe is two speculative steps (the first catches up untimed, the second is timed)
    assert [gate.speculate() for _ in range(10)] == [False, False, False, True, True, False, False, False, True, True]
    for _ in range(20):  # drafts got good: 3 tokens per step at the same cost
        gate.record_speculative(3, 0.02)
    assert gate.pays() and all(gate.speculate() for _ in range(5))
    # Off after a loss, the default gate probes after 2, 4, 8, 16, 16... plain steps, and once the
    # drafts pay again it speculates and the backoff starts over.
    backoff = SpeculationGate(plain_seconds=0.01, initial_tau=2.0, probe_every=16)
    for _ in range(40):
        backoff.record_speculative(1, 0.02)
    decisions = [backoff.speculate() for _ in range(50)]
    assert [i + 1 for i, d in enumerate(decisions) if d] == [2, 3, 7, 8, 16, 17, 33, 34, 50]
    for _ in range(60):
        backoff.record_speculative(3, 0.02)
    assert backoff.speculate()
    for _ in range(60):
        backoff.record_speculative(1, 0.02)
    assert [backoff.speculate() for _ in range(3)] == [False, True, True]
    never = SpeculationGate(plain_seconds=1.0)
    for _ in range(80):  # no draft ever accepted, on a clock that says verifying is cheap
        never.record_speculative(1, 0.5)
    assert never.cost == pytest.approx(0.5, abs=0.01) and not never.pays()
    with pytest.raises(ValueError):
        SpeculationGate(plain_seconds=0.0)


def _gated_run(gate, costs, tokens=2, plain=0.05):
    """Speculative or plain steps as `FallbackDrafter` times them: a speculative step right after
    plain steps catches up and is not timed. costs[i]: step i's speculative time in plain steps."""
    decisions, after_plain = [], False
    for cost in costs:
        speculate = gate.speculate()
        if speculate:
            gate.record_speculative(tokens, None if after_plain else cost * plain)
        else:
            gate.record_plain(plain)
        decisions.append(speculate)
        after_plain = not speculate
    return decisions


def test_gate_recovers_after_a_slow_stretch_once_speculation_pays_again():
    """A slow stretch (another job on the machine: speculative steps at 3 plain steps) switches the
    gate off; once steps cost 1.3 again, tau 2 pays and the gate speculates again. Had the cost
    measured before switching off stayed (probes untimed, memory counted in speculative steps),
    it would stay off for good."""
    gate = SpeculationGate(plain_seconds=0.05, initial_tau=2.0)
    slow = _gated_run(gate, [3.0] * 40)
    assert sum(slow[10:]) <= 8  # off, probing
    fast = _gated_run(gate, [1.3] * 200)
    assert sum(fast[50:]) / 150 > 0.9
    stays = SpeculationGate(plain_seconds=0.05, initial_tau=2.0)
    decisions = _gated_run(stays, [3.0] * 240)
    assert sum(decisions[40:]) / 200 < 0.2  # still a loss: only the probes speculate


@pytest.mark.parametrize("right,wrong", [(0, 3), (4, 0)])
def test_fallback_greedy_equals_plain_and_follows_acceptance(setup, right, wrong):
    lean, _ = setup
    speculated = []
    gate = SpeculationGate(plain_seconds=1.0, probe_every=4, probe_first=4)
    for prompt in prompts(3):
        plain = plain_generate(lean, prompt, NEW_TOKENS).tokens
        clock = Ticks()
        oracle = OracleDrafter(plain + [0] * 8, prompt.shape[0], right, wrong)
        propose = oracle.propose
        oracle.propose = lambda state: (clock(), propose(state))[1]  # drafting costs a plain step: pays iff tau > 2
        result = speculative_generate(lean, FallbackDrafter(oracle, gate, clock), prompt, NEW_TOKENS)
        assert result.tokens == plain
        speculated += [size > 0 for size in result.tree_sizes]
        assert len(oracle.accepted_log) == sum(size > 0 for size in result.tree_sizes)  # accept only after propose
    fraction = sum(speculated) / len(speculated)
    if right:
        assert fraction == 1.0
    else:  # off after the first steps, then a probe (two speculative steps) after every 4 plain ones
        assert 0.3 <= fraction <= 0.5 and speculated[-5:].count(True) == 2


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def each_kind(request):
    """(lean, head): the warm EAGLE-1/2 head, or a random EAGLE-3 head reading two streams (its hidden
    path live, so the cache check below sees every stream of every caught-up position)."""
    if request.param == "eagle":
        _, lean, head = tiny_eagle_setup()
        return lean, head
    target = tiny_target()
    head = Eagle3Head(Eagle3Config.from_target(target, aux_layer_ids=[1, 0])).eval()
    return LeanLlama.from_hf(target.model, max_seq_len=256), head


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_eagle_behind_a_switching_gate_is_lossless_and_catches_up(each_kind, mode):
    lean, head = each_kind
    prompt = prompts(1)[0]
    plain = plain_generate(lean, prompt, NEW_TOKENS).tokens
    script = Script([True, False, False, True, False, True, True])
    drafter = EagleDrafter(head, lean, mode=mode, depth=3, top_k=3, total_tokens=8)
    result = speculative_generate(lean, FallbackDrafter(drafter, script), prompt, NEW_TOKENS)
    assert result.tokens == plain
    sizes = result.tree_sizes
    assert 0 in sizes and max(sizes) > 0 and sizes.index(0) < len(sizes) - 1 - sizes[::-1].index(max(sizes))
    assert script.plain == sizes.count(0) and script.speculative[0][1] is None  # first step: untimed prefill
    # After plain steps the head cache was fed every committed position, as a fresh run would.
    sequence = torch.cat([prompt, torch.tensor(result.tokens)])
    length = drafter.cache_length
    hidden = lean(sequence[:length], lean.new_cache(), hidden_layers=drafter.feature_layers, logits="none").hidden
    features = torch.cat([hidden[layer % (lean.config.num_layers + 1)] for layer in drafter.feature_layers], -1)
    if isinstance(head, Eagle3Head):
        features = head.project(features)  # (C, D)
    _, (k, _) = head(lean.embedding[sequence[1: length + 1]][None], features[None], torch.arange(length)[None],
                     use_cache=True)
    torch.testing.assert_close(drafter.past[0], k, atol=1e-5, rtol=1e-4)


def test_merged_features_span_every_token_since_the_last_proposal():
    seen = []

    class Recorder:
        feature_layers = (2,)

        def reset(self, prompt):
            pass

        def propose(self, state):
            seen.append(state.new_features[2][:, 0].tolist())
            return Candidates.chain([1])

        def accept(self, state, accepted):
            pass

    drafter = FallbackDrafter(Recorder(), Script([True, False, False, True]), Ticks())
    drafter.reset(torch.tensor([0]))
    for step, rows in enumerate([[0.0, 1.0], [2.0], [3.0], [4.0]]):
        state = DraftState(torch.zeros(3, dtype=torch.long), 2, {2: torch.tensor(rows)[:, None]}, 2, SamplingConfig(),
                           step=step)
        drafter.propose(state)
        drafter.accept(state, [])
    assert seen == [[0.0, 1.0], [2.0, 3.0, 4.0]]


def test_steps_that_catch_up_after_plain_steps_are_not_timed_as_typical():
    """A probe after gate-off steps also feeds the drafter every feature since its last proposal;
    its time must not become the cost of a speculative step (that kept speculation off)."""

    class Drafter:
        feature_layers = (2,)

        def reset(self, prompt):
            pass

        def propose(self, state):
            return Candidates.chain([1])

        def accept(self, state, accepted):
            pass

    script = Script([True, True, False, False, True, True])
    drafter = FallbackDrafter(Drafter(), script, Ticks())
    drafter.reset(torch.tensor([0]))
    for step in range(6):
        state = DraftState(torch.zeros(3, dtype=torch.long), 2, {2: torch.zeros(1, 1)}, 2, SamplingConfig(), step=step)
        drafter.propose(state)
        drafter.accept(state, [])
    # fresh sequence (untimed), typical, [plain, plain], catching up (untimed), typical
    assert [seconds for _, seconds in script.speculative] == [None, 1.0, None, 1.0]
    assert script.plain == 2

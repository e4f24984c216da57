"""The drafter table per head kind (eval/runtime/drafters/kinds.py): every kind's chain drafts what
plain greedy decoding would say, eval accepts every name it lists, and it names the drafters that
train/kinds.py says run the kind."""
import pytest
import torch

from eval.config import RuntimeConfig, check_runtime
from eval.runtime.drafters.kinds import KIND_DRAFTERS, drafters_for, head_drafters, kind_drafters
from eval.runtime.generate import plain_generate, speculative_generate
from eval.runtime.model import LeanLlama
from heads.config import HeadsConfig
from heads.dflash import DflashConfig, DflashHead
from heads.medusa import MedusaConfig, MedusaHeads
from heads.peagle import PeagleConfig, PeagleHead
from tests.tiny import tiny_eagle3_setup, tiny_eagle_setup, tiny_target


def _medusa_setup():
    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=128)
    return target, lean, MedusaHeads(MedusaConfig.from_target(target, num_heads=3)).eval()


def _peagle_setup():
    """tiny_eagle3_setup's head with a mask_hidden: slot 0 agrees with the target most of the time."""
    target, lean, eagle3 = tiny_eagle3_setup(max_seq_len=128)
    head = PeagleHead(PeagleConfig(**eagle3.config.to_dict(), speculative_tokens=4))
    head.load_state_dict({**eagle3.state_dict(), "mask_hidden": head.mask_hidden.detach()})
    return target, lean, head.eval()


def _dflash_setup():
    torch.manual_seed(0)
    target = tiny_target()
    lean = LeanLlama.from_hf(target.model, max_seq_len=128)
    return target, lean, DflashHead(DflashConfig.from_target(target, aux_layer_ids=[1, 0], block_size=5)).eval()


SETUPS = {"eagle": lambda: tiny_eagle_setup(max_seq_len=128), "eagle3": lambda: tiny_eagle3_setup(max_seq_len=128),
          "medusa": _medusa_setup, "peagle": _peagle_setup}
SETUPS["dflash"] = _dflash_setup


@pytest.mark.parametrize("kind", sorted(SETUPS))
def test_each_kinds_chain_drafts_depth_tokens_and_keeps_greedy_output(kind):
    _, lean, head = SETUPS[kind]()
    assert drafters_for(head) == KIND_DRAFTERS[kind].drafters
    drafter = kind_drafters(head).chain(head, lean, 3)
    prompt = torch.arange(3, 11)
    result = speculative_generate(lean, drafter, prompt, 12)
    assert result.tokens == plain_generate(lean, prompt, 12).tokens
    assert result.tree_sizes and max(result.tree_sizes) <= 3


def test_every_listed_drafter_is_a_runtime_setting():
    assert head_drafters()
    check_runtime(RuntimeConfig(drafters=list(head_drafters())))


def test_the_table_and_the_training_kinds_name_the_same_drafters():
    from train.kinds import KINDS

    both = sorted(set(KINDS) & set(KIND_DRAFTERS))
    assert {"eagle", "eagle3", "medusa"} <= set(both)
    for kind in both:
        assert tuple(KINDS[kind](HeadsConfig()).drafters) == KIND_DRAFTERS[kind].drafters, kind

import pytest

from data.template import TemplateMismatch, prompt_ids, render, tokenize_with_mask
from tests.data.conftest import FAMILIES

CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And  3+3 ?\n"},
    {"role": "assistant", "content": " Six, i.e. 6.\n\n"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome!"},
]


def _runs(mask):
    runs, start = [], None
    for t, value in enumerate(mask + [0]):
        if value and start is None:
            start = t
        elif not value and start is not None:
            runs.append((start, t))
            start = None
    return runs


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mask_is_exactly_the_replies_and_end_of_turn(family_tokenizers, family):
    tokenizer = family_tokenizers[family]
    lead, end_of_turn = FAMILIES[family]
    ids, mask, length = tokenize_with_mask(tokenizer, CONVERSATION)
    assert len(ids) == len(mask) == length
    # the ids are what the model sees at inference
    assert ids == list(tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    if family == "llama3":  # its template trims message content
        replies = [r.strip() for r in replies]
    runs = _runs(mask)
    # A reply's first token may carry template text merged into it (Vicuna's space after
    # "ASSISTANT:" joins a reply that starts with a letter); it is still the token to predict.
    expected = [("" if r[:1].isspace() else lead) + r + end_of_turn for r in replies]
    assert [tokenizer.decode(ids[a:b]) for a, b in runs] == expected
    unmasked = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    for message in CONVERSATION:
        if message["role"] != "assistant":
            assert message["content"].strip() in unmasked
    assert "assistant" not in tokenizer.decode([i for i, m in zip(ids, mask) if m]).lower()


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cut_mask_is_a_prefix_of_the_full_mask(family_tokenizers, family):
    tokenizer = family_tokenizers[family]
    ids, mask, length = tokenize_with_mask(tokenizer, CONVERSATION)
    for cut in (1, length // 3, length // 2, length - 1, length, length + 5):
        assert tokenize_with_mask(tokenizer, CONVERSATION, max_tokens=cut) == (ids[:cut], mask[:cut], length)


@pytest.mark.integration
def test_prompt_ids_end_with_the_generation_prompt(family_tokenizers):
    tokenizer = family_tokenizers["chatml"]
    ids = prompt_ids(tokenizer, CONVERSATION[:2])
    assert tokenizer.decode(ids).endswith("What is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.integration
def test_template_that_is_not_incremental_is_refused(smollm2_tokenizer):
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
                               "{% if loop.last %}{{ ' [END]' }}{% endif %}{{ '\n' }}{% endfor %}")
    assert render(tokenizer, CONVERSATION[1:3]).endswith("It is 4. [END]\n")
    with pytest.raises(TemplateMismatch, match="turn 2"):
        tokenize_with_mask(tokenizer, CONVERSATION)


@pytest.mark.integration
def test_template_errors_become_template_mismatch(smollm2_tokenizer):
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('no system role') }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(TemplateMismatch, match="no system role"):
        tokenize_with_mask(tokenizer, CONVERSATION)


def _long(replies: int) -> list[dict]:
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(replies):
        messages.append({"role": "user", "content": f"Question {i}?" + ("\n" if i % 3 == 0 else "")})
        messages.append({"role": "assistant", "content": (" " if i % 4 == 1 else "") + f"Answer {i}, done."
                         + ("\n\n" if i % 5 == 2 else "")})
    return messages


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_long_conversations_are_masked_as_turn_by_turn(family_tokenizers, family, monkeypatch):
    """A conversation with more replies than EXACT_REPLIES is aligned in one render; the mask is the
    one the turn-by-turn derivation gives (forced here by raising EXACT_REPLIES)."""
    import data.template as template

    tokenizer, messages = family_tokenizers[family], _long(3 * template.EXACT_REPLIES)
    fast = tokenize_with_mask(tokenizer, messages)
    monkeypatch.setattr(template, "EXACT_REPLIES", 10**9)
    assert fast == tokenize_with_mask(tokenizer, messages)


@pytest.mark.integration
def test_split_renders_a_bounded_number_of_times(smollm2_tokenizer, monkeypatch):
    """Every turn-by-turn check renders a growing prefix (quadratic in turns); a long conversation
    costs the whole render, one aligned render and three checked turns."""
    import data.template as template

    calls = []
    real = template.render
    monkeypatch.setattr(template, "render", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    for replies in (20, 200):
        calls.clear()
        tokenize_with_mask(smollm2_tokenizer, _long(replies))
        assert len(calls) == 2 + 3 * 3


@pytest.mark.integration
def test_a_long_conversation_with_a_template_that_rewrites_earlier_turns_is_refused(smollm2_tokenizer):
    """Like templates that drop earlier turns' reasoning: the aligned render cannot place those
    replies, and the turn-by-turn check names the turn."""
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% set text = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set text = text.split('</think>')[-1] %}{% endif %}"
        "{{ m['role'] + ': ' + text + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    messages = _long(12)
    for message in messages:
        if message["role"] == "assistant":
            message["content"] = "<think>hmm</think>" + message["content"]
    with pytest.raises(TemplateMismatch, match="turn 2"):
        tokenize_with_mask(tokenizer, messages)

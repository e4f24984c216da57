import copy

import pytest

LLAMA3_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = '<|begin_of_text|>' + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
VICUNA_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'A chat between a curious user and an "
    "artificial intelligence assistant. The assistant gives helpful, detailed, and polite answers to the "
    "user\\'s questions.' %}{% endif %}{{ system }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ ' USER: ' + message['content'] }}"
    "{% else %}{{ ' ASSISTANT: ' + message['content'] + '</s>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' ASSISTANT:' }}{% endif %}"
)
# Per family: template text that BPE merges into a reply's first token (Vicuna's " " before a
# reply that starts with a letter), and the end-of-turn token right after the reply.
FAMILIES = {"chatml": ("", "<|im_end|>"), "llama3": ("", "<|eot_id|>"), "vicuna": (" ", "</s>")}


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer (ChatML template) from the dequantized target cache."""
    from transformers import AutoTokenizer

    from heads.target import TargetConfig, resolve_source

    return AutoTokenizer.from_pretrained(resolve_source(TargetConfig())[0])


@pytest.fixture(scope="session")
def family_tokenizers(smollm2_tokenizer):
    """{family: tokenizer}: SmolLM2's vocabulary with each family's template and special tokens."""
    llama3 = copy.deepcopy(smollm2_tokenizer)
    llama3.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    llama3.chat_template = LLAMA3_TEMPLATE
    vicuna = copy.deepcopy(smollm2_tokenizer)
    vicuna.add_special_tokens({"additional_special_tokens": ["</s>"]})
    vicuna.chat_template = VICUNA_TEMPLATE
    return {"chatml": smollm2_tokenizer, "llama3": llama3, "vicuna": vicuna}

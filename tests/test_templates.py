"""Chat templates as models ship them: each keeps turn-to-turn reuse, wherever it puts the system
message, and a template's own refusal is a clear error.

The template strings are those of the models' ``tokenizer_config.json`` (their tool-calling
branches left out: no call here passes tools), driven by a tiny random model and the bundled
tokenizer with each template's own special tokens added to it, as the model's tokenizer has them.
"""

from __future__ import annotations

import copy

import pytest

from conftest import MEMORIES, TINY_CONFIGS, VOCAB, tiny_model
from kvshift_memory import InvalidInputError, KVShiftEngine
from kvshift_memory.engine.prompt import template_style

LLAMA_3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN_2_5 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first)'
    ' or (message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

MISTRAL_V0_3 = (
    '{%- if messages[0]["role"] == "system" %}'
    '{%- set system_message = messages[0]["content"] %}'
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    '{%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}'
    '{{- raise_exception("After the optional system message, conversation roles must alternate '
    'user/assistant/user/assistant/...") }}'
    "{%- endif %}"
    "{%- endfor %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    '{%- if message["role"] == "user" %}'
    "{%- if loop.last and system_message is defined %}"
    '{{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}'
    '{%- else %}{{- "[INST] " + message["content"] + "[/INST]" }}{%- endif %}'
    '{%- elif message["role"] == "assistant" %}'
    '{{- " " + message["content"]|trim + eos_token}}'
    '{%- else %}{{- raise_exception("Only user and assistant roles are supported, with the exception of an initial'
    ' optional system message!") }}'
    "{%- endif %}"
    "{%- endfor %}"
)

GEMMA_2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

GEMMA_3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    '{%- set first_user_prefix = "" -%}'
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    '{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}'
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    '{%- set role = "model" -%}'
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)

#: name: (template, how it places a system message, its special tokens)
TEMPLATES = {
    "llama-3": (LLAMA_3, "system", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
    "qwen-2.5": (QWEN_2_5, "system", []),  # <|im_start|> and <|im_end|> are the bundled tokenizer's too
    "mistral-v0.3": (MISTRAL_V0_3, "fold", ["[INST]", "[/INST]"]),  # moves the system message to the last user turn
    "gemma-2": (GEMMA_2, "fold", ["<start_of_turn>", "<end_of_turn>"]),  # has no system role
    # folds it into the first user turn itself, which keeps it in place
    "gemma-3": (GEMMA_3, "system", ["<start_of_turn>", "<end_of_turn>"]),
    "none (base model)": (None, "plain", []),
}


@pytest.fixture(scope="module")
def model():
    config = TINY_CONFIGS["llama"]()
    config.vocab_size = VOCAB + 8  # room for the templates' special tokens
    return tiny_model(config)


def engine_with(model, tokenizer, template: str | None, special: list[str] = ()) -> KVShiftEngine:
    own = copy.deepcopy(tokenizer)
    own.add_special_tokens({"additional_special_tokens": list(special)})
    own.chat_template = template
    return KVShiftEngine(model, own)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_template_keeps_reuse_on_the_second_turn(name, model, tokenizer):
    template, style, special = TEMPLATES[name]
    engine = engine_with(model, tokenizer, template, special)
    assert template_style(engine.tokenizer) == style
    first = engine.generate([{"role": "user", "content": "Where is the trip?"}], MEMORIES, max_new_tokens=8)
    history = [
        {"role": "user", "content": "Where is the trip?"},
        {"role": "assistant", "content": first.text, "token_ids": first.token_ids},
        {"role": "user", "content": "And the budget?"},
    ]
    second = engine.generate(history, MEMORIES, max_new_tokens=4)
    stats = second.stats
    assert stats.reused_tokens >= 0.8 * stats.prompt_tokens, (name, stats.reused_tokens, stats.prompt_tokens)
    # the memories sit at one place, before the first user message's own text, in every turn
    layout = engine.plan(history, MEMORIES).layout
    text = engine.tokenizer.decode(layout.token_ids)
    assert text.index(MEMORIES[-1]) < text.index("Where is the trip?") < text.index("And the budget?")


def test_a_system_message_without_a_user_turn_still_opens_one(model, tokenizer):
    engine = engine_with(model, tokenizer, GEMMA_2)
    result = engine.generate([{"role": "assistant", "content": "Hello, how can I help?"}], MEMORIES, max_new_tokens=2)
    assert result.stats.prompt_tokens > 0


def test_a_template_refusal_is_a_clear_error(model, tokenizer):
    engine = engine_with(model, tokenizer, GEMMA_2)
    twice = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    with pytest.raises(InvalidInputError, match="chat template refused these messages: Conversation roles"):
        engine.generate(twice, max_new_tokens=1)

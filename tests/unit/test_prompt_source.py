"""Prompt stream: chat-message dataset rows go through the chat template with every role kept."""

import json

import pytest

from slipstream.config import load_config
from slipstream.controller.prompts import PromptSource
from slipstream.models.tokenizer import build_char_tokenizer

TEMPLATE = "{% for m in messages %}<bos>{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}a:"


def _rows(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"}], "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_messages_use_the_template(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    cfg = load_config(None, [f"data.source={_rows(tmp_path)}", "rollout.prompts_per_step=1"])
    (prompt,) = PromptSource(cfg, tok).next_batch()
    assert tok.decode(prompt.prompt_ids) == "<bos>s:be brief\n<bos>u:1+1\na:"
    assert prompt.answer == "2"


def test_chat_messages_without_template_are_a_clear_error(tmp_path):
    cfg = load_config(None, [f"data.source={_rows(tmp_path)}", "rollout.prompts_per_step=1"])
    with pytest.raises(ValueError, match="model.use_chat_template"):
        PromptSource(cfg, build_char_tokenizer()).next_batch()

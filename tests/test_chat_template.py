"""Per-request template options, and the sandbox."""

from __future__ import annotations

import pytest

from llgtrt_core.chat_template import ChatTemplate, ChatTemplateError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{% if greeting %}{{ greeting }}{% endif %}")


def test_render_options() -> None:
    template = ChatTemplate(CHATML, {})
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    assert template.render(messages[:1]).endswith("<|im_start|>assistant\n")
    assert not template.render(messages[:1], add_generation_prompt=False).endswith("assistant\n")
    assert template.render(messages, add_generation_prompt=False, continue_final_message=True).endswith("Hello the")
    assert template.render(messages[:1], extra_context={"greeting": "Bonjour"}).endswith("Bonjour")
    with pytest.raises(ChatTemplateError):
        template.render(messages, add_generation_prompt=True, continue_final_message=True)


def test_template_is_sandboxed() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.__class__.__mro__ }}", {}).render([{"role": "user", "content": "x"}])

"""The chat template as per-role pieces for the app kits (deltaship/chat/pieces.py): derived by rendering with
sentinel messages, checked against the template, refused where pieces cannot express it. No export: fast."""

from __future__ import annotations

import pytest

from deltaship.chat.pieces import render_pieces, template_pieces
from deltaship.chat.template import ChatTemplate
from deltaship.errors import DeltashipError
from deltaship.models.presets import CHAT_TEMPLATE_FILE


def test_tiny_template_pieces():
    template = ChatTemplate(CHAT_TEMPLATE_FILE.read_text())
    p = template_pieces(template)
    assert p["roles"]["user"] == {"prefix": "<|im_start|>user\n", "suffix": "<|im_end|>\n"}
    assert p["roles"]["assistant"] == {"prefix": "<|im_start|>assistant\n", "suffix": "<|im_end|>\n"}
    assert p["generation_prompt"] == "<|im_start|>assistant\n<think>\n"
    assert p["generation_prompt_no_thinking"] == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert p["drop_think"] and p["start"] == ""
    # a past reply that thought: the kit renders it as the template does once a user message follows it
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\nA"},
            {"role": "user", "content": "r"}]  # fmt: skip
    assert render_pieces(p, msgs, True) == template.render(msgs, True)
    assert "<think>\nx" not in render_pieces(p, msgs, True)


def test_template_keeping_think_blocks_and_a_bos():
    source = (
        "<s>{% for m in messages %}[{{ m.role }}]{{ m.content }}[/{{ m.role }}]\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}"
    )
    p = template_pieces(ChatTemplate(source))
    assert p["start"] == "<s>" and not p["drop_think"]
    assert p["roles"]["system"] == {"prefix": "[system]", "suffix": "[/system]\n"}
    assert p["generation_prompt_no_thinking"] == "[assistant]<think></think>"


@pytest.mark.parametrize(
    "source, why",
    [
        # the turn's number in the rendering: no fixed piece per role
        ("{% for m in messages %}{{ loop.index }}{{ m.role }}: {{ m.content }}\n{% endfor %}", "per-role pieces"),
        # Llama-2 style: the system message folded into the first user turn
        (
            "{% for m in messages %}{% if m.role == 'system' %}{% set s = m.content %}{% elif m.role == 'user' %}"
            "[INST] {{ m.content }} [/INST]{% else %} {{ m.content }} </s>{% endif %}{% endfor %}",
            "per-role pieces",
        ),
        # longer conversations render differently: the pieces pass the sentinel rendering, the check catches it
        (
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if loop.index > 4 %}*{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}",
            "pieces render",
        ),
        # only the last assistant turn gets a marker
        (
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if loop.last %}!{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}",
            "per-role pieces",
        ),
    ],
)
def test_templates_pieces_cannot_express_are_refused(source, why):
    """Mutation checked: with pieces.py's `_check` call removed, the `loop.index > 4` case is not refused."""
    with pytest.raises(DeltashipError, match=why) as e:
        template_pieces(ChatTemplate(source), "bundle X: the chat template")
    assert "bundle X" in str(e.value) and "ChatML-style" in e.value.fix


def test_app_time_refusal_names_the_bundle(tmp_path):
    """bundle_pieces (what `deltaship app` calls for every kit with chat) refuses a template pieces cannot express,
    naming the bundle; a bundle without any chat template gets a kit without chat (None)."""
    import hashlib
    import json

    from deltaship.chat.pieces import bundle_pieces

    def bundle(files: dict[str, str]) -> dict:
        for name, text in files.items():
            (tmp_path / name).write_text(text)
        listed = {n: {"sha256": hashlib.sha256(t.encode()).hexdigest(), "size": len(t)} for n, t in files.items()}
        return {"files": listed, "tokenizer": {"files": list(files)}, "tokens": {"eos": [1]}}

    bad = "{% for m in messages %}{{ loop.index }}{{ m.content }}{% endfor %}"
    manifest = bundle({"tokenizer.json": "{}", "chat_template.jinja": bad})
    with pytest.raises(DeltashipError, match=f"{tmp_path}: the chat template cannot be split into per-role pieces"):
        bundle_pieces(tmp_path, manifest)
    (tmp_path / "chat_template.jinja").unlink()
    assert bundle_pieces(tmp_path, bundle({"tokenizer.json": "{}", "tokenizer_config.json": json.dumps({})})) is None

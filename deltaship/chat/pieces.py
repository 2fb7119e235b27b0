"""A chat template as per-role pieces, for the app kits (no Jinja engine on a phone or in a browser).

The template is rendered in Python with sentinel messages and split at them: each role's prefix and suffix, the
generation prompt (with and without thinking), and whether a past assistant turn drops its `<think>` block (Qwen
templates do). The pieces are then checked: the kit's rendering of several conversations must equal the template's,
or the template is refused (it does more than per-role pieces can express).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaship.chat.template import (
    TEMPLATE_FILE,
    ChatTemplate,
    TemplateRefused,
    bundle_chat_template,
    template_file,
)
from deltaship.errors import DeltashipError

ROLES = ("system", "user", "assistant")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_S = {r: f"\u2063DS{r.upper()}{{}}\u2063" for r in ROLES}  # invisible separator: no template emits it


def _sentinel(role: str, i: int) -> str:
    return _S[role].format(i)


def _between(text: str, a: str | None, b: str) -> str:
    start = 0 if a is None else text.index(a) + len(a)
    return text[start : text.index(b, start)]


def render_pieces(pieces: dict[str, Any], messages: list[dict[str, str]], add_generation_prompt: bool,
                  thinking: bool = True) -> str:  # fmt: skip
    """The kits' rendering (what core.js `renderChat`, Kotlin and Swift do): role prefix + content + suffix, a past
    assistant turn without its think block when the template drops it, then the generation prompt."""
    out = [pieces["start"]]
    for m in messages:
        content = m["content"]
        if m["role"] == "assistant" and pieces["drop_think"] and THINK_CLOSE in content:
            content = content.split(THINK_CLOSE)[-1].lstrip("\n")
        role = pieces["roles"][m["role"]]
        out += [role["prefix"], content, role["suffix"]]
    if add_generation_prompt:
        out.append(pieces["generation_prompt" if thinking else "generation_prompt_no_thinking"])
    return "".join(out)


def template_pieces(template: ChatTemplate, where: str = "the chat template") -> dict[str, Any]:
    """The template's pieces per role, checked against its own rendering; DeltashipError when it has no such form."""

    def render(msgs, gen=False, **kw):
        return template.render([dict(m) for m in msgs], gen, **kw)

    sys0, u1, a1, u2 = _sentinel("system", 0), _sentinel("user", 1), _sentinel("assistant", 1), _sentinel("user", 2)
    refuse = "export a checkpoint whose chat template is per-role (ChatML-style), or chat in Python (deltaship chat)"
    try:
        text = render([{"role": "system", "content": sys0}, {"role": "user", "content": u1},
                       {"role": "assistant", "content": a1}, {"role": "user", "content": u2}])  # fmt: skip
        alone = render([{"role": "user", "content": u1}])
        start = render([])  # what precedes every message (a BOS token in some templates)
        if not (alone.startswith(start) and text.startswith(start)):
            raise ValueError("the rendering of no messages is not where every rendering starts")
        user_suffix = alone[alone.index(u1) + len(u1) :]
        pieces = {
            "start": start,
            "roles": {
                "system": {"prefix": _between(text, None, sys0)[len(start) :], "suffix": ""},
                "user": {"prefix": "", "suffix": user_suffix},
                "assistant": {"prefix": "", "suffix": ""},
            },
        }
        user_prefix = alone[len(start) : alone.index(u1)]
        pieces["roles"]["user"]["prefix"] = user_prefix
        between_su = _between(text, sys0, u1)
        if not between_su.endswith(user_prefix):
            raise ValueError("the system message is not followed by the user turn's prefix")
        pieces["roles"]["system"]["suffix"] = between_su[: len(between_su) - len(user_prefix)]
        between_ua = _between(text, u1, a1)
        if not between_ua.startswith(user_suffix):
            raise ValueError("a user turn's suffix differs between renderings")
        pieces["roles"]["assistant"]["prefix"] = between_ua[len(user_suffix) :]
        between_au = _between(text, a1, u2)
        if not between_au.endswith(user_prefix):
            raise ValueError("an assistant turn is not followed by the user turn's prefix")
        pieces["roles"]["assistant"]["suffix"] = between_au[: len(between_au) - len(user_prefix)]
        base = render([{"role": "user", "content": u1}])
        pieces["generation_prompt"] = render([{"role": "user", "content": u1}], True)[len(base) :]
        pieces["generation_prompt_no_thinking"] = render([{"role": "user", "content": u1}], True,
                                                          enable_thinking=False)[len(base) :]  # fmt: skip
        thought = f"{THINK_OPEN}\nreasoning\n{THINK_CLOSE}\n\n{a1}"
        past = render([{"role": "user", "content": u1}, {"role": "assistant", "content": thought},
                       {"role": "user", "content": u2}])  # fmt: skip
        pieces["drop_think"] = THINK_OPEN not in past and a1 in past
    except TemplateRefused:
        raise
    except DeltashipError as e:
        raise DeltashipError(f"{where} cannot be split into per-role pieces: {e.message}", refuse) from None
    except ValueError as e:
        raise DeltashipError(f"{where} cannot be split into per-role pieces: {e}", refuse) from None
    _check(template, pieces, where, refuse)
    return pieces


def _check(template: ChatTemplate, pieces: dict[str, Any], where: str, refuse: str) -> None:
    """The pieces render what the template renders, for conversations a kit holds."""
    sysm = {"role": "system", "content": "Be brief.\nReally."}
    convs = []
    for system in ([], [sysm]):
        history = list(system)
        for i in range(3):
            history = [*history, {"role": "user", "content": f"question {i}\n"}]
            convs.append(history)
            reply = f"{THINK_OPEN}\nhm {i}\n{THINK_CLOSE}\n\nanswer {i}" if i == 1 else f"answer {i}"
            history = [*history, {"role": "assistant", "content": reply}]
    convs.append([sysm])
    for conv in convs:
        cases = [(False, True)] if conv[-1]["role"] != "user" else [(False, True), (True, True), (True, False)]
        for gen, thinking in cases:
            kw = {} if thinking else {"enable_thinking": False}
            want = template.render([dict(m) for m in conv], gen, **kw)
            got = render_pieces(pieces, conv, gen, thinking)
            if want != got:
                at = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
                roles = ", ".join(m["role"] for m in conv)
                raise DeltashipError(
                    f"{where} cannot be split into per-role pieces: for the conversation ({roles}) with "
                    f"add_generation_prompt={gen} the pieces render {got[at : at + 40]!r} at character {at} where "
                    f"the template renders {want[at : at + 40]!r}",
                    refuse,
                )


CHAT_RECORD = "chat.json"


def bundle_pieces(bundle, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """What a kit's chat needs from the bundle (chat.json): the template's per-role pieces, checked, and the prompt
    cache's record; None when the bundle carries no chat template (its kit generates, without chat)."""
    files = set(manifest.get("tokenizer", {}).get("files", []))
    if "tokenizer.json" not in files:
        return None
    try:
        source, special = bundle_chat_template(Path(bundle), manifest)
    except DeltashipError:
        if TEMPLATE_FILE in files:
            raise
        return None  # no template anywhere: a kit without chat
    template = ChatTemplate(source, where=template_file(Path(bundle), manifest), **special)
    pieces = template_pieces(template, f"{bundle}: the chat template")
    tokens = manifest.get("tokens", {})
    eos = tokens.get("eos") or []
    stop = sorted({*(eos if isinstance(eos, list) else [eos]), *([tokens["im_end"]] if "im_end" in tokens else [])})
    return {
        "pieces": pieces,
        "stop_ids": stop,
        "prompt_cache": manifest.get("chat", {}).get("prompt_cache"),
    }


# The pieces as the app kits' ChatPieces take them (Kotlin and Swift use these names, in this order), and where the
# pieces dict keeps each.
KIT_FIELDS = (
    ("start", ("start",)),
    ("systemPrefix", ("roles", "system", "prefix")),
    ("systemSuffix", ("roles", "system", "suffix")),
    ("userPrefix", ("roles", "user", "prefix")),
    ("userSuffix", ("roles", "user", "suffix")),
    ("assistantPrefix", ("roles", "assistant", "prefix")),
    ("assistantSuffix", ("roles", "assistant", "suffix")),
    ("generationPrompt", ("generation_prompt",)),
    ("generationPromptNoThinking", ("generation_prompt_no_thinking",)),
)


def kit_fields(pieces: dict[str, Any]) -> list[tuple[str, str]]:
    """(the kits' field name, its text) for each of KIT_FIELDS."""
    out = []
    for name, path in KIT_FIELDS:
        value: Any = pieces
        for k in path:
            value = value[k]
        out.append((name, value))
    return out

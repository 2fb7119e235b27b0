"""Multi-turn chat on a bundle's session, with O(1) turn checkpoints (docs/chat.md).

from deltaship.chat import Chat
chat = Chat("dist/tiny-onnx", system="Be brief.")
print(chat.send("Hello").text)
chat.retry(); chat.undo(); chat.save("talk.dschat")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaship.chat.conversation import Chat, Reply
from deltaship.runtimes.base import Session


def chat(
    session_or_bundle: Session | str | Path | Any,
    system: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> Chat:
    """A conversation on a session, a bundle directory, or what `deltaship.load(bundle)` returns (its `session`):
    what `deltaship.load(bundle).chat(...)` returns."""
    return Chat(session_or_bundle, system=system, template_kwargs=template_kwargs)


__all__ = ["Chat", "Reply", "chat"]

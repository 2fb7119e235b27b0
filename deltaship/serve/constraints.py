"""The one place where a request's output constraints are read: `response_format` and `tools`.

Constrained decoding (JSON schema / regex through llguidance) is being built in deltaship/constrain/; once it lands,
`constraint_for` returns its matcher for a request, and the engine applies it at each token (engine.Constraint:
mask the logits, advance with the token drawn). Until then a request that needs one is refused here, with a 400
saying so, rather than answered unconstrained.
"""

from __future__ import annotations

from typing import Any

from deltaship.serve.engine import Constraint
from deltaship.serve.errors import ApiError

PENDING = "is not supported yet by deltaship serve (it needs constrained decoding, which is not built yet)"


def constraint_for(request: dict[str, Any]) -> Constraint | None:
    """The constraint a chat or completion request asks for (None: free text)."""
    fmt = request.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else type(fmt).__name__
        raise ApiError(400, f"response_format {kind!r} {PENDING}", "response_format", "unsupported_parameter")
    for name in ("tools", "functions"):
        if request.get(name):
            raise ApiError(400, f"{name} {PENDING}", name, "unsupported_parameter")
    for name in ("tool_choice", "function_call"):
        if request.get(name) not in (None, "none"):
            raise ApiError(400, f"{name} {PENDING}", name, "unsupported_parameter")
    return None

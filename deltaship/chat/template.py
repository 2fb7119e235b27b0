"""The bundle's chat template, rendered with jinja2 in a sandbox (a bundle is untrusted input).

transformers renders `apply_chat_template` with jinja2 the same way (trim_blocks, lstrip_blocks, the loop
controls extension, `raise_exception`, `tojson`); this is that environment without transformers, sandboxed
(ImmutableSandboxedEnvironment: no attribute access to Python internals, no mutation of passed objects).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_BYTES = 1 << 20  # published templates are a few KiB
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def bundle_chat_template(bundle: Path, manifest: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The chat template a bundle carries (chat_template.jinja, else tokenizer_config.json's chat_template) and the
    special tokens transformers passes to it (bos_token, eos_token, ... from tokenizer_config.json).

    Every path under the bundle this module reads goes through here."""
    files = set(manifest.get("tokenizer", {}).get("files", []))
    bundle = Path(bundle)

    def read(name: str) -> str | None:
        return _read_text(bundle_path(bundle, manifest, name, "tokenizer.files")) if name in files else None

    return _template_of(read, bundle, "export the bundle again")


def source_chat_template(files: list[Path]) -> tuple[str, dict[str, str]]:
    """The chat template of a checkpoint's tokenizer files (ModelSource.tokenizer_files), as bundle_chat_template
    will read it in a bundle exported from them (export copies them as they are)."""
    by_name = {f.name: f for f in files}
    where = files[0].parent if files else Path(".")
    return _template_of(lambda name: _read_text(by_name[name]) if name in by_name else None, where, "fix the file")


def _template_of(read, where: Path, fix: str) -> tuple[str, dict[str, str]]:
    """The template and special tokens from the tokenizer files `read(name)` gives (None: not there)."""
    config: dict[str, Any] = {}
    text = read(CONFIG_FILE)
    if text is not None:
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as e:
            raise DeltashipError(f"{where / CONFIG_FILE}: not JSON ({e})", fix) from None
        config = loaded if isinstance(loaded, dict) else {}
    tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS if _token_text(config.get(k)) is not None}
    template = read(TEMPLATE_FILE)
    if template is not None:
        return template, tokens
    template = config.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: the one named "default"
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if isinstance(template, str) and template:
        return template, tokens
    raise DeltashipError(
        f"{where}: the tokenizer files carry no chat template (no {TEMPLATE_FILE}, no chat_template in {CONFIG_FILE})",
        "export a checkpoint that has one (instruction-tuned Qwen3.5 checkpoints do), or pass template= to Chat",
    )


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json holds it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise DeltashipError(f"{path}: listed in the manifest but missing", "export the bundle again")
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise DeltashipError(
            f"{path}: {path.stat().st_size} bytes, over the {MAX_TEMPLATE_BYTES} a tokenizer file may have here",
            "check the bundle's tokenizer files",
        )
    return path.read_text(encoding="utf-8")


class ChatTemplate:
    """A compiled chat template: render(messages, add_generation_prompt, **kwargs) -> text."""

    def __init__(self, source: str, **defaults: Any):
        """defaults: variables every render gets (the special tokens), under the caller's keyword arguments."""
        from jinja2 import TemplateError  # lazy: jinja2: chat templates only
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazy: jinja2: chat templates only

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise DeltashipError(
                f"the chat template does not compile: {e}", "check the bundle's chat template"
            ) from None
        self.source = source
        self.defaults = defaults

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        from jinja2 import TemplateError  # lazy: jinja2: chat templates only

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **{**self.defaults, **kwargs}
            )
        except DeltashipError:
            raise
        except (TemplateError, TypeError, ValueError, AttributeError) as e:
            raise DeltashipError(f"the chat template failed to render: {e}", "check the messages' roles") from None


def _raise(message: str) -> None:
    raise DeltashipError(f"the chat template refused the conversation: {message}", "check the messages' roles")

"""The bundle's chat template, rendered with jinja2 in a sandbox (a bundle is untrusted input).

transformers renders `apply_chat_template` with jinja2 the same way (trim_blocks, lstrip_blocks, the loop
controls extension, `raise_exception`, `tojson`); this is that environment without transformers, sandboxed
(ImmutableSandboxedEnvironment: no attribute access to Python internals, no mutation of passed objects) and bounded
(_BoundedEnvironment): a render has a time budget, an output cap, a call-depth cap (recursive macros), and `range`,
string / list repetition and concatenation, big powers and the filters' results are capped. The time budget is
checked at every call, operator and range step, and on the main thread also by an interval timer, so a loop that
does none of those is stopped too; a violation is one DeltashipError naming the template's file.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError
from deltaship.files import parse_json

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_BYTES = 1 << 20  # published templates are a few KiB
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# A render's bounds. A prompt is at most the context (262144 tokens at the largest Qwen3.5, ~1 MiB of text), and a
# published template renders it in milliseconds; these leave room for both and stop a hostile one early.
TIME_BUDGET_S = 2.0
MAX_OUTPUT_CHARS = 4 << 20  # the rendering, and any string or list one operation of the template builds
MAX_BUILT_CHARS = 8 * MAX_OUTPUT_CHARS  # all that a render's operations and {{ }} outputs build, macros' included
MAX_CALL_DEPTH = 64  # nested calls (macros calling macros)
MAX_RANGE = 100_000  # one range(), as jinja2's own sandbox caps it
MAX_INT_BITS = 4096  # an integer a template computes (10 ** 10 ** 10 would take forever)


def template_file(bundle: Path, manifest: dict[str, Any]) -> Path:
    """The file a bundle's chat template is read from (what its errors name)."""
    files = set(manifest.get("tokenizer", {}).get("files", []))
    return Path(bundle) / (TEMPLATE_FILE if TEMPLATE_FILE in files else CONFIG_FILE)


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
        loaded = parse_json(text, str(where / CONFIG_FILE), "tokenizer config", fix)
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

    def __init__(self, source: str, *, where: str | Path = "the chat template", **defaults: Any):
        """where: the template's file, named in its errors; defaults: variables every render gets (the special
        tokens), under the caller's keyword arguments."""
        from jinja2 import TemplateError  # lazy: jinja2: chat templates only

        self.where = str(where)
        env = _bounded_environment(self.where)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise DeltashipError(f"{self.where}: the chat template does not compile: {e}", _FIX) from None
        except RecursionError:
            raise DeltashipError(f"{self.where}: the chat template nests too deeply to compile", _FIX) from None
        self._env = env
        self.source = source
        self.defaults = defaults

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any) -> str:
        from jinja2 import TemplateError  # lazy: jinja2: chat templates only

        env, parts, size = self._env, [], 0
        try:
            with env.budget.running():
                for piece in self._template.generate(
                    messages=messages, add_generation_prompt=add_generation_prompt, **{**self.defaults, **kwargs}
                ):
                    size += len(piece)
                    env.budget.tick()
                    if size > MAX_OUTPUT_CHARS:
                        env.budget.refuse(f"renders more than {MAX_OUTPUT_CHARS} characters")
                    parts.append(piece)
        except DeltashipError:
            raise
        except RecursionError:
            env.budget.refuse(f"nests calls deeper than Python allows (a recursive macro; the cap is {MAX_CALL_DEPTH})")
        except MemoryError:
            env.budget.refuse("ran out of memory while rendering")
        except (TemplateError, TypeError, ValueError, AttributeError, ArithmeticError, LookupError) as e:
            what = f"{self.where}: the chat template failed to render: {e}"
            raise DeltashipError(what, "check the messages' roles") from None
        text = "".join(parts)
        if messages and not text.strip():
            raise TemplateRefused(
                f"{self.where}: the chat template renders a conversation of {len(messages)} message(s) to nothing",
                _FIX,
            )
        return text


_FIX = "check the bundle's chat template (or pass template= to Chat)"


class TemplateRefused(DeltashipError):
    """A template past its render bounds (or rendering a conversation to nothing): the template is at fault,
    not the conversation."""


class _Budget:
    """One render's time and call-depth budget; refuse() raises the error that names the template."""

    def __init__(self, where: str):
        self.where, self.deadline, self.depth, self.built = where, float("inf"), 0, 0

    def refuse(self, what: str):
        raise TemplateRefused(
            f"{self.where}: the chat template {what}; refused (a render may take {TIME_BUDGET_S:g} s, "
            f"{MAX_OUTPUT_CHARS} characters and {MAX_CALL_DEPTH} nested calls)",
            _FIX,
        )

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            self.refuse(f"took more than {TIME_BUDGET_S:g} s to render")

    def built_value(self, value: Any) -> Any:
        """Count what an operation built (a macro's buffer holds every output of its body) against the caps."""
        n = _sized(value)
        self.built += n
        if n > MAX_OUTPUT_CHARS or self.built > MAX_BUILT_CHARS:
            self.refuse(f"builds more than {MAX_OUTPUT_CHARS} items in one value or {MAX_BUILT_CHARS} in all")
        return value

    def running(self):
        return _Running(self)


class _Running:
    """The budget's clock for one render; on the main thread an interval timer raises at the deadline too (a loop
    over a string calls no hook), and is cancelled (the previous handler back) when the render ends."""

    def __init__(self, budget: _Budget):
        self.budget, self.old = budget, None

    def __enter__(self):
        self.start = time.monotonic()
        self.budget.deadline, self.budget.depth, self.budget.built = self.start + TIME_BUDGET_S, 0, 0
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            budget = self.budget

            def alarm(signum, frame):
                budget.refuse(f"took more than {TIME_BUDGET_S:g} s to render")

            self.old = signal.signal(signal.SIGALRM, alarm)
            self.timer = signal.setitimer(signal.ITIMER_REAL, TIME_BUDGET_S + 0.25)
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
            if self.timer[0] > 0:  # a caller's timer: put back what was left of it
                signal.setitimer(signal.ITIMER_REAL, max(self.timer[0] - (time.monotonic() - self.start), 1e-3),
                                 self.timer[1])  # fmt: skip
        self.budget.deadline = float("inf")


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _bounded_environment(where: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazy: jinja2: chat templates only

    class _BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

        def call_binop(self, context, operator, left, right):
            self.budget.tick()
            if operator == "*":
                n = right if isinstance(left, (str, list, tuple)) else left
                if isinstance(n, int) and max(_sized(left), _sized(right)) * max(n, 0) > MAX_OUTPUT_CHARS:
                    self.budget.refuse(f"repeats a string or list past {MAX_OUTPUT_CHARS} items")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right > 0 and right * abs(left).bit_length() > MAX_INT_BITS:
                    self.budget.refuse(f"computes a power past {MAX_INT_BITS} bits")
            if operator == "%" and isinstance(left, str):  # "%*d" % (10**9, 1), "%999999999d" % 1
                _check_format(self.budget, left, right if isinstance(right, tuple) else (right,), {})
            result = super().call_binop(context, operator, left, right)
            if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
                self.budget.refuse(f"computes a number past {MAX_INT_BITS} bits")
            return self.budget.built_value(result)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  # jinja2's own signature
            budget = __self.budget
            budget.tick()
            if budget.depth >= MAX_CALL_DEPTH:
                budget.refuse(f"nests calls deeper than {MAX_CALL_DEPTH} (a recursive macro)")
            if _format_of(__obj) is not None:
                _check_format(budget, _format_of(__obj), args, kwargs)  # "{:>999999999}".format(1)
            budget.depth += 1
            try:
                result = super().call(__context, __obj, *args, **kwargs)
            finally:
                budget.depth -= 1
            return budget.built_value(result)

    budget = _Budget(where)
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], finalize=budget.built_value
    )
    env.budget = budget
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(f, budget)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def bounded_range(*args: Any) -> _Range:
        r = range(*args)
        if len(r) > MAX_RANGE:
            budget.refuse(f"asks for a range of {len(r)} numbers (at most {MAX_RANGE})")
        return _Range(r, budget)

    env.globals["range"] = bounded_range
    return env


class _Range:
    """range() for a template: a sequence (len, index, reversed) whose iteration checks the budget at each step."""

    def __init__(self, r: range, budget: _Budget):
        self._r, self._budget = r, budget

    def __len__(self) -> int:
        return len(self._r)

    def __getitem__(self, i):
        item = self._r[i]
        return _Range(item, self._budget) if isinstance(item, range) else item

    def __iter__(self):
        for i in self._r:
            self._budget.tick()
            yield i

    def __reversed__(self):
        return iter(_Range(self._r[::-1], self._budget))


def _format_of(obj: Any) -> str | None:
    """The format string of a bound str.format / str.format_map (as the sandbox wraps it), else None."""
    obj = getattr(obj, "__wrapped__", obj)
    if getattr(obj, "__name__", None) in ("format", "format_map") and isinstance(getattr(obj, "__self__", None), str):
        return obj.__self__
    return None


def _check_format(budget: _Budget, fmt: str, args: tuple, kwargs: dict) -> None:
    """A format's widths (in its text or passed as numbers) within the output cap: they are allocated whole."""
    import re

    widths = [int(d) for d in re.findall(r"\d{7,}", fmt)]
    widths += [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    if any(abs(w) > MAX_OUTPUT_CHARS for w in widths):
        budget.refuse("formats a field wider than its output cap")


def _bounded_filter(f, budget: _Budget):
    """A filter whose integer arguments (widths, counts) and result are held to the output cap."""
    from functools import wraps

    @wraps(f)
    def bounded(*args: Any, **kwargs: Any):
        budget.tick()
        if any(isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_OUTPUT_CHARS
               for a in (*args, *kwargs.values())):  # fmt: skip
            budget.refuse("passes a filter a width or count past its output cap")
        return budget.built_value(f(*args, **kwargs))

    return bounded


def _raise(message: str) -> None:
    raise DeltashipError(f"the chat template refused the conversation: {message}", "check the messages' roles")

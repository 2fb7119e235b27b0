"""What `deltaship.load()` returns: a bundle's runtime session that is also a transformers causal LM, on demand.

Opening a bundle needs only its runtime (onnxruntime for ONNX) and, for text, `tokenizers`: `load()` and
`generate("text")` import neither torch nor transformers. The first use of the transformers side (`generate(**
tokenizer(..., return_tensors="pt"))`, `pipeline(...)`, `model(input_ids)`, `config`, ...) builds a
`DeltashipModelForCausalLM` over the same session (importing torch and transformers then) and hands the call to it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from deltaship.chat import Chat
from deltaship.constrain import build_constraint, token_table
from deltaship.errors import DeltashipError
from deltaship.options import seed as seed_option
from deltaship.runtimes.base import check_sampling
from deltaship.runtimes.tokenizer import load_tokenizer


class BundleModel:
    """A bundle opened for generation: `generate(text or ids)` runs on the session alone; every other attribute,
    and `generate` with tensors, is the transformers model's (`hf`), built on first use.

    Once transformers is imported it reports `DeltashipModelForCausalLM` as its class (building it), so
    transformers' pipelines (which check `isinstance(model, PreTrainedModel)`) take it as the model it stands for.
    """

    def __init__(self, session: Any, bundle: Path):
        self.session = session
        self.bundle = bundle
        self._hf: Any = None
        self._tokenizer: Any = None

    @property
    def manifest(self) -> dict[str, Any]:
        return self.session.manifest

    @property
    def hf(self) -> Any:
        """The transformers model (`DeltashipModelForCausalLM`) over this session; imports torch."""
        if self._hf is None:
            from deltaship.hf.modeling import DeltashipModelForCausalLM  # lazy: transformers

            self._hf = DeltashipModelForCausalLM.over_session(self.session, self.bundle)
        return self._hf

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105 - isinstance() asks this; see the class docstring
        # only once transformers is in use: an isinstance() check in a torch-free program must not import torch
        return type(self.hf) if "transformers" in sys.modules else BundleModel

    def chat(self, system: str | None = None, template_kwargs: dict[str, Any] | None = None) -> Any:
        """A multi-turn conversation on this bundle's session (`deltaship.chat.Chat`: send, retry, undo, save)."""

        return Chat(self.session, system=system, template_kwargs=template_kwargs)

    def generate(self, prompt: Any = None, /, *args: Any, **kwargs: Any) -> Any:
        """`generate("def f(", max_new_tokens=16)` -> the new text; `generate([ids...], ...)` -> the new token ids.

        Options: max_new_tokens (32), temperature (0: greedy), top_k, top_p, seed, stop_at_eos (True), and at most
        one constraint: json_schema (a dict or a file), regex (a pattern), grammar (a file; docs/agents.md). Anything
        else (tensors, `**tokenizer(..., return_tensors="pt")`, a GenerationConfig) is transformers'
        `GenerationMixin.generate` on `hf`."""
        check_prompt(prompt)  # bytes, a number, a list of non-ids: refused here, not deep inside transformers
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            return self.hf.generate(prompt, *args, **kwargs) if prompt is not None else self.hf.generate(**kwargs)
        if args:
            raise DeltashipError(
                "generate(prompt, ...) takes its options by keyword", "e.g. generate('def f(', max_new_tokens=16)"
            )

        options = {"max_new_tokens": 32, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None}
        constraint = build_constraint(*(kwargs.pop(k, None) for k in ("json_schema", "regex", "grammar")))
        unknown = sorted(set(kwargs) - set(options) - {"stop_at_eos"})
        if unknown:
            raise DeltashipError(
                f"generate(text or ids) does not take {', '.join(unknown)}",
                f"pass only {', '.join([*options, 'stop_at_eos'])}, or call generate(**tokenizer(text, "
                "return_tensors='pt'), ...) for transformers' generate()",
            )
        options.update((k, v) for k, v in kwargs.items() if k in options)
        if not isinstance(kwargs.get("stop_at_eos", True), bool):
            raise DeltashipError(f"stop_at_eos must be True or False, got {kwargs['stop_at_eos']!r}", "pass a bool")
        seed_option(options["seed"])
        check_sampling(options["max_new_tokens"], options["temperature"], options["top_k"], options["top_p"])
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        guide = None
        if constraint is not None:
            table = token_table(self.tokenizer.json_text, self.session.vocab_size, sorted(self.session.eos_ids))
            guide = constraint.guide(table)
        self.session.reset()
        self._hf_cache_stale()
        out = self.session.generate(
            ids,
            options["max_new_tokens"],
            stop_at_eos=kwargs.get("stop_at_eos", True),
            temperature=options["temperature"],
            top_k=options["top_k"],
            top_p=options["top_p"],
            seed=options["seed"],
            **({"guide": guide} if guide is not None else {}),
        )
        return self.tokenizer.decode(out.output_ids) if isinstance(prompt, str) else list(out.output_ids)

    @property
    def tokenizer(self) -> Any:
        """The bundle's tokenizer (`tokenizers`, no transformers): encode(text) -> ids, decode(ids) -> text."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.bundle, self.manifest)
        return self._tokenizer

    def _hf_cache_stale(self) -> None:
        if self._hf is not None:  # the session moved on: a cache the transformers side returned earlier is replayed
            self._hf._latest = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_hf", "_tokenizer", "session", "bundle"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __repr__(self) -> str:
        return f"<deltaship model {self.bundle} ({self.manifest['target']}, {self.manifest['precision']})>"


def check_prompt(prompt: Any) -> None:
    """Refuse a prompt that is neither text, a list of token ids, nor what transformers' generate() takes (a
    tensor, an array, or nothing with keyword tensors), naming the argument and its type."""
    ids = isinstance(prompt, (list, tuple))
    if ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        if isinstance(prompt, list):
            return
    if ids or isinstance(prompt, (bytes, bytearray, memoryview, bool, int, float, complex, dict, set, frozenset)):
        raise DeltashipError(
            f"generate(prompt): prompt must be text or a list of token ids (ints >= 0), got {type(prompt).__name__}"
            + (f" {prompt!r}"[:80] if not isinstance(prompt, (bytes, bytearray, memoryview)) else ""),
            "pass a str (e.g. generate('def f(')) or a list of ints (generate([1, 2, 3]))",
        )

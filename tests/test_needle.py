"""A needle-style retrieval check on the trained tiny model, fp32 KV cache against int8 and int4.

The tiny model was trained on Python source in 256-byte windows (tools/train_tiny.py), so the needle is Python:
`token = "<8 random letters>"`, then held-out Python source as filler, then `assert token == "`; the model must
copy the 8 letters back (teacher-forced: the first letter from the prompt alone, the next 7 each given the true
letters before it). Chance is 1/26 a letter. Measured (24 trials each, docs/results/longctx.md): the fp32-KV
bundle copies at filler distances inside its training window and not past it; int8 and int4 KV copy as well as
fp32 where fp32 can. This asserts what it can do: distances of 32 and 128 bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

CTX = 512
DISTANCES = (32, 128)
TRIALS = 16


@pytest.fixture(scope="module")
def tiny_kv_bundles(tmp_path_factory):
    from deltaship.compile import export

    root = tmp_path_factory.mktemp("needle")
    for kv in ("fp32", "int8", "int4"):
        export("qwen3.5-tiny", root / kv, target="onnx", max_context=CTX, kv_cache=kv, verify=False, progress=False)
    return root


def needle_cases(distance: int, trials: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, needle ids) pairs: the needle, `distance` bytes of held-out Python, the question."""
    from tokenizers import Tokenizer

    from deltaship.check.evaluate import HELDOUT
    from deltaship.models.trained import DATA

    text = HELDOUT.read_text(encoding="utf-8", errors="replace")
    tok = Tokenizer.from_file(str(DATA / "qwen3.5-tiny" / "tokenizer.json"))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        key = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 8))
        start = int(rng.integers(0, len(text) - 20000))
        prompt = f'token = "{key}"\n' + text[start : start + distance] + '\nassert token == "'
        out.append((tok.encode(prompt).ids, tok.encode(key).ids))
    return out


def retrieval(session, cases) -> tuple[float, float]:
    """(first letter top-1, later letters top-1), teacher-forced greedy over the cases."""
    first, rest = [], []
    for ids, key in cases:
        session.reset()
        logits = session.prefill(ids)
        hits = []
        for k in key:
            hits.append(int(np.argmax(logits)) == k)
            logits = session.decode(k)
        first.append(hits[0])
        rest.append(np.mean(hits[1:]))
    return float(np.mean(first)), float(np.mean(rest))


@pytest.mark.slow  # three exports and ~500 decode steps
def test_needle_retrieval_survives_the_quantized_kv_cache(tiny_kv_bundles):
    from deltaship.targets import open_bundle

    for distance in DISTANCES:
        cases = needle_cases(distance, TRIALS)
        got = {
            kv: retrieval(open_bundle(tiny_kv_bundles / kv, threads=1, check_hashes=False), cases)
            for kv in ("fp32", "int8", "int4")
        }
        first, rest = got["fp32"]
        assert rest > 0.25 and first > 0.1, (distance, got)  # far above chance (1/26): the model copies
        for kv in ("int8", "int4"):
            assert abs(got[kv][1] - rest) <= 0.1 and abs(got[kv][0] - first) <= 0.2, (distance, kv, got)

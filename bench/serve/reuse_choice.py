"""How a server should hold many conversations on one bundle: a session per conversation, or one shared session
with each conversation's states copied out and back in (docs/serve.md#state-reuse). Measures, on one bundle:
opening a session (what a session per conversation pays once, and holds: its weights and whole-length KV caches),
copying a conversation's states out and back in at a prefix of P tokens, and re-prefilling those P tokens.

    python bench/serve/reuse_choice.py BUNDLE [--tokens 64 256]
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from deltaship.targets import open_bundle


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    before = rss_mib()
    t = time.perf_counter()
    s = open_bundle(a.bundle)
    open_s = time.perf_counter() - t
    s.prefill([1, 2, 3])
    after_one = rss_mib()
    t = time.perf_counter()
    s2 = open_bundle(a.bundle)
    s2.prefill([1, 2, 3])
    second_open_s = time.perf_counter() - t
    print(
        f"open_bundle: first {open_s * 1e3:.1f} ms, second {second_open_s * 1e3:.1f} ms; "
        f"max RSS after one session {after_one - before:.1f} MiB over the start, after two {rss_mib() - before:.1f}"
    )
    rng = np.random.default_rng(0)
    for p in a.tokens:
        ids = rng.integers(0, s.vocab_size, p).tolist()
        prefill, out, back = [], [], []
        for _ in range(a.repeat):
            s.reset()
            t = time.perf_counter()
            s.prefill(ids)
            prefill.append(time.perf_counter() - t)
            t = time.perf_counter()
            arrays = s.state_file_arrays()
            out.append(time.perf_counter() - t)
            s.reset()
            t = time.perf_counter()
            s.load_state_file_arrays(p, arrays)
            back.append(time.perf_counter() - t)
        held = sum(v.nbytes for v in arrays.values())
        print(
            f"P={p}: re-prefill {np.median(prefill) * 1e3:.2f} ms; copy out {np.median(out) * 1e3:.2f} ms, "
            f"back in {np.median(back) * 1e3:.2f} ms; held {held / 2**20:.2f} MiB"
        )


if __name__ == "__main__":
    main()

"""Speculative decoding with a bundle's draft head (`speculative` block of the manifest), for any runtime.

A session that supports it (`SpeculativeSession`) adds to the plain prefill/decode calls:
- `verify(ids, rows)`: run ids [T] at the session's position like a prefill chunk, returning the logits after
  each of `rows` and the final-normed hidden state of every position (the draft head's input);
- `snapshot()` / `restore(snap)`: keep the DeltaNet states and the position from before the next verify call
  (a copy, or, on ONNX, the buffers that verify call leaves untouched), and undo that call. The KV caches are not
  copied: a restored session overwrites the rejected positions on its next call (their length pointer is the
  position);
- `draft(hidden, ids, position)`: the MTP head over hidden [T, H] at positions position .. position+T-1 and the
  tokens one position later, returning the logits of the token after the last one and the head's hidden states;
  the logits are over the draft vocabulary: every token id, or, in a bundle exported with --mtp-draft-vocab N, the
  N ids of `draft_token_ids()` (draft index i is token ids[i]);
- `reset_draft()`: zero the head's own KV cache;
- optionally `can_rollback_to_first()` / `rollback_to_first()` (ONNX bundles whose calls also output each DeltaNet
  state as it was after the call's first token): right after a verify call, make the session's states those after
  its first token (no call, no copy).

The driver keeps the lossless contract: every emitted token is chosen from the decoder's own logits (greedy:
its argmax; sampling: the standard accept/reject rule of Leviathan et al. / Chen et al., so the output
distribution is the decoder's). Rollback: when a verify call fed the newest token and its drafts and the first
draft is rejected (at depth 1, every rejection), a session that can `rollback_to_first` keeps the states after the
call's first token. Otherwise by snapshot: a verify call whose drafts are not all accepted is undone and its
accepted tokens are fed again at the start of the next verify call, which costs no extra call (the verify chunk is
just longer); after `MAX_PENDING` such tokens they are committed with a call of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError
from deltaship.files import read_json
from deltaship.runtimes.base import Generation, Session, TokenGuide, check_sampling, masked, probabilities


@runtime_checkable
class SpeculativeSession(Protocol):
    def verify(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def snapshot(self) -> Any: ...

    def restore(self, snap: Any) -> None: ...

    def draft(self, hidden: np.ndarray, ids: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]: ...

    def reset_draft(self) -> None: ...


@dataclass
class SpeculativeStats:
    depth: int
    verify_calls: int = 0
    draft_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    commit_calls: int = 0  # extra calls that committed re-fed tokens (see MAX_PENDING)
    rollbacks: int = 0  # rejections undone by rollback_to_first (the rest by restoring a snapshot)
    disallowed: int = 0  # drafts cut because the constraint does not allow them (the first such ends the run)
    emitted_per_verify: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        n = max(self.verify_calls, 1)
        return {
            "method": "mtp",
            "depth": self.depth,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "mean_accepted_length": round(self.accepted / n, 4),  # drafts accepted per verify call
            "tokens_per_verify": round(sum(self.emitted_per_verify) / n, 4),  # accepted + the decoder's own token
            "verify_calls": self.verify_calls,
            "draft_calls": self.draft_calls,
            "commit_calls": self.commit_calls,
            "first_token_rollbacks": self.rollbacks,
            "drafts_disallowed": self.disallowed,
        }


def parse_speculative(value: str | None) -> int | None:
    """`mtp` or `mtp:K` -> K (draft depth, default 1); None -> None."""
    if value is None:
        return None
    method, _, depth = value.partition(":")
    if method != "mtp":
        raise DeltashipError(
            f"--speculative {value!r}: unknown method {method!r}; methods: mtp", "pass --speculative mtp or mtp:K"
        )
    try:
        k = int(depth) if depth else 1
    except ValueError:
        k = 0
    if not 1 <= k <= 8:
        raise DeltashipError(
            f"--speculative {value!r}: the draft depth must be an integer from 1 to 8", "pass e.g. mtp or mtp:2"
        )
    return k


def require_head(bundle: Any, manifest: dict[str, Any]) -> None:
    """The bundle must carry a draft head (the manifest's `speculative` block), or say which export option adds it
    (a target whose exports cannot take --mtp refuses the flag itself, naming the targets that do)."""
    if manifest.get("speculative"):
        return
    raise DeltashipError(
        f"{bundle}: this bundle has no multi-token-prediction head, so --speculative mtp has nothing to draft with",
        f"export it again with --mtp (deltaship export --model ... --target {manifest['target']} --mtp); the "
        "checkpoint must ship its mtp.* tensors (qwen3.5-tiny and the published-shape presets do)",
    )


def require_speculative(session: Session) -> None:
    """The bundle must carry a draft head and the session must drive it, or say which export option adds it."""
    require_head(session.bundle, session.manifest)
    if not isinstance(session, SpeculativeSession):
        raise DeltashipError(
            f"the {session.runtime_name()} session cannot drive speculative decoding yet",
            "drop --speculative, or use deltaship's own runtime for this target (no --runtime)",
        )


def rolls_back_to_first(session: Any) -> bool:
    """Whether the session can undo a verify call down to its first token (the optional `rollback_to_first`)."""
    can = getattr(session, "can_rollback_to_first", None)
    return callable(can) and bool(can())


def draft_token_ids(bundle: str | Path, manifest: dict[str, Any]) -> np.ndarray | None:
    """The token ids the draft head's logits cover (int64 [N], from the bundle's `speculative.draft.vocab` file), or
    None when they cover the whole vocabulary (bundles exported without --mtp-draft-vocab)."""
    vocab = manifest["speculative"]["draft"].get("vocab")
    if not vocab:
        return None
    path = bundle_path(bundle, manifest, vocab["file"], "speculative.draft.vocab.file")
    fix = "export the bundle again (its files are incomplete)"
    try:
        ids = np.asarray(read_json(path, "draft vocabulary", fix)["ids"], np.int64)
    except (TypeError, ValueError, KeyError) as e:
        raise DeltashipError(
            f"{path}: cannot read the draft vocabulary ({e})", "export the bundle again (its files are incomplete)"
        ) from None
    if ids.size != vocab["size"] or ids.size == 0 or ids.min() < 0 or ids.max() >= manifest["model"]["vocab_size"]:
        raise DeltashipError(
            f"{path}: {ids.size} draft token ids, but the manifest says {vocab['size']} within a vocabulary of "
            f"{manifest['model']['vocab_size']}",
            "export the bundle again",
        )
    return ids


def _scatter(q: np.ndarray, ids: np.ndarray | None, vocab: int) -> np.ndarray:
    """A draft distribution over the draft vocabulary as one over every token id (zero outside the subset)."""
    if ids is None:
        return q
    out = np.zeros(vocab, q.dtype)
    out[ids] = q
    return out


MAX_PENDING = 8  # re-fed tokens allowed to ride along with the next verify call before they get a call of their own


def accept_or_resample(p: np.ndarray, q: np.ndarray, d: int, rng: np.random.Generator) -> int | None:
    """The standard speculative-sampling step: keep draft d (drawn from q) with probability min(1, p[d]/q[d]),
    returning None; otherwise return a token drawn from the residual max(0, p - q), normalised. The token that
    comes out (d or the replacement) is distributed exactly as p."""
    if rng.random() < min(1.0, p[d] / q[d]):
        return None
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    return int(rng.choice(p.size, p=residual / total)) if total > 0 else int(rng.choice(p.size, p=p))


def generate_speculative(
    session: Session,
    ids: Sequence[int],
    max_new_tokens: int,
    depth: int = 1,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_at_eos: bool = True,
    on_token: Callable[[int], None] | None = None,
    guide: TokenGuide | None = None,
) -> tuple[Generation, SpeculativeStats]:
    """Prefill `ids`, then produce up to max_new_tokens with `depth` drafts per verify call.

    With a guide (deltaship.constrain) the drafts are checked against it before the verify call (the first one it
    does not allow ends the run: it and the drafts after it are not verified) and every row the decoder's token is
    chosen from is masked at the state after the tokens before it, so the output is the non-speculative
    constrained decoding's (greedy: the same tokens; sampling: the same distribution)."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    require_speculative(session)
    s: Any = session
    rng = np.random.default_rng(seed)
    greedy = temperature <= 0
    stats = SpeculativeStats(depth)
    draft_ids = draft_token_ids(session.bundle, session.manifest)  # draft index -> token id (None: the same)
    rolls_back = rolls_back_to_first(session)
    session.reset()  # a fresh sequence: the draft head's cache must see every position the decoder sees
    s.reset_draft()
    prompt = session._check([int(i) for i in ids])
    gen = Generation(input_ids=prompt.tolist(), output_ids=[])
    # prefill: the hidden states of every prompt position feed the draft head
    hidden: list[np.ndarray] = []
    logits = None
    start = 0
    for size in session._chunks(prompt.size):
        rows_logits, h = s.verify(prompt[start : start + size], np.array([size - 1], np.int64))
        logits = rows_logits[-1]
        hidden.extend(h)
        session.position += size
        start += size
    if max_new_tokens == 0:
        return gen, stats

    def pick(row: np.ndarray) -> int:
        row = masked(row, guide)
        if greedy:
            return int(np.argmax(row))
        p = probabilities(row, temperature, top_k, top_p)
        return int(rng.choice(p.size, p=p))

    done_after: list[bool] = []  # per output token, in the order they are consumed and emitted: the guide's done()

    def consume(tok: int) -> int:
        if guide is not None:
            guide.advance(tok)
        done_after.append(guide is not None and guide.done())
        return tok

    tokens = prompt.tolist() + [consume(pick(logits))]
    committed = prompt.size  # tokens the decoder's state holds (== session.position)
    drafted_upto = 0  # the draft head's KV cache holds positions < drafted_upto
    emitted = 1

    def emit(tok: int) -> bool:
        """Record one output token (the guide already consumed it); True when generation must stop."""
        gen.output_ids.append(tok)
        if on_token:
            on_token(tok)
        if stop_at_eos and tok in session.eos_ids:
            gen.stopped = "eos"
            return True
        if done_after[len(gen.output_ids) - 1] and (tok in session.eos_ids or not session.eos_ids):
            gen.stopped = "eos" if tok in session.eos_ids else "constraint"
            return True
        return len(gen.output_ids) >= max_new_tokens

    if emit(tokens[-1]):
        return gen, stats
    while True:
        n = len(tokens)  # tokens[n-1] is the newest; hidden states are known for positions < n-1
        if n > session.max_context:
            gen.stopped = "context"
            return gen, stats
        k = min(depth, session.max_context - n, max_new_tokens - len(gen.output_ids))
        drafts: list[int] = []
        draft_probs: list[np.ndarray] = []
        if k > 0:
            # the head over positions drafted_upto .. n-2, then deeper on its own hidden state and draft
            h = np.stack(hidden[drafted_upto : n - 1])
            d_logits, d_hidden = s.draft(h, np.asarray(tokens[drafted_upto + 1 : n], np.int64), drafted_upto)
            stats.draft_calls += 1
            for i in range(k):
                if greedy:
                    j = int(np.argmax(d_logits))
                else:
                    q = probabilities(d_logits, temperature, top_k, top_p)
                    draft_probs.append(q)
                    j = int(rng.choice(q.size, p=q))
                drafts.append(j if draft_ids is None else int(draft_ids[j]))
                if i + 1 < k:
                    d_logits, d_hidden = s.draft(d_hidden[-1:], np.asarray(drafts[-1:], np.int64), n - 1 + i)
                    stats.draft_calls += 1
            drafted_upto = n - 1
            if guide is not None:  # the first draft the constraint does not allow ends the run
                ok = guide.valid_prefix(drafts)
                stats.disallowed += len(drafts) - ok
                del drafts[ok:], draft_probs[ok:]
        # verify the pending tokens and the drafts in one call, every row's logits back
        feed = np.asarray(tokens[committed:] + drafts, np.int64)
        # a snapshot, unless every rejection this call can have leaves only its first token (the newest one, and
        # one draft) and rollback_to_first undoes it
        snap = s.snapshot() if drafts and not (rolls_back and feed.size == 2) else None
        rows_logits, h = s.verify(feed, np.arange(feed.size, dtype=np.int64))
        stats.verify_calls += 1
        stats.drafted += len(drafts)
        base = n - 1 - committed  # the row whose logits choose the token at position n
        accepted, new = 0, None
        for i, d in enumerate(drafts):
            row = masked(rows_logits[base + i], guide)  # at the state after the drafts accepted before it
            if greedy:
                t = int(np.argmax(row))
                if t == d:
                    accepted += 1
                    consume(d)
                    continue
                new = t
            else:
                q = _scatter(draft_probs[i], draft_ids, row.size)  # zero outside the draft vocabulary: still exact
                new = accept_or_resample(probabilities(row, temperature, top_k, top_p), q, d, rng)
                if new is None:
                    accepted += 1
                    consume(d)
                    continue
            break
        if new is None:  # every draft accepted: the decoder's next token comes free
            new = pick(rows_logits[base + len(drafts)])
        consume(new)
        stats.accepted += accepted
        stats.emitted_per_verify.append(accepted + 1)
        # hidden states of the positions whose tokens are now known to be right
        known = n - committed + accepted  # rows of this call fed with accepted tokens
        del hidden[committed:]
        hidden.extend(h[:known])
        if accepted == len(drafts):
            session.position = committed + feed.size
            committed += feed.size
        elif rolls_back and accepted == 0 and feed.size == len(drafts) + 1:  # keep the newest token only
            s.rollback_to_first()
            stats.rollbacks += 1
            session.position = committed + 1
            committed += 1
        else:
            s.restore(snap)  # back to `committed`; the accepted tokens ride along with the next verify call
        tokens += drafts[:accepted] + [new]
        for tok in drafts[:accepted] + [new]:
            emitted += 1
            if emit(tok):
                return gen, stats
        if len(tokens) - 1 - committed > MAX_PENDING:  # commit the re-fed tokens (all but the newest)
            pending = np.asarray(tokens[committed:-1], np.int64)
            s.verify(pending, np.array([pending.size - 1], np.int64))
            session.position += pending.size
            committed += pending.size
            stats.commit_calls += 1


def mtp_acceptance(session: Session, ids: Sequence[int]) -> dict[str, Any]:
    """Teacher-forced quality of the draft head over a token sequence: at each position t, the head's top-1 (from
    the decoder's hidden state at t and the true token at t+1) against the decoder's own greedy token at t+2
    (what greedy speculative decoding accepts at depth 1) and against the true token at t+2."""
    require_speculative(session)
    s: Any = session
    draft_ids = draft_token_ids(session.bundle, session.manifest)
    session.reset()
    s.reset_draft()
    arr = session._check([int(i) for i in ids])
    if arr.size < 3:
        raise DeltashipError("MTP acceptance needs at least 3 tokens", "pass --tokens 3 or more")
    logits, hidden, start = [], [], 0
    for size in session._chunks(arr.size):
        rows, h = s.verify(arr[start : start + size], np.arange(size, dtype=np.int64))
        logits.append(rows)
        hidden.append(h)
        session.position += size
        start += size
    greedy = np.concatenate(logits).argmax(-1)  # greedy[t]: the decoder's token for position t+1
    h = np.concatenate(hidden)
    draft = np.array([int(np.argmax(s.draft(h[t : t + 1], arr[t + 1 : t + 2], t)[0])) for t in range(arr.size - 2)])
    if draft_ids is not None:
        draft = draft_ids[draft]
    session.reset()
    return {
        "positions": int(draft.size),
        "top1_vs_greedy": round(float(np.mean(draft == greedy[1:-1])), 4),
        "top1_vs_text": round(float(np.mean(draft == arr[2:])), 4),
    }

"""The ONNX session's speculative-decoding calls (deltaship/runtimes/speculative.py) for bundles exported with
--mtp: `verify` through the decoder's logit_rows / logits_rows / hidden_states I/O, the draft head in mtp.onnx,
and the two ways back after a rejection: `rollback_to_first` (the decoder's rollback.* outputs, the DeltaNet states
after the call's first token) and snapshot / restore (buffers the verify call leaves untouched). Neither copies a
state: buffers swap."""

from __future__ import annotations

from typing import Any

import numpy as np

from deltaship.bundle.paths import bundle_path
from deltaship.errors import DeltashipError
from deltaship.runtimes.base import Checkpoint
from deltaship.runtimes.onnx_io import DecodeInputs, position_feeds, session_options

_VERIFY_WIDTH = 4096
CAPTURED_VERIFY = 4  # verify calls of up to this many tokens, every row kept (depth <= 3), are captured as graphs
CAPTURED_DRAFT = 4  # draft calls of up to this many positions


class OnnxSpeculation:
    """Mixed into OnnxSession; needs its sess, states, _vals, _cur, _bufs, _decode_io, counted, keep_rows and
    position."""

    _draft_sess: Any = None
    _verify_positions: np.ndarray | None = None
    _spare: dict[str, tuple[np.ndarray, Any]] | None = None
    _rollback: dict[str, tuple[np.ndarray, Any]] | None = None
    _after_verify: tuple | None = None  # (serial, forward marker, position, whether it kept the states before it)
    _keep_past = False  # a snapshot is pending: the next verify call must leave the states before it intact
    _verify_serial = 0
    _verify_bufs: dict | None = None  # cuda_graph: (T, rows kept) -> (inputs, outputs) at fixed addresses
    _draft_fixed: dict | None = None  # cuda_graph: T -> the draft head's inputs and outputs at fixed addresses

    def verify(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run ids [T] at self.position (the position is not advanced): logits [len(rows), V] after each row and
        hidden states [T, H] of every position."""
        if "speculative" not in self.manifest:
            raise DeltashipError(f"{self.bundle}: no verify outputs in this bundle", "export it again with --mtp")
        rows = np.asarray(rows, np.int64)
        rows = np.where(rows < 0, rows + ids.size, rows)
        if getattr(self, "cuda_graph", False) and self.keep_rows and self.counted:
            return self._verify_fixed(np.asarray(ids, np.int64).reshape(-1), rows)
        io = self.sess.io_binding()
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids, np.int64).reshape(1, -1))
        if self.counted:
            # ONNX Runtime keys its memory patterns by the XOR of all input dims: input_ids [1, T] and logit_rows
            # [T] cancel out, so every verify length shares one key (0: apart from prefill's T and decode's 1)
            for name, arr in position_feeds(True, self.position, ids.size).items():
                io.bind_cpu_input(name, arr)
        else:  # an older bundle's position_ids (only element 0 is read) gets a width of its own per T, apart
            # from the widths plain calls give (1): each verify length keeps its own pattern
            width = _VERIFY_WIDTH + ids.size
            if self._verify_positions is None or self._verify_positions.shape[1] < width:
                self._verify_positions = np.zeros((1, _VERIFY_WIDTH + self.prefill_chunk + 1), np.int64)
            self._verify_positions[0, 0] = self.position
            io.bind_cpu_input("position_ids", self._verify_positions[:, :width])
        first = int(rows.min())
        if self.keep_rows:  # the graph returns the call's last n rows, n = num_logits_to_keep's largest element
            # [T] copies of n (not [1]): input_ids [1, T] and it keep the memory-pattern key described above
            io.bind_cpu_input("num_logits_to_keep", np.full(ids.size, ids.size - first, np.int64))
        else:  # an older bundle: logit_rows, an overridable initializer (an OrtValue binds it, bind_cpu_input not)
            rows_value = self._ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(rows, np.int64))
            io.bind_ortvalue_input("logit_rows", rows_value)
        spares = self._spares()
        for s in self.states:
            name = s["name"]
            vals, cur = self._vals[name], self._cur[name]
            io.bind_ortvalue_input(name, vals[cur])
            # an in-place DeltaNet state is written out of place here, into its spare: the state before the call
            # stays where it was, for a restore (see snapshot)
            io.bind_ortvalue_output(s["output"], spares[name][1] if name in spares else vals[(cur + 1) % len(vals)])
        # without a snapshot to honour, the first LinearAttention updates the state before the call in place (it is
        # not needed again: a rejection keeps the state after the first token, which is where it then is)
        keep = self._keep_past or not self.can_rollback_to_first() or self._rollback_apart()
        self._bind_rollback(io, verify=True, keep_past=keep)
        self._keep_past = False
        io.bind_output("logits_rows")
        io.bind_output("hidden_states")
        self.sess.run_with_iobinding(io)
        self._after_verify_call(spares, keep)
        values = io.get_outputs()  # in binding order: the states, the rollback states, logits_rows, hidden_states
        logits = values[-2].numpy()[0]
        return (logits[rows - first] if self.keep_rows else logits), values[-1].numpy()[0]

    def _after_verify_call(self, spares: dict, keep: bool) -> None:
        for s in self.states:
            name = s["name"]
            if name in spares:  # the new state becomes current, the old one the spare
                spares[name] = self._swap_in(name, 0, spares[name])
            else:
                self._cur[name] = (self._cur[name] + 1) % len(self._vals[name])
        if spares:  # the in-place states now live in other buffers than the cached decode bindings bind
            self._decode_io.clear()
        self._verify_serial += 1
        self._after_verify = (self._verify_serial, self._forward_marker(), self.position, keep)

    def _verify_fixed(self, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """verify() in a session that captures CUDA graphs: every input and output in a buffer kept per (T, rows
        kept), so a call of a captured shape (T <= CAPTURED_VERIFY, every row kept: a speculative step) replays the
        graph captured for its buffer set; other calls (prefill chunks) run uncaptured on the same buffers. The
        DeltaNet states are written out of place and the rollback outputs to buffers of their own: a rejection
        swaps buffers (rollback_to_first), a restore flips the parity back."""
        t, first = ids.size, int(rows.min())
        n = t - first
        fixed = self._verify_bufs.get((t, n)) if self._verify_bufs is not None else None
        if fixed is None:
            device = "cuda" if self.device == "cuda" else "cpu"
            args = ("cuda", 0) if device == "cuda" else ()
            spec = self.manifest["speculative"]["verify"]["outputs"]
            width = {o["name"]: o["shape"][-1] for o in spec}
            out = {
                "logits_rows": np.zeros((1, n, width["logits_rows"]), np.float32),
                "hidden_states": np.zeros((1, t, width["hidden_states"]), self._draft_hidden_dtype()),
            }
            fixed = (
                DecodeInputs(self._ort, device, True, True, tokens=t),
                {k: self._ort.OrtValue.ortvalue_from_numpy(a, *args) for k, a in out.items()},
            )
            self._verify_bufs = {**(self._verify_bufs or {}), (t, n): fixed}
        inputs, outputs = fixed
        inputs.set_many(ids, self.position, keep=n)
        io = self.sess.io_binding()
        bound = list(inputs.values.values())
        for name, value in inputs.values.items():
            io.bind_ortvalue_input(name, value)
        spares = self._spares()
        for s in self.states:
            name = s["name"]
            vals, cur = self._vals[name], self._cur[name]
            out_val = spares[name][1] if name in spares else vals[(cur + 1) % len(vals)]
            io.bind_ortvalue_input(name, vals[cur])
            io.bind_ortvalue_output(s["output"], out_val)
            bound += [vals[cur], out_val]
        bound += self._bind_rollback(io, verify=True, keep_past=True)
        self._keep_past = False
        for name, value in outputs.items():
            io.bind_ortvalue_output(name, value)
            bound.append(value)
        captured = t <= CAPTURED_VERIFY and n == t
        opts = self._graph_options("verify", (t, n), bound) if captured else self._run_opts["-1"]
        self.sess.run_with_iobinding(io, opts)
        self._after_verify_call(spares, True)
        logits = outputs["logits_rows"].numpy()[0]
        return logits[rows - first], outputs["hidden_states"].numpy()[0]

    def _rollback_outputs(self) -> dict[str, str]:
        """{DeltaNet state: the output holding it after the call's first token} (empty in bundles exported before
        deltaship wrote them)."""
        return self.manifest["speculative"]["rollback"].get("deltanet_outputs", {})

    def _rollback_buffers(self) -> dict[str, tuple[np.ndarray, Any]]:
        """A buffer for each rollback output, made on first use; rollback_to_first swaps it with the state's."""
        if self._rollback is None:
            self._rollback = {}
            for name in self._rollback_outputs():
                a = np.zeros_like(self._bufs[name][0])
                self._rollback[name] = (a, self._ortvalue(a))
        return self._rollback

    def _bind_rollback(self, io, verify: bool, keep_past: bool = True) -> list:
        """Bind the rollback outputs (an unbound output costs an allocation every call): the conv ones to buffers of
        their own; each recurrent one, outside verify calls, to the buffer its present state goes to (the graph's
        second LinearAttention then runs in place: a call of one token costs no copy); in a verify call that must
        keep the state before it (a snapshot was taken), to a buffer of its own; in one that need not, to the
        buffer of the state before the call (the first LinearAttention runs in place; a rejection then goes back
        to that buffer, as a restore would). Where _rollback_apart, every rollback output goes to a buffer of its
        own. Returns the OrtValues bound."""
        rollback, outputs = self._rollback_buffers(), self._rollback_outputs()
        own = self._rollback_apart()
        bound = []
        for s in self.states:
            output = outputs.get(s["name"])
            if output is None:
                continue
            vals, cur = self._vals[s["name"]], self._cur[s["name"]]
            if own or not s["kind"].endswith("recurrent") or (verify and keep_past):
                value = rollback[s["name"]][1]
            elif verify:
                value = vals[cur]
            else:
                value = vals[(cur + 1) % len(vals)]
            io.bind_ortvalue_output(output, value)
            bound.append(value)
        return bound

    def _rollback_apart(self) -> bool:
        """Whether every rollback output gets a buffer of its own: in a session that captures CUDA graphs, and on a
        device, where no kernel is declared safe in place (a recurrent rollback output would otherwise share the
        buffer of the state before the call, or after it, with the call's LinearAttention)."""
        return bool(getattr(self, "cuda_graph", False)) or self.device != "cpu"

    def can_rollback_to_first(self) -> bool:
        """Whether the bundle's graph outputs the states after a call's first token (see rollback_to_first)."""
        return bool(self._rollback_outputs())

    def rollback_to_first(self) -> None:
        """Right after a verify call: make the DeltaNet states those after its first token (the bundle's rollback
        outputs; nothing is copied: the buffers swap). The KV caches need nothing (their length pointer is the
        position); the caller advances the position by 1. Any call in between is refused."""
        if not self.can_rollback_to_first():
            raise DeltashipError(
                f"{self.bundle}: this bundle has no rollback outputs (exported before deltaship wrote them)",
                "export it again with --mtp, or undo verify calls with snapshot/restore",
            )
        after = self._after_verify
        if after is None or after[:3] != (self._verify_serial, self._forward_marker(), self.position):
            raise DeltashipError(
                "rollback_to_first undoes the verify call just made; another call ran after it",
                "call rollback_to_first right after the verify call",
            )
        keep = after[3]
        rollback, spares = self._rollback_buffers(), self._spares()
        for s in self.states:
            name = s["name"]
            if name not in rollback:
                continue
            if not keep and s["kind"].endswith("recurrent"):  # the state before the call's buffer holds it now
                self._undo_verify(name, spares)
                continue
            slot = self._cur[name] if len(self._vals[name]) == 2 else 0
            rollback[name] = self._swap_in(name, slot, rollback[name])
        self._decode_io.clear()
        self._after_verify = None

    def _spares(self) -> dict[str, tuple[np.ndarray, Any]]:
        """A second buffer for each DeltaNet state the session updates in place (one buffer), made on first use."""
        if self._spare is None:
            self._spare = {}
            for s in self.states:
                if s["kind"].startswith("deltanet") and len(self._vals[s["name"]]) == 1:
                    a = np.zeros_like(self._bufs[s["name"]][0])
                    self._spare[s["name"]] = (a, self._ortvalue(a))
        return self._spare

    def snapshot(self) -> dict[str, Any]:
        """What it takes to undo the next verify call, without copying the DeltaNet states: a verify call writes
        every DeltaNet state out of place (the double-buffered ones into their other buffer, the in-place ones into
        a spare), so the states before it stay intact until the call after it. `restore` therefore undoes at most
        the one verify call made since the snapshot; any other call in between (decode, prefill, a second verify)
        makes it refuse. The KV caches keep their buffers (their length pointer is the position)."""
        if self.device != "cpu" and self._spares():
            raise DeltashipError(
                f"a snapshot keeps the DeltaNet states it updates in place in spare host buffers; this session runs "
                f"on {self.device}",
                "use the CPU provider, or --speculative mtp at depth 1 (which rolls back without a snapshot)",
            )
        self._spares()
        self._keep_past = True  # the next verify call writes every state out of place
        return {"position": self.position, "serial": self._verify_serial, "forward": self._forward_marker()}

    def _forward_marker(self) -> tuple:
        """Changes with every call that moves the double-buffered states (each call flips them)."""
        return tuple(self._cur[s["name"]] for s in self.states if len(self._vals[s["name"]]) == 2)

    def restore(self, snap) -> None:
        """Undo the verify call since `snapshot()`; a Checkpoint (Session.checkpoint) goes to Session.restore."""
        if isinstance(snap, Checkpoint):
            return super().restore(snap)
        calls, marker = self._verify_serial - snap["serial"], self._forward_marker()
        if calls == 0 and marker == snap["forward"] and self.position == snap["position"]:  # nothing ran since
            return
        # exactly one verify and no other call: one flip of the double-buffered states, the position unmoved
        # (decode and prefill advance it; verify does not)
        if calls != 1 or marker != tuple(1 - c for c in snap["forward"]) or self.position != snap["position"]:
            raise DeltashipError(
                "restore undoes only the one verify call made since its snapshot; other calls ran in between",
                "take the snapshot right before the verify call to undo",
            )
        if self._after_verify is not None and not self._after_verify[3]:
            raise DeltashipError(
                "restore: the verify call since the snapshot updated the states in place (no snapshot was pending "
                "when it ran)",
                "take the snapshot right before the verify call to undo",
            )
        spares = self._spares()
        for s in self.states:
            if s["kind"].startswith("deltanet"):
                self._undo_verify(s["name"], spares)
        if spares:
            self._decode_io.clear()
        self._verify_serial -= 1
        self.position = snap["position"]

    def _undo_verify(self, name: str, spares: dict) -> None:
        """Make the buffer the last verify call read state `name` from current again."""
        if name in spares:
            spares[name] = self._swap_in(name, 0, spares[name])
        else:
            self._cur[name] = (self._cur[name] - 1) % len(self._vals[name])

    def _swap_in(self, name: str, slot: int, pair: tuple[np.ndarray, Any]) -> tuple[np.ndarray, Any]:
        """Put (buffer, OrtValue) `pair` in state `name`'s `slot`; return the pair it replaces (nothing is copied)."""
        old = (self._bufs[name][slot], self._vals[name][slot])
        self._bufs[name][slot], self._vals[name][slot] = pair
        return old

    def _draft_session(self):
        if self._draft_sess is None:
            block = self.manifest["speculative"]["draft"]
            on_device = self.device == "cuda"  # a CUDA session's head runs beside it (captured with it)
            providers = (
                [(p, self._draft_provider_options()) if p == "CUDAExecutionProvider" else p for p in self.providers]
                if on_device
                else ["CPUExecutionProvider"]
            )
            self._draft_sess = self._ort.InferenceSession(
                str(bundle_path(self.bundle, self.manifest, block["file"], "speculative.draft.file")),
                sess_options=session_options(self._ort, self.threads, None, turn_taking=True),
                providers=providers,
            )
            self._draft_states = block["states"]
            self._draft_bufs = {s["name"]: np.zeros(s["shape"], np.dtype(s["dtype"])) for s in self._draft_states}
            args = ("cuda", 0) if on_device else ()
            self._draft_vals = {
                n: self._ort.OrtValue.ortvalue_from_numpy(a, *args) for n, a in self._draft_bufs.items()
            }
            self._draft_graphs: dict[tuple, Any] = {}
        return self._draft_sess

    def _draft_hidden_dtype(self) -> np.dtype:
        """The hidden states' dtype between the decoder and the head: the activations' (float32 in bundles from
        before deltaship wrote it per bundle)."""
        spec = self.manifest["speculative"]["draft"]["inputs"]
        return np.dtype(next(i["dtype"] for i in spec if i["name"] == "hidden_states"))

    def _draft_provider_options(self) -> dict[str, str]:
        """The CUDA provider's options for the head: captured where the decoder is and the head's graph allows it
        (a bundle exported with --onnx-cuda-graph --mtp: manifest speculative.draft.cuda_graph)."""
        capturable = getattr(self, "cuda_graph", False) and "cuda_graph" in self.manifest["speculative"]["draft"]
        return {"enable_cuda_graph": "1"} if capturable else {}

    def reset_draft(self) -> None:
        self._draft_session()
        for name, a in self._draft_bufs.items():
            if self.device == "cuda":
                self._draft_vals[name].update_inplace(np.zeros_like(a))
            else:
                a[...] = 0

    def draft(self, hidden: np.ndarray, ids: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        """The MTP head over hidden [T, H] at positions position .. position+T-1 and ids [T] (the tokens one
        position later): logits [V] for the token after the last one, and the head's hidden states [T, H]."""
        sess = self._draft_session()
        if getattr(self, "cuda_graph", False):
            return self._draft_fixed_call(sess, hidden, np.asarray(ids, np.int64).reshape(-1), position)
        io = sess.io_binding()
        io.bind_cpu_input("hidden_states", np.ascontiguousarray(hidden, self._draft_hidden_dtype())[None])
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids, np.int64).reshape(1, -1))
        io.bind_cpu_input("position", np.array([position], np.int64))
        for s in self._draft_states:  # GroupQueryAttention writes the new positions into the buffer it reads
            io.bind_ortvalue_input(s["name"], self._draft_vals[s["name"]])
            io.bind_ortvalue_output(s["output"], self._draft_vals[s["name"]])
        io.bind_output("logits")
        io.bind_output("mtp_hidden_states")
        sess.run_with_iobinding(io)
        values = io.get_outputs()
        return values[-2].numpy().reshape(-1), values[-1].numpy()[0]

    def _draft_fixed_call(self, sess, hidden: np.ndarray, ids: np.ndarray, position: int):
        """draft() in a session that captures CUDA graphs: inputs and outputs in buffers kept per T, the head's
        KV cache in its one buffer; T <= CAPTURED_DRAFT replays a graph per T (the first call after the prompt,
        over every prompt position, runs uncaptured)."""
        t = ids.size
        fixed = (self._draft_fixed or {}).get(t)
        if fixed is None:
            args = ("cuda", 0) if self.device == "cuda" else ()
            block = self.manifest["speculative"]["draft"]
            width = {o["name"]: o["shape"][-1] for o in block["outputs"]}
            host = {
                "hidden_states": np.zeros((1, t, hidden.shape[-1]), self._draft_hidden_dtype()),
                "input_ids": np.zeros((1, t), np.int64),
                "position": np.zeros(1, np.int64),
            }
            out = {
                "logits": np.zeros((1, width["logits"]), np.float32),
                "mtp_hidden_states": np.zeros((1, t, width["mtp_hidden_states"]), self._draft_hidden_dtype()),
            }
            ort = self._ort
            fixed = (
                host,
                {k: ort.OrtValue.ortvalue_from_numpy(a, *args) for k, a in host.items()},
                {k: ort.OrtValue.ortvalue_from_numpy(a, *args) for k, a in out.items()},
            )
            self._draft_fixed = {**(self._draft_fixed or {}), t: fixed}
        host, ins, outs = fixed
        host["hidden_states"][0] = hidden
        host["input_ids"][0] = ids
        host["position"][0] = position
        if self.device == "cuda":
            for k, v in ins.items():
                v.update_inplace(host[k])
        io = sess.io_binding()
        bound = []
        for k, v in ins.items():
            io.bind_ortvalue_input(k, v)
            bound.append(v)
        for s in self._draft_states:  # GroupQueryAttention writes the new positions into the buffer it reads
            io.bind_ortvalue_input(s["name"], self._draft_vals[s["name"]])
            io.bind_ortvalue_output(s["output"], self._draft_vals[s["name"]])
            bound.append(self._draft_vals[s["name"]])
        for k, v in outs.items():
            io.bind_ortvalue_output(k, v)
            bound.append(v)
        key = (t, tuple(v.data_ptr() for v in bound))
        opts = self._draft_graphs.get(key)
        if opts is None:
            opts = self._ort.RunOptions()
            gid = str(len(self._draft_graphs) + 1) if t <= CAPTURED_DRAFT else "-1"
            opts.add_run_config_entry("gpu_graph_id", gid)
            self._draft_graphs[key] = opts
        sess.run_with_iobinding(io, opts)
        return outs["logits"].numpy().reshape(-1), outs["mtp_hidden_states"].numpy()[0]

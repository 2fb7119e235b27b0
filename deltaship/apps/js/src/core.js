// The runtime-independent part of the driver: manifest checks, the I/O plan read from the manifest,
// chunked prefill / decode with the states the manifest lists, and sampling. node.js and web.js only
// differ in how they read files and which onnxruntime package they pass in.

/** The manifest this driver reads: `schema` and the `schema_version`s it knows (2 adds `model_card` only). */
export const SCHEMA = 'deltaship.bundle';
export const SCHEMA_VERSIONS = [1, 2];

/** An error that says what went wrong and, in `fix`, what to do about it. */
export class DeltashipError extends Error {
  /**
   * @param {string} what what went wrong, and where
   * @param {string} fix what to do about it
   */
  constructor(what, fix) {
    super(`${what}\n  fix: ${fix}`);
    this.name = 'DeltashipError';
    this.what = what;
    this.fix = fix;
  }
}

const AGAIN = 'export the bundle again (or restore it from where it was shipped); a bundle names only files inside its own ' +
  'directory, each listed in `files` with its sha256';

/**
 * Why `name` is not a plain relative path inside the bundle (null when it is one): deltaship's rule
 * (deltaship/bundle/paths.py): a non-empty string, no NUL or backslash, not absolute, no empty, `.` or `..`
 * component, only the characters deltaship writes (A-Z a-z 0-9 . _ + @ = - /).
 * @param {*} name
 * @returns {string|null}
 */
export function pathProblem(name) {
  if (typeof name !== 'string' || name === '') return 'is not a file name';
  if (name.includes('\0') || name.includes('\\')) return 'holds a NUL or backslash';
  if (name.startsWith('/') || /^[A-Za-z]:/.test(name)) return 'is an absolute path';
  const parts = name.split('/');
  if (parts.includes('..')) return 'has a `..` component (it would leave the bundle)';
  if (parts.some((p) => p === '' || p === '.')) return 'is not a normalized relative path';
  if (!/^[A-Za-z0-9._+@=-]+(\/[A-Za-z0-9._+@=-]+)*$/.test(name)) return 'holds characters outside A-Z a-z 0-9 . _ + @ = - and /';
  return null;
}

/**
 * A file name from manifest field `field`, refused unless it is a plain relative path inside the bundle that
 * the manifest's `files` lists (so its integrity can be checked).
 * @param {object} manifest
 * @param {*} name
 * @param {string} field
 * @param {string} where the bundle's path or URL, for messages
 * @returns {string} name
 */
export function safePath(manifest, name, field, where) {
  const why = pathProblem(name)
    ?? (Object.hasOwn(manifest.files ?? {}, name) ? null : 'is not listed in `files`, so its integrity cannot be checked');
  if (why) {
    throw new DeltashipError(`${where}: manifest field ${field} = ${JSON.stringify(name)} ${why}; refused before opening any file`, AGAIN);
  }
  return name;
}

/**
 * Every path the manifest names (entry, files, tokenizer files), by deltaship's rule; throws on the first bad one.
 * @param {object} manifest
 * @param {string} where
 */
export function checkPaths(manifest, where) {
  const files = manifest.files;
  if (files === null || typeof files !== 'object' || Array.isArray(files)) {
    throw new DeltashipError(`${where}: manifest field files is not an object listing the bundle's files`, AGAIN);
  }
  for (const name of Object.keys(files)) safePath(manifest, name, 'files', where);
  safePath(manifest, manifest.entry, 'entry', where);
  (Array.isArray(manifest.tokenizer?.files) ? manifest.tokenizer.files : [])
    .forEach((name, i) => safePath(manifest, name, `tokenizer.files[${i}]`, where));
}

/**
 * Refuse a manifest this driver cannot run: not a deltaship bundle, an unknown schema version, a target
 * other than ONNX, a path outside the bundle or not in `files`, or a state that does not start from zeros.
 * @param {object} manifest parsed manifest.json
 * @param {string} where the bundle's path or URL, for messages
 * @returns {object} the manifest
 */
export function checkManifest(manifest, where) {
  if (manifest === null || typeof manifest !== 'object' || manifest.schema !== SCHEMA) {
    throw new DeltashipError(`${where}: manifest.json is not a deltaship manifest (schema ${JSON.stringify(manifest?.schema)})`,
      'pass the directory written by `deltaship export --target onnx --out DIR`');
  }
  if (!SCHEMA_VERSIONS.includes(manifest.schema_version)) {
    throw new DeltashipError(
      `${where}: manifest schema_version ${manifest.schema_version} is not one this driver reads (${SCHEMA_VERSIONS.join(', ')})`,
      'export again with the deltaship that ships this driver (`deltaship export --target onnx ...`), ' +
      'or use the deltaship-runtime package from the deltaship that wrote the bundle');
  }
  if (manifest.target !== 'onnx') {
    throw new DeltashipError(`${where}: the bundle's target is ${manifest.target}; the JavaScript driver runs ONNX bundles only`,
      'export again with `deltaship export --target onnx ...`');
  }
  checkPaths(manifest, where);
  if (!Array.isArray(manifest.states)) {
    throw new DeltashipError(`${where}: manifest field states is not a list`, AGAIN);
  }
  for (const s of manifest.states) {
    if (s.init !== 'zeros') {
      throw new DeltashipError(`${where}: state ${s.name} starts from ${JSON.stringify(s.init)}; this driver knows only "zeros"`,
        'export again with the deltaship that ships this driver');
    }
  }
  return manifest;
}

/**
 * Which graph input/output plays which part, from the manifest's inputs/outputs/states. Three position
 * forms exist: the sequence-length pair onnxruntime-genai feeds (what deltaship exports now):
 * `current_sequence_length` int32 [1] = p + T and `past_sequence_length` int32 [1, 1] = p + T - 1, where p
 * is the start position of the call and T its token count; `position` int64 [1] (p); and `position_ids`
 * int64 [1, T] (one position per token, older bundles). Logits are [1, V] or [1, 1, V]
 * (or [1, T, V]: the last row is the one that matters).
 * @param {object} manifest a checked manifest
 * An --mtp bundle's `num_logits_to_keep` (kind logits_to_keep) is fed [0]: only speculative verify calls ask
 * for more rows.
 * @returns {{tokens: string, position: {name: string, form: 'start'|'ids'}|{form: 'counts', current: string,
 *            past: string}|null, keepRows: string|null, logits: string, states: object[]}}
 */
export function ioPlan(manifest) {
  let tokens = null;
  let position = null;
  let keepRows = null;
  const counts = {};
  for (const inp of manifest.inputs) {
    if (inp.kind === 'tokens') {
      tokens = inp.name;
    } else if (inp.kind === 'logits_to_keep') {
      keepRows = inp.name; // an --mtp decoder's verify rows: a plain call feeds [0] (the last row)
    } else if (inp.kind === 'current_sequence_length' || inp.kind === 'past_sequence_length') {
      counts[inp.kind === 'current_sequence_length' ? 'current' : 'past'] = inp.name;
    } else if (inp.kind === 'position_ids' || inp.name === 'position_ids') {
      position = { name: inp.name, form: 'ids' };
    } else if (inp.kind === 'position') {
      if (inp.shape.length !== 1) {
        throw new DeltashipError(`manifest input ${inp.name} (kind position) has shape ${JSON.stringify(inp.shape)}, not [1]`,
          'name a per-token position input `position_ids` (kind position_ids) with shape [1, T]');
      }
      position = { name: inp.name, form: 'start' };
    } else {
      throw new DeltashipError(`manifest input ${inp.name} has kind ${JSON.stringify(inp.kind)}, which this driver does not feed`,
        'use the deltaship-runtime package from the deltaship that wrote the bundle');
    }
  }
  if (counts.current || counts.past) {
    if (!counts.current || !counts.past || position) {
      throw new DeltashipError('manifest inputs: current_sequence_length and past_sequence_length come as a pair, '
        + 'with no other position input', 'export the bundle again with `deltaship export --target onnx ...`');
    }
    position = { form: 'counts', ...counts };
  }
  const logits = manifest.outputs.find((o) => o.kind === 'logits');
  if (!tokens || !logits) {
    throw new DeltashipError('manifest has no input of kind "tokens" or no output of kind "logits"',
      'export the bundle again with `deltaship export --target onnx ...`');
  }
  return { tokens, position, keepRows, logits: logits.name, states: manifest.states };
}

/**
 * The bundle's model files: the entry (manifest.entry) and its external-data files (weights stored beside
 * model.onnx, e.g. model.onnx.data), from the manifest's file list.
 * @param {object} manifest
 * @returns {{entry: string, externalData: string[]}}
 */
export function modelFiles(manifest) {
  const tokenizerFiles = new Set(manifest.tokenizer?.files ?? []);
  const externalData = Object.keys(manifest.files ?? {}).filter(
    (f) => f !== manifest.entry && !tokenizerFiles.has(f) && (f.startsWith(`${manifest.entry}.`) || f.endsWith('.data')));
  return { entry: manifest.entry, externalData };
}

// float16 tensors come back as raw halves (Uint16Array) in onnxruntime 1.30.
function halfToFloat(h) {
  const s = h & 0x8000 ? -1 : 1;
  const e = (h >> 10) & 0x1f;
  const f = h & 0x3ff;
  if (e === 0) return s * 2 ** -14 * (f / 1024);
  if (e === 31) return f ? NaN : s * Infinity;
  return s * 2 ** (e - 15) * (1 + f / 1024);
}

function lastRow(tensor, vocab) {
  const data = tensor.data;
  const row = data.subarray(data.length - vocab);
  if (tensor.type === 'float16' && !(row instanceof Float32Array) && !(typeof Float16Array !== 'undefined' && row instanceof Float16Array)) {
    return Float32Array.from(row, halfToFloat);
  }
  return Float32Array.from(row);
}

function zeros(ort, state) {
  const n = state.shape.reduce((a, b) => a * b, 1);
  if (state.dtype === 'float32') return new ort.Tensor('float32', new Float32Array(n), state.shape);
  if (state.dtype === 'float16') return new ort.Tensor('float16', new Uint16Array(n), state.shape);
  // quantized KV caches (--kv-cache int8: int8; int4: uint8, two values a byte); unwritten rows are masked
  if (state.dtype === 'int8') return new ort.Tensor('int8', new Int8Array(n), state.shape);
  if (state.dtype === 'uint8') return new ort.Tensor('uint8', new Uint8Array(n), state.shape);
  throw new DeltashipError(`state ${state.name} has dtype ${state.dtype}; this driver knows float32, float16, int8 and uint8`,
    'export the bundle again with this deltaship');
}

/** A small seedable generator (mulberry32) so sampled runs can be repeated. */
export function seededRandom(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/**
 * Pick the next token: argmax when temperature <= 0, else softmax(logits / temperature) over the top-k.
 * @param {Float32Array} logits
 * @param {{temperature?: number, topK?: number, random?: () => number}} [opts]
 * @returns {number} token id
 */
export function sample(logits, { temperature = 0, topK = 0, random = Math.random } = {}) {
  if (!(temperature > 0)) {
    let best = 0;
    for (let i = 1; i < logits.length; i++) if (logits[i] > logits[best]) best = i;
    return best; // first maximum, as numpy.argmax
  }
  let order = Array.from(logits.keys()).sort((i, j) => logits[j] - logits[i]);
  if (topK > 0 && topK < order.length) order = order.slice(0, topK);
  const top = logits[order[0]] / temperature;
  const p = order.map((i) => Math.exp(logits[i] / temperature - top));
  let r = random() * p.reduce((a, b) => a + b, 0);
  for (let k = 0; k < order.length; k++) {
    r -= p[k];
    if (r <= 0) return order[k];
  }
  return order[order.length - 1];
}

/**
 * One sequence on one bundle: owns the states and the position of the next token. Made by
 * `openBundle` (node.js / web.js); not constructed directly.
 */
export class Session {
  /**
   * @param {{ort: object, session: object, manifest: object, tokenizer: object|null, sharedState?: function}} parts
   */
  constructor({ ort, session, manifest, tokenizer, sharedState = null }) {
    this.ort = ort;
    this.session = session;
    this.manifest = manifest;
    this.tokenizer = tokenizer;
    // sharedState(state) -> a tensor fed as both past and present (one buffer updated in place), or null
    this.sharedState = sharedState;
    this.shared = new Set();
    this.plan = ioPlan(manifest);
    this.vocabSize = manifest.model.vocab_size;
    this.maxContext = manifest.max_context;
    this.prefillChunk = manifest.prefill_chunk;
    const eos = manifest.tokens?.eos ?? [];
    this.eosIds = new Set(Array.isArray(eos) ? eos : [eos]);
    const pos = this.plan.position;
    const missing = [this.plan.tokens, pos?.name, pos?.current, pos?.past, ...this.plan.states.map((s) => s.name)]
      .filter((n) => n && !session.inputNames.includes(n));
    if (missing.length) {
      throw new DeltashipError(`the model has no input(s) ${missing.join(', ')} that its manifest lists`,
        'the manifest and model.onnx come from different exports: export the bundle again');
    }
    this.position = 0;
    this.states = null;
    this.rewinds = []; // each rewind's target position: KV entries at or past it may be rewritten
    this.reset();
  }

  /** Forget the sequence: zero every state; the next token is at position 0. */
  reset() {
    this.#disposeStates();
    this.states = {};
    this.shared.clear();
    for (const s of this.plan.states) {
      const t = this.sharedState?.(s);
      if (t) this.shared.add(s.name);
      this.states[s.name] = t ?? zeros(this.ort, s);
    }
    this.rewinds?.push(0);
    this.position = 0;
  }

  /** The manifest entries of the fixed-size states a checkpoint copies (DeltaNet conv and recurrent). */
  deltanetStates() {
    return this.plan.states.filter((s) => String(s.kind ?? '').startsWith('deltanet'));
  }

  /**
   * The sequence's state now: a copy of the DeltaNet states' data (fixed size) and the position. The KV caches
   * are not copied: they only grow, so going back moves the position (the next call overwrites what lies past it).
   * @returns {Promise<{position: number, states: object, owner: Session, serial: number}>}
   */
  async checkpoint() {
    const states = {};
    for (const s of this.deltanetStates()) {
      const t = this.states[s.name];
      states[s.name] = (t.location === 'gpu-buffer' ? await t.getData() : t.data).slice();
    }
    return { position: this.position, states, owner: this, serial: this.rewinds.length };
  }

  /** Whether `cp` is this session's and no rewind before its position happened since (its KV entries hold). */
  canRestore(cp) {
    return cp?.owner === this && this.rewinds.slice(cp.serial).every((r) => r >= cp.position);
  }

  /** Go back to a checkpoint of this session: its DeltaNet states are copied back, the position moves to it. */
  restore(cp) {
    if (!this.canRestore(cp)) {
      throw new DeltashipError(`the checkpoint at position ${cp?.position} is not this session's, or is stale (the session went back before it since)`,
        'restore a checkpoint taken by this session after its last rewind, or reset and prefill the tokens again');
    }
    this.writeStates(cp.states);
    this.#rewind(cp.position);
  }

  /** Replace states' data ({name: typed array}, each the full state) in place or with new CPU tensors. */
  writeStates(arrays) {
    for (const s of this.plan.states) {
      const data = arrays[s.name];
      if (data === undefined) continue;
      const old = this.states[s.name];
      if (this.shared.has(s.name) && old.location !== 'gpu-buffer') {
        old.data.set(data);
      } else {
        if (old.location === 'gpu-buffer') old.dispose();
        this.states[s.name] = new this.ort.Tensor(s.dtype, data.slice(), s.shape);
      }
    }
  }

  #rewind(position) {
    this.rewinds.push(position);
    this.position = position;
  }

  /** Free the states and the ONNX Runtime session. */
  async release() {
    this.#disposeStates();
    await this.session.release();
  }

  #disposeStates() {
    for (const t of Object.values(this.states ?? {})) if (t.location === 'gpu-buffer') t.dispose();
  }

  /** Token ids of `text` (no special tokens added, as `deltaship generate --prompt`). */
  encode(text) {
    return this.#tok().encode(text, { add_special_tokens: false }).ids;
  }

  /** Text of token ids (special tokens kept). */
  decodeText(ids) {
    // No clean-up of spaces: the Python side (the `tokenizers` library) does none either.
    return this.#tok().decode(ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
  }

  #tok() {
    if (!this.tokenizer) {
      throw new DeltashipError('this bundle has no tokenizer (the checkpoint had no tokenizer.json)', 'pass token ids instead of text');
    }
    return this.tokenizer;
  }

  #check(ids) {
    if (ids.length === 0) throw new DeltashipError('the prompt is empty', 'pass at least one token');
    const bad = ids.filter((i) => !Number.isInteger(i) || i < 0 || i >= this.vocabSize);
    if (bad.length) {
      throw new DeltashipError(`token id(s) ${bad.slice(0, 8).join(', ')} are outside the vocabulary (0 .. ${this.vocabSize - 1})`,
        "pass ids produced by this model's tokenizer");
    }
    if (this.position + ids.length > this.maxContext) {
      throw new DeltashipError(`${ids.length} token(s) at position ${this.position} exceed the bundle's max context of ${this.maxContext}`,
        'shorten the prompt, reset the session, or export with a larger --max-context');
    }
  }

  // One call of at most prefill_chunk tokens at this.position; returns the logits after the last one.
  async #forward(ids) {
    const { ort, plan } = this;
    const T = ids.length;
    const feeds = { [plan.tokens]: new ort.Tensor('int64', BigInt64Array.from(ids, BigInt), [1, T]) };
    if (plan.position?.form === 'counts') {
      const end = this.position + T;
      feeds[plan.position.current] = new ort.Tensor('int32', Int32Array.of(end), [1]);
      feeds[plan.position.past] = new ort.Tensor('int32', Int32Array.of(end - 1), [1, 1]);
    } else if (plan.position?.form === 'start') {
      feeds[plan.position.name] = new ort.Tensor('int64', BigInt64Array.of(BigInt(this.position)), [1]);
    } else if (plan.position?.form === 'ids') {
      const pos = BigInt64Array.from({ length: T }, (_, i) => BigInt(this.position + i));
      feeds[plan.position.name] = new ort.Tensor('int64', pos, [1, T]);
    }
    if (plan.keepRows) feeds[plan.keepRows] = new ort.Tensor('int64', BigInt64Array.of(0n), [1]);
    for (const s of plan.states) feeds[s.name] = this.states[s.name];
    let out;
    if (this.shared.size) {
      // Every output must be named when some are preallocated; null = ONNX Runtime allocates it.
      const fetches = Object.fromEntries(this.session.outputNames.map((n) => [n, null]));
      for (const s of plan.states) if (this.shared.has(s.name)) fetches[s.output] = this.states[s.name];
      out = await this.session.run(feeds, fetches);
    } else {
      // Only the logits and the states: a bundle exported with --mtp has more outputs (verify rows, hidden states,
      // the DeltaNet states after the first token), and every fetched output is copied out (19 MiB a call at 0.8B).
      out = await this.session.run(feeds, [plan.logits, ...plan.states.map((s) => s.output)]);
    }
    const next = {};
    for (const s of plan.states) {
      // a shared state keeps its own tensor (it owns the buffer); the runtime wrote into it
      next[s.name] = this.shared.has(s.name) ? this.states[s.name] : out[s.output];
      const old = this.states[s.name];
      // On WebGPU the present.* outputs stay in GPU buffers and become the next call's past.*; free the
      // old ones unless the runtime handed the same buffer back.
      if (old.location === 'gpu-buffer' && old.gpuBuffer !== next[s.name].gpuBuffer) old.dispose();
    }
    this.states = next;
    const logits = lastRow(out[plan.logits], this.vocabSize);
    for (const [name, t] of Object.entries(out)) if (name === plan.logits || !plan.states.some((s) => s.output === name)) t.dispose?.();
    return logits;
  }

  /**
   * Feed a prompt in chunks of the manifest's prefill_chunk.
   * @param {number[]} ids token ids
   * @returns {Promise<Float32Array>} logits after the last token
   */
  async prefill(ids) {
    this.#check(ids);
    let logits = null;
    for (let i = 0; i < ids.length; i += this.prefillChunk) {
      const chunk = ids.slice(i, i + this.prefillChunk);
      logits = await this.#forward(chunk);
      this.position += chunk.length;
    }
    return logits;
  }

  /**
   * Feed one token.
   * @param {number} token
   * @returns {Promise<Float32Array>} logits for the next token
   */
  async decode(token) {
    this.#check([token]);
    const logits = await this.#forward([token]);
    this.position += 1;
    return logits;
  }

  /**
   * Prefill `prompt` (text or token ids) then yield up to maxNewTokens token ids as they are produced,
   * greedy unless temperature > 0. Stops after an end-of-sequence token (yielded) unless stopAtEos is
   * false, and at the bundle's max context.
   * @param {string|number[]} prompt
   * @param {{maxNewTokens?: number, temperature?: number, topK?: number, seed?: number, stopAtEos?: boolean}} [opts]
   * @returns {AsyncGenerator<number>}
   */
  async *stream(prompt, { maxNewTokens = 32, temperature = 0, topK = 0, seed, stopAtEos = true } = {}) {
    const ids = typeof prompt === 'string' ? this.encode(prompt) : Array.from(prompt);
    const random = seed === undefined ? Math.random : seededRandom(seed);
    this.stopped = 'length';
    let logits = await this.prefill(ids);
    for (let n = 0; n < maxNewTokens; n++) {
      const tok = sample(logits, { temperature, topK, random });
      yield tok;
      if (stopAtEos && this.eosIds.has(tok)) {
        this.stopped = 'eos';
        return;
      }
      if (n + 1 >= maxNewTokens) return;
      if (this.position >= this.maxContext) {
        this.stopped = 'context';
        return;
      }
      logits = await this.decode(tok);
    }
  }

  /**
   * `stream` collected: the new token ids, their text (when the bundle has a tokenizer) and why it stopped.
   * @param {string|number[]} prompt
   * @param {object} [opts] as `stream`, plus onToken(id) called for each token
   * @returns {Promise<{inputIds: number[], outputIds: number[], text: string|null, stopped: string}>}
   */
  async generate(prompt, opts = {}) {
    const inputIds = typeof prompt === 'string' ? this.encode(prompt) : Array.from(prompt);
    const outputIds = [];
    for await (const tok of this.stream(inputIds, opts)) {
      outputIds.push(tok);
      opts.onToken?.(tok);
    }
    return { inputIds, outputIds, text: this.tokenizer ? this.decodeText(outputIds) : null, stopped: this.stopped };
  }
}

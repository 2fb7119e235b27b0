// Multi-turn chat over one Session, as deltaship/chat/conversation.py does it: each turn renders the history with
// the template's per-role pieces (written by `deltaship app` into chat.json; no Jinja here), tokenizes it, and feeds
// only the tokens the state lacks. A turn checkpoint is a copy of the DeltaNet states plus the position (the KV
// caches only grow); when the template rewrites the past (a reply's <think> block dropped), the latest checkpoint
// before the first differing token is restored and the template's version fed from there.
import { DeltashipError, sample, seededRandom } from './core.js';

export const SESSION_FORMAT = 'deltaship-chat-session';
export const SESSION_VERSION = 1;
export const PROMPT_CACHE_FILE = 'prompt_cache.safetensors';
const KEEP_TURNS = 16; // turns whose checkpoints stay in memory; an older one is rebuilt by a prefill of the history
const THINK_CLOSE = '</think>';

/**
 * The template's rendering of `messages` from its pieces (deltaship/chat/pieces.py `render_pieces`, checked there
 * against the template at `deltaship app` time).
 * @param {object} pieces chat.json's `pieces`: start, roles.{system,user,assistant}.{prefix,suffix},
 *   generation_prompt, generation_prompt_no_thinking, drop_think
 */
export function renderChat(pieces, messages, addGenerationPrompt, thinking = true) {
  let out = pieces.start;
  for (const m of messages) {
    let content = m.content;
    if (m.role === 'assistant' && pieces.drop_think && content.includes(THINK_CLOSE)) {
      content = content.split(THINK_CLOSE).at(-1).replace(/^\n+/, '');
    }
    const role = pieces.roles[m.role];
    if (!role) throw new DeltashipError(`unsupported role ${m.role}`, 'use the roles system, user and assistant');
    out += role.prefix + content + role.suffix;
  }
  if (addGenerationPrompt) out += thinking ? pieces.generation_prompt : pieces.generation_prompt_no_thinking;
  return out;
}

function commonPrefix(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return n;
}

/** A conversation on a session: send, retry, undo, reset, save / load. Make one with `await Chat.create(...)`. */
export class Chat {
  /**
   * @param {import('./core.js').Session} session an open bundle (it must have a tokenizer)
   * @param {{pieces: object, system?: string|null, thinking?: boolean, promptCache?: Uint8Array|ArrayBuffer|null}} opts
   *   pieces: chat.json's `pieces`; thinking: false = the template's enable_thinking=false; promptCache: the
   *   bundle's prompt_cache.safetensors (used when it holds `system` with the same settings)
   */
  static async create(session, opts) {
    const chat = new Chat(session, opts);
    await chat.reset();
    return chat;
  }

  constructor(session, { pieces, system = null, thinking = true, promptCache = null }) {
    if (!pieces?.roles) throw new DeltashipError('no chat template pieces given', 'pass chat.json\'s `pieces` (written by `deltaship app`)');
    this.session = session;
    this.pieces = pieces;
    this.system = system;
    this.thinking = thinking;
    this.promptCache = promptCache;
    const imEnd = session.manifest.tokens?.im_end;
    this.stopIds = new Set([...session.eosIds, ...(Number.isInteger(imEnd) ? [imEnd] : [])]);
    this.messages = [];
    this.turns = [];
    this.ids = [];
  }

  /** template_kwargs as the Python chat records them. */
  get templateKwargs() {
    return this.thinking ? {} : { enable_thinking: false };
  }

  renderIds(messages, addGenerationPrompt) {
    return this.session.encode(renderChat(this.pieces, messages, addGenerationPrompt, this.thinking));
  }

  /** Start over: only the system message remains; the state is empty, or the prompt cache's when it holds it. */
  async reset() {
    this.messages = this.system ? [{ role: 'system', content: this.system }] : [];
    this.turns = [];
    this.#forget();
    if (this.promptCache && this.system !== null) {
      const { meta, tensors } = await readSessionBytes(this.promptCache, PROMPT_CACHE_FILE);
      await checkIdentity(meta, this.session, PROMPT_CACHE_FILE);
      if (meta.system === this.system && JSON.stringify(meta.template_kwargs) === JSON.stringify(this.templateKwargs)
          && JSON.stringify(meta.ids) === JSON.stringify(this.renderIds(this.messages, false))) {
        loadState(this.session, meta.position, tensors, PROMPT_CACHE_FILE);
        this.ids = [...meta.ids];
      }
    }
  }

  #forget() {
    this.session.reset();
    this.ids = [];
  }

  /**
   * Add a user message and generate the reply (kept in the history).
   * @param {string} text
   * @param {{maxNewTokens?: number, temperature?: number, topK?: number, seed?: number, onToken?: function}} [opts]
   * @returns {Promise<{text: string, ids: number[], stopped: string, historyIds: number[], prefillTokens: number}>}
   */
  async send(text, opts = {}) {
    if (typeof text !== 'string') throw new DeltashipError('a message is text', 'pass a string');
    const turn = { messagesBefore: this.messages.length, before: null, beforeReply: null };
    this.messages.push({ role: 'user', content: text });
    const reply = await this.#respond(turn, opts);
    if (reply.stopped === 'context' && !reply.ids.length) this.messages.pop();
    return reply;
  }

  /** The last reply again: back to the checkpoint before its generation prompt, which is fed again. */
  async retry(opts = {}) {
    if (!this.turns.length) throw new DeltashipError('nothing to retry: no reply yet', 'send a message first');
    const turn = this.turns.pop();
    this.messages.splice(turn.messagesBefore + 1);
    return this.#respond(turn, opts);
  }

  /** Drop the last exchange (user message and reply): the state goes back to before it. */
  async undo() {
    if (!this.turns.length) throw new DeltashipError('nothing to undo: no exchange yet', 'send a message first');
    const turn = this.turns.pop();
    this.messages.splice(turn.messagesBefore);
    if (turn.before && this.session.canRestore(turn.before)) {
      this.session.restore(turn.before);
      this.ids.length = turn.before.position;
    } else {
      this.#forget();
    }
  }

  async #respond(turn, { maxNewTokens = 256, temperature = 0, topK = 0, seed, onToken } = {}) {
    const s = this.session;
    const previous = this.messages.slice(0, turn.messagesBefore);
    const target = this.renderIds(this.messages, true);
    const boundary = previous.length ? commonPrefix(this.renderIds(previous, false), target) : 0;
    const prompt = commonPrefix(this.renderIds(this.messages, false), target);
    if (target.length > s.maxContext) {
      if (turn.before) this.turns.push(turn);
      return { text: '', ids: [], stopped: 'context', historyIds: [...this.ids], prefillTokens: 0,
        notice: `the conversation needs ${target.length} tokens and a reply; the bundle's context is ${s.maxContext}: ` +
          'undo or reset the conversation, or export with a larger --max-context' };
    }
    const { logits: first, fed } = await this.#feed(target, [boundary, Math.max(boundary, Math.min(prompt, target.length - 1))], turn);
    const historyIds = [...this.ids];
    turn.idsBeforeReply = this.ids.length;
    const random = seed === undefined ? Math.random : seededRandom(seed);
    const out = [];
    let stopped = 'length';
    let notice;
    let logits = first;
    while (out.length < maxNewTokens) {
      const tok = sample(logits, { temperature, topK, random });
      out.push(tok);
      onToken?.(tok);
      if (this.stopIds.has(tok)) {
        stopped = 'eos';
        break;
      }
      if (out.length >= maxNewTokens) break;
      if (s.position >= s.maxContext) {
        stopped = 'context';
        notice = `the context is full (${s.maxContext} tokens): undo or reset the conversation, or export with a larger --max-context`;
        break;
      }
      logits = await s.decode(tok);
      this.ids.push(tok);
    }
    const text = s.decodeText(out.filter((t) => !this.stopIds.has(t)));
    this.messages.push({ role: 'assistant', content: text });
    this.turns.push(turn);
    for (const t of this.turns.slice(0, -KEEP_TURNS)) t.before = t.beforeReply = null;
    return { text, ids: out, stopped, historyIds, prefillTokens: fed, notice };
  }

  // Make the state hold `target`, feeding only what it lacks; take the turn's checkpoints at `marks` (where its own
  // tokens begin: undo; where its generation prompt begins: retry and a rewritten reply).
  async #feed(target, marks, turn) {
    const s = this.session;
    const common = commonPrefix(this.ids, target);
    if (common < this.ids.length || common >= target.length) {
      const cp = this.#latestCheckpoint(Math.min(common, target.length - 1), turn);
      if (cp) {
        s.restore(cp);
        this.ids.length = cp.position;
      } else {
        this.#forget();
      }
    }
    const start = this.ids.length;
    let logits = null;
    for (const [key, at] of [['before', marks[0]], ['beforeReply', marks[1]]]) {
      if (this.ids.length < at) {
        logits = await s.prefill(target.slice(this.ids.length, at));
        this.ids.push(...target.slice(this.ids.length, at));
      }
      const cp = turn[key];
      const kept = cp && s.canRestore(cp) && cp.position === this.ids.length;
      if (this.ids.length === at && !kept) turn[key] = await s.checkpoint();
      else if (!kept && cp && !s.canRestore(cp)) turn[key] = null;
    }
    if (this.ids.length < target.length) {
      logits = await s.prefill(target.slice(this.ids.length));
      this.ids.push(...target.slice(this.ids.length));
    }
    return { logits, fed: target.length - start };
  }

  #latestCheckpoint(limit, turn) {
    let best = null;
    for (const t of [...this.turns, turn]) {
      for (const cp of [t.before, t.beforeReply]) {
        if (cp && cp.position <= limit && this.session.canRestore(cp) && (!best || cp.position > best.position)) best = cp;
      }
    }
    return best;
  }

  /**
   * The conversation as one file (bytes): the safetensors layout of deltaship's saved chat sessions
   * (docs/bundle-format.md): tensors `state/<name>` (DeltaNet states whole, KV caches up to the position) and
   * `checkpoint/<i>/<name>`, and the JSON metadata with each tensor's sha256. Keep it in IndexedDB or a file.
   * @returns {Promise<Uint8Array>}
   */
  async save() {
    const s = this.session;
    const tensors = {};
    for (const st of s.plan.states) tensors[`state/${st.name}`] = await stateForFile(s, st);
    const checkpoints = [];
    let last = null;
    const t = this.turns.at(-1);
    if (t) {
      const names = {};
      for (const [key, cp] of [['before', t.before], ['before_reply', t.beforeReply]]) {
        if (!cp || !s.canRestore(cp)) {
          names[key] = null;
          continue;
        }
        names[key] = checkpoints.length;
        for (const st of s.deltanetStates()) {
          tensors[`checkpoint/${checkpoints.length}/${st.name}`] = { dtype: st.dtype, shape: st.shape, data: cp.states[st.name] };
        }
        checkpoints.push({ position: cp.position });
      }
      last = { messages_before: t.messagesBefore, ids_before_reply: t.idsBeforeReply ?? 0, ...names };
    }
    const meta = {
      format: SESSION_FORMAT,
      version: SESSION_VERSION,
      bundle: { files_sha256: await filesIdentity(s.manifest), target: s.manifest.target },
      position: s.position,
      ids: [...this.ids],
      system: this.system,
      template_kwargs: this.templateKwargs,
      messages: this.messages.map((m) => ({ ...m })),
      checkpoints,
      last_turn: last,
      tensors: {},
    };
    for (const [name, a] of Object.entries(tensors)) {
      meta.tensors[name] = { dtype: a.dtype, shape: a.shape, sha256: await sha256Hex(bytesOf(a.data)) };
    }
    return writeSafetensors(tensors, meta);
  }

  /**
   * A conversation saved by `save` (or by deltaship's Python chat: `Chat.save`, `--session`), on a session of
   * the same bundle; every hash, dtype and shape is checked before the session is touched.
   * @param {import('./core.js').Session} session
   * @param {Uint8Array|ArrayBuffer} bytes
   * @param {{pieces: object, promptCache?: Uint8Array|null, manifestBytes?: Uint8Array}} opts manifestBytes: the
   *   bundle's manifest.json, to load a `deltaship chat --session` file (it names the bundle by that file's sha256)
   */
  static async load(session, bytes, opts) {
    const { meta, tensors } = await readSessionBytes(bytes, 'the saved chat');
    await checkIdentity(meta, session, 'the saved chat', opts.manifestBytes);
    const chat = new Chat(session, { ...opts, system: meta.system, thinking: meta.template_kwargs?.enable_thinking !== false });
    loadState(session, meta.position, tensors, 'the saved chat');
    chat.ids = [...meta.ids];
    chat.messages = meta.messages.map((m) => ({ ...m }));
    if (meta.last_turn) {
      const cp = (i) => {
        if (i === null || i === undefined) return null;
        const states = {};
        for (const st of session.deltanetStates()) states[st.name] = tensors[`checkpoint/${i}/${st.name}`].data;
        return { position: meta.checkpoints[i].position, states, owner: session, serial: session.rewinds.length };
      };
      chat.turns = [{ messagesBefore: meta.last_turn.messages_before, before: cp(meta.last_turn.before),
        beforeReply: cp(meta.last_turn.before_reply), idsBeforeReply: meta.last_turn.ids_before_reply }];
    }
    return chat;
  }
}

// ---- the file format: safetensors (8-byte little-endian header length, JSON header, raw little-endian data) ----
const ST_DTYPES = { float32: ['F32', Float32Array], float16: ['F16', Uint16Array], int8: ['I8', Int8Array], uint8: ['U8', Uint8Array] };
const FROM_ST = Object.fromEntries(Object.entries(ST_DTYPES).map(([k, [code]]) => [code, k]));
const MAX_HEADER = 100 << 20;

function bytesOf(typed) {
  return new Uint8Array(typed.buffer, typed.byteOffset, typed.byteLength);
}

export async function sha256Hex(bytes) {
  const digest = await globalThis.crypto.subtle.digest('SHA-256', bytes);
  return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, '0')).join('');
}

/** The bundle's identity a shipped prompt cache names: sha256 over its files and their sha256, the cache left out. */
export async function filesIdentity(manifest) {
  const rows = Object.entries(manifest.files ?? {}).filter(([p]) => p !== PROMPT_CACHE_FILE)
    .map(([p, f]) => [p, f.sha256]).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  return sha256Hex(new TextEncoder().encode(JSON.stringify(rows)));
}

function seqAxis(session, st) {
  const axis = st.shape.findIndex((d, i) => i >= 1 && d === session.maxContext);
  if (axis < 0) throw new DeltashipError(`state ${st.name} ${JSON.stringify(st.shape)} has no axis of the max context`, 'export the bundle again');
  return axis;
}

// A state as the file keeps it: DeltaNet whole, a KV cache's first `position` rows along its sequence axis.
async function stateForFile(session, st) {
  const t = session.states[st.name];
  const data = t.location === 'gpu-buffer' ? await t.getData() : t.data;
  if (!String(st.kind).startsWith('kv_cache')) return { dtype: st.dtype, shape: st.shape, data: data.slice() };
  const axis = seqAxis(session, st);
  const outer = st.shape.slice(0, axis).reduce((a, b) => a * b, 1);
  const inner = st.shape.slice(axis + 1).reduce((a, b) => a * b, 1);
  const p = session.position;
  const out = new data.constructor(outer * p * inner);
  for (let o = 0; o < outer; o++) out.set(data.subarray(o * st.shape[axis] * inner, (o * st.shape[axis] + p) * inner), o * p * inner);
  return { dtype: st.dtype, shape: st.shape.map((d, i) => (i === axis ? p : d)), data: out };
}

function loadState(session, position, tensors, where) {
  const arrays = {};
  for (const st of session.plan.states) {
    const a = tensors[`state/${st.name}`];
    if (!a) throw new DeltashipError(`${where}: no tensor state/${st.name}`, 'use a file saved for this bundle');
    if (!String(st.kind).startsWith('kv_cache')) {
      arrays[st.name] = a.data;
      continue;
    }
    const axis = seqAxis(session, st);
    const outer = st.shape.slice(0, axis).reduce((x, y) => x * y, 1);
    const inner = st.shape.slice(axis + 1).reduce((x, y) => x * y, 1);
    const full = new a.data.constructor(st.shape.reduce((x, y) => x * y, 1));
    for (let o = 0; o < outer; o++) full.set(a.data.subarray(o * position * inner, (o + 1) * position * inner), o * st.shape[axis] * inner);
    arrays[st.name] = full;
  }
  for (const st of session.plan.states) {
    const a = tensors[`state/${st.name}`];
    const want = String(st.kind).startsWith('kv_cache') ? st.shape.map((d, i) => (i === seqAxis(session, st) ? position : d)) : st.shape;
    if (a.dtype !== st.dtype || JSON.stringify(a.shape) !== JSON.stringify(want)) {
      throw new DeltashipError(`${where}: state/${st.name} is ${a.dtype} ${JSON.stringify(a.shape)}, the bundle's is ${st.dtype} ${JSON.stringify(want)}`,
        'use a file saved for this bundle');
    }
  }
  session.reset();
  session.writeStates(arrays);
  session.position = position;
}

function writeSafetensors(tensors, meta) {
  const text = JSON.stringify(meta);
  return sha256Hex(new TextEncoder().encode(text)).then((sha) => {
    const header = { __metadata__: { deltaship_chat: text, deltaship_chat_sha256: sha } };
    let offset = 0;
    const names = Object.keys(tensors).sort();
    for (const name of names) {
      const a = tensors[name];
      header[name] = { dtype: ST_DTYPES[a.dtype][0], shape: a.shape, data_offsets: [offset, offset + a.data.byteLength] };
      offset += a.data.byteLength;
    }
    let json = new TextEncoder().encode(JSON.stringify(header));
    const pad = (8 - (json.length % 8)) % 8;
    json = new TextEncoder().encode(JSON.stringify(header) + ' '.repeat(pad));
    const out = new Uint8Array(8 + json.length + offset);
    new DataView(out.buffer).setBigUint64(0, BigInt(json.length), true);
    out.set(json, 8);
    let at = 8 + json.length;
    for (const name of names) {
      out.set(bytesOf(tensors[name].data), at);
      at += tensors[name].data.byteLength;
    }
    return out;
  });
}

/**
 * Parse and check a saved chat session / prompt cache: the header, the metadata's sha256, each tensor's dtype,
 * shape and sha256. Returns {meta, tensors: {name: {dtype, shape, data}}}.
 */
export async function readSessionBytes(input, where) {
  const bytes = input instanceof Uint8Array ? input : new Uint8Array(input);
  const bad = (what) => new DeltashipError(`${where}: ${what}; nothing was loaded`, 'load a session saved by deltaship chat for this bundle');
  if (bytes.length < 8) throw bad('not a safetensors file (shorter than its header length)');
  const n = Number(new DataView(bytes.buffer, bytes.byteOffset).getBigUint64(0, true));
  if (n > MAX_HEADER || 8 + n > bytes.length) throw bad('not a safetensors file (its header length is past the end)');
  let header;
  try {
    header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + n)));
  } catch {
    throw bad('its header is not JSON');
  }
  const text = header.__metadata__?.deltaship_chat;
  if (typeof text !== 'string') throw bad('a safetensors file without deltaship chat metadata');
  if (await sha256Hex(new TextEncoder().encode(text)) !== header.__metadata__.deltaship_chat_sha256) {
    throw bad('its metadata does not match its sha256 (the file was altered)');
  }
  const meta = JSON.parse(text);
  if (meta.format !== SESSION_FORMAT || !(meta.version <= SESSION_VERSION)) throw bad(`not a ${SESSION_FORMAT} file of version <= ${SESSION_VERSION}`);
  const tensors = {};
  const data = bytes.subarray(8 + n);
  for (const [name, entry] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const dtype = FROM_ST[entry.dtype];
    const want = meta.tensors?.[name];
    const [a, b] = entry.data_offsets ?? [];
    if (!dtype || !want || want.dtype !== dtype || JSON.stringify(want.shape) !== JSON.stringify(entry.shape)
        || !(0 <= a && a <= b && b <= data.length)) {
      throw bad(`tensor ${name} does not match its metadata`);
    }
    const raw = Uint8Array.prototype.slice.call(data, a, b); // a copy, aligned (a node Buffer's slice is a view)
    if (await sha256Hex(raw) !== want.sha256) throw bad(`tensor ${name} does not match its sha256 (the file was altered)`);
    const Typed = ST_DTYPES[dtype][1];
    tensors[name] = { dtype, shape: entry.shape, data: new Typed(raw.buffer, 0, raw.byteLength / Typed.BYTES_PER_ELEMENT) };
  }
  if (Object.keys(tensors).length !== Object.keys(meta.tensors ?? {}).length) throw bad('its tensors do not match its metadata');
  return { meta, tensors };
}

// A file names its bundle by files_sha256 (JS saves, prompt caches) or manifest_sha256 (`deltaship chat --session`
// files): the latter is checked against the bytes of the bundle's manifest.json, when the caller passes them.
async function checkIdentity(meta, session, where, manifestBytes = null) {
  const byManifest = meta.bundle?.manifest_sha256 !== undefined;
  if (byManifest && !manifestBytes) {
    throw new DeltashipError(`${where}: names its bundle by the sha256 of manifest.json (a deltaship chat --session file)`,
      'pass manifestBytes (the bytes of the bundle\'s manifest.json) to Chat.load');
  }
  const [key, have] = byManifest ? ['manifest_sha256', await sha256Hex(manifestBytes)] : ['files_sha256', await filesIdentity(session.manifest)];
  const got = meta.bundle?.[key];
  if (got !== have) {
    throw new DeltashipError(`${where}: saved with another bundle (${key.replace('_', ' ')} ${String(got).slice(0, 12)}..., this one ${have.slice(0, 12)}...)`,
      'load it with the bundle it was saved with');
  }
}

#!/usr/bin/env node
// Chat with a deltaship ONNX bundle in node, the line protocol of `deltaship chat`: each stdin line is a user
// message; /retry, /undo, /reset, /save and /load [FILE] are commands. --json prints one object per turn
// ({command, reply, reply_ids, history_ids, prefill_tokens, stopped}) and per command.
//   node examples/chat.mjs BUNDLE_DIR --pieces chat.json [--session FILE] [--system TEXT] [--no-thinking]
//        [--max-new-tokens N] [--json]
// chat.json: what `deltaship app` writes beside the bundle (`pieces`: the chat template per role).
// A line of input is data, not a command line: /save writes only to --session (as `deltaship chat` does), which may
// not lie inside a bundle nor be an existing file that is not a session of this bundle.
import { lstat, readFile, rename, stat, writeFile } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { parseArgs } from 'node:util';
import { Chat, PROMPT_CACHE_FILE, openBundle } from '../src/node.js';
import { inside } from '../src/files.js';
import { DeltashipError } from '../src/core.js';
import { filesIdentity, readSessionBytes, sha256Hex } from '../src/chat.js';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    pieces: { type: 'string' },
    system: { type: 'string' },
    'no-thinking': { type: 'boolean', default: false },
    'max-new-tokens': { type: 'string', default: '256' },
    json: { type: 'boolean', default: false },
    session: { type: 'string' },
    'check-state': { type: 'boolean', default: false },
  },
});
if (positionals.length !== 1 || !values.pieces) {
  console.error('usage: node examples/chat.mjs BUNDLE_DIR --pieces chat.json [--system TEXT] [--json]');
  process.exit(2);
}
const [dir] = positionals;
let chat;
let fresh = null; // --check-state: a second session, fed chat.ids from zero after every command
const print = async (o) => {
  if (fresh) {
    fresh.reset();
    if (chat.ids.length) await fresh.prefill(chat.ids);
    let diff = chat.session.position === chat.ids.length ? 0 : Infinity;
    for (const st of fresh.deltanetStates()) {
      const a = chat.session.states[st.name].data;
      const b = fresh.states[st.name].data;
      for (let i = 0; i < a.length; i++) diff = Math.max(diff, Math.abs(a[i] - b[i]));
    }
    o.state_diff = diff; // the chat's DeltaNet states against a fresh prefill of everything it holds
  }
  console.log(values.json ? JSON.stringify(o) : (o.reply ?? `(${o.command})`));
};
const exists = async (p) => { try { await lstat(p); return true; } catch { return false; } };

// Where /save may write: the --session file only, never inside a bundle (any directory above it holding a
// manifest.json), never over a file that is not a saved session of this bundle.
async function saveTarget(arg, session, opts) {
  const fix = 'pass --session FILE (a new file outside any bundle, or a session of this bundle) and use /save alone';
  if (!values.session) throw new DeltashipError('/save: no --session file to save to', fix);
  if (arg && resolve(arg) !== resolve(values.session)) {
    throw new DeltashipError(`/save ${arg}: a piped conversation saves only to its --session file, never to a path its input names`, fix);
  }
  const target = resolve(values.session);
  for (let d = dirname(target); ; d = dirname(d)) {
    if (await exists(join(d, 'manifest.json'))) {
      throw new DeltashipError(`${values.session}: inside the bundle ${d}; a chat writes nothing into a bundle`, fix);
    }
    if (dirname(d) === d) break;
  }
  if (await exists(target)) {
    const st = await lstat(target);
    let ours = st.isFile();
    if (ours) {
      try { // its metadata names this bundle's manifest (read only: the chat's state is not touched)
        const { meta } = await readSessionBytes(await readFile(target), target);
        ours = meta.bundle?.manifest_sha256 === await sha256Hex(opts.manifestBytes)
          || meta.bundle?.files_sha256 === await filesIdentity(session.manifest); // Python's, or this kit's
      } catch { ours = false; }
    }
    if (!ours) throw new DeltashipError(`${values.session}: exists and is not a saved chat session of this bundle; nothing was written`, fix);
  }
  return target;
}

async function saveTo(target, bytes) { // whole or not at all: a private file beside it, renamed over it
  const tmp = join(dirname(target), `.${target.split('/').pop()}.partial-${process.pid}`);
  await writeFile(tmp, bytes, { mode: 0o600 });
  await rename(tmp, target);
  await stat(target);
}

try {
  const session = await openBundle(dir, { threads: 1 });
  const { pieces } = JSON.parse(await readFile(values.pieces, 'utf8'));
  const cached = Object.hasOwn(session.manifest.files, PROMPT_CACHE_FILE)
    ? await readFile(await inside(dir, PROMPT_CACHE_FILE, 'chat.prompt_cache.file')) // inside the bundle, symlinks followed
    : null;
  const system = values.system ?? session.manifest.chat?.prompt_cache?.system ?? null;
  const manifestBytes = await readFile(join(dir, 'manifest.json'));
  const opts = { pieces, promptCache: cached, thinking: !values['no-thinking'], manifestBytes };
  if (values['check-state']) fresh = await openBundle(dir, { threads: 1 });
  chat = await Chat.create(session, { ...opts, system });
  const gen = { maxNewTokens: Number(values['max-new-tokens']) };
  const turn = (command, r) => print({ command, reply: r.text, reply_ids: r.ids, history_ids: r.historyIds,
    prefill_tokens: r.prefillTokens, stopped: r.stopped });
  for await (const line of createInterface({ input: process.stdin })) {
    const [cmd, ...rest] = line.split(' ');
    if (cmd === '/retry') await turn('retry', await chat.retry(gen));
    else if (cmd === '/undo') { await chat.undo(); await print({ command: 'undo', history_tokens: chat.ids.length }); }
    else if (cmd === '/reset') { await chat.reset(); await print({ command: 'reset', history_tokens: chat.ids.length }); }
    else if (cmd === '/save') {
      await saveTo(await saveTarget(rest.join(' '), session, opts), await chat.save());
      await print({ command: 'save', history_tokens: chat.ids.length });
    } else if (cmd === '/load') {
      const from = rest.join(' ') || values.session;
      if (!from) throw new DeltashipError('/load: no file named and no --session', 'pass --session FILE, or /load FILE');
      chat = await Chat.load(session, await readFile(from), opts);
      await print({ command: 'load', history_tokens: chat.ids.length });
    } else await turn('send', await chat.send(line, gen));
  }
} catch (e) {
  console.error(e.message);
  process.exit(e.name === 'DeltashipError' ? 1 : 3);
}

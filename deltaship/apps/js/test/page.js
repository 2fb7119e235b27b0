// Query: ?bundle=URL&ep=wasm|webgpu&n=24&prompts=<JSON list of strings>. Reports {results | error} to POST /result.
// With &chat=<JSON {pieces, system, script}>: runs the script as examples/chat.mjs does (a line is a message;
// /retry, /undo, /reset, /save, /load: the conversation saved to bytes in memory and loaded back) and reports
// {records}, each with state_diff: the chat's DeltaNet states against a fresh prefill of what it holds.
import { Chat, openBundle } from '../src/web.js';

const q = new URLSearchParams(location.search);
let report;
try {
  const ep = q.get('ep') ?? 'wasm';
  const ort = ep === 'webgpu' ? await import('onnxruntime-web/webgpu') : await import('onnxruntime-web');
  ort.env.wasm.numThreads = 1; // no cross-origin isolation on the test server: no wasm threads
  const session = await openBundle(q.get('bundle'), { executionProvider: ep, ort });
  if (q.get('chat')) {
    report = { records: await runChat(session, ort, ep) };
  } else {
  const results = [];
  for (const prompt of JSON.parse(q.get('prompts'))) {
    session.reset();
    results.push(await session.generate(prompt, { maxNewTokens: Number(q.get('n') ?? 24) }));
  }
  // Where the states live after the last call: 'gpu-buffer' on WebGPU, 'cpu' on wasm.
  const locations = [...new Set(Object.values(session.states).map((t) => t.location))];
  report = { results, locations, adapter: ep === 'webgpu' ? await adapterInfo() : null };
  }
} catch (e) {
  report = { error: String(e?.message ?? e) };
}
document.getElementById('result').textContent = JSON.stringify(report);
await fetch('/result', { method: 'POST', body: JSON.stringify(report) });

async function adapterInfo() {
  const a = await navigator.gpu.requestAdapter();
  const i = a?.info ?? {};
  return { vendor: i.vendor, architecture: i.architecture, description: i.description };
}

async function runChat(session, ort, ep) {
  const { pieces, system, script } = JSON.parse(q.get('chat'));
  const fresh = await openBundle(q.get('bundle'), { executionProvider: ep, ort });
  const gen = { maxNewTokens: Number(q.get('n') ?? 10) };
  let chat = await Chat.create(session, { pieces, system });
  let saved = null;
  const records = [];
  const record = async (o) => {
    fresh.reset();
    if (chat.ids.length) await fresh.prefill(chat.ids);
    let diff = session.position === chat.ids.length ? 0 : Infinity;
    for (const st of fresh.deltanetStates()) {
      const a = session.states[st.name].data;
      const b = fresh.states[st.name].data;
      for (let i = 0; i < a.length; i++) diff = Math.max(diff, Math.abs(a[i] - b[i]));
    }
    records.push({ ...o, state_diff: diff });
  };
  const turn = (command, r) => record({ command, reply: r.text, reply_ids: r.ids, history_ids: r.historyIds,
    prefill_tokens: r.prefillTokens, stopped: r.stopped });
  for (const line of script) {
    if (line === '/retry') await turn('retry', await chat.retry(gen));
    else if (line === '/undo') { await chat.undo(); await record({ command: 'undo', history_tokens: chat.ids.length }); }
    else if (line === '/reset') { await chat.reset(); await record({ command: 'reset', history_tokens: chat.ids.length }); }
    else if (line === '/save') { saved = new Blob([await chat.save()]); await record({ command: 'save', history_tokens: chat.ids.length }); }
    else if (line === '/load') {
      chat = await Chat.load(session, await saved.arrayBuffer(), { pieces });
      await record({ command: 'load', history_tokens: chat.ids.length });
    } else await turn('send', await chat.send(line, gen));
  }
  return records;
}

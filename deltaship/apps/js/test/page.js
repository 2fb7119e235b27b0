// Query: ?bundle=URL&ep=wasm|webgpu&n=24&prompts=<JSON list of strings>. Reports {results | error} to POST /result.
import { openBundle } from '../src/web.js';

const q = new URLSearchParams(location.search);
let report;
try {
  const ep = q.get('ep') ?? 'wasm';
  const ort = ep === 'webgpu' ? await import('onnxruntime-web/webgpu') : await import('onnxruntime-web');
  ort.env.wasm.numThreads = 1; // no cross-origin isolation on the test server: no wasm threads
  const session = await openBundle(q.get('bundle'), { executionProvider: ep, ort });
  const results = [];
  for (const prompt of JSON.parse(q.get('prompts'))) {
    session.reset();
    results.push(await session.generate(prompt, { maxNewTokens: Number(q.get('n') ?? 24) }));
  }
  // Where the states live after the last call: 'gpu-buffer' on WebGPU, 'cpu' on wasm.
  const locations = [...new Set(Object.values(session.states).map((t) => t.location))];
  report = { results, locations, adapter: ep === 'webgpu' ? await adapterInfo() : null };
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

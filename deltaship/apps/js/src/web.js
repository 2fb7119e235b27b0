// The browser: files fetched from the URL the bundle is served at, onnxruntime-web (wasm or WebGPU).
import * as ortWeb from 'onnxruntime-web';
import { Tokenizer } from '@huggingface/tokenizers';
import { DeltashipError, Session, checkManifest, modelFiles } from './core.js';

export { DeltashipError, Session, sample, checkManifest, ioPlan, SCHEMA_VERSIONS } from './core.js';

async function fetchJson(url, what, fix) {
  let res;
  try {
    res = await fetch(url);
  } catch (e) {
    throw new DeltashipError(`${url}: cannot fetch ${what} (${e.message})`, fix);
  }
  if (!res.ok) throw new DeltashipError(`${url}: cannot fetch ${what} (HTTP ${res.status})`, fix);
  try {
    return await res.json();
  } catch (e) {
    throw new DeltashipError(`${url}: ${what} is not valid JSON (${e.message})`, fix);
  }
}

/**
 * Open an ONNX bundle served at `url` (the directory holding manifest.json, model.onnx, tokenizer files).
 *
 * executionProvider 'wasm' runs on the CPU; 'webgpu' runs on the GPU and keeps every state (present.*
 * outputs, fed back as past.* inputs) in GPU buffers between calls, so only token ids, the position and
 * the logits cross to the CPU. Weights in external data (model.onnx.data) are passed to ONNX Runtime
 * with the `externalData` session option (needed for models over 2 GB).
 * @param {string} url bundle URL, relative to the page or absolute
 * @param {{executionProvider?: 'wasm'|'webgpu', ort?: object, sessionOptions?: object}} [opts]
 *   ort: an onnxruntime-web module to use instead of the one this package imports
 * @returns {Promise<Session>}
 */
export async function openBundle(url, { executionProvider = 'wasm', ort = ortWeb, sessionOptions = {} } = {}) {
  const base = new URL(url.endsWith('/') ? url : `${url}/`, globalThis.location?.href).href;
  const again = 'serve the directory written by `deltaship export --target onnx --out DIR` at this URL (or export it again)';
  const manifest = checkManifest(await fetchJson(`${base}manifest.json`, 'the bundle manifest', again), base);
  const { entry, externalData } = modelFiles(manifest);
  let tokenizer = null;
  if ((manifest.tokenizer?.files ?? []).includes('tokenizer.json')) {
    tokenizer = new Tokenizer(await fetchJson(`${base}tokenizer.json`, 'the tokenizer', again),
      await fetchJson(`${base}tokenizer_config.json`, 'the tokenizer config', again));
  }
  const options = { graphOptimizationLevel: 'all', executionProviders: [executionProvider], ...sessionOptions };
  if (externalData.length) options.externalData = externalData.map((path) => ({ path, data: `${base}${path}` }));
  const webgpu = executionProvider === 'webgpu';
  if (webgpu) {
    if (!globalThis.navigator?.gpu) {
      throw new DeltashipError('this browser exposes no WebGPU (navigator.gpu is undefined)',
        "use executionProvider: 'wasm', or a browser with WebGPU enabled (Chrome 113+; on Linux --enable-unsafe-webgpu)");
    }
    options.preferredOutputLocation = Object.fromEntries(manifest.states.map((s) => [s.output, 'gpu-buffer']));
  }
  let session;
  try {
    session = await ort.InferenceSession.create(`${base}${entry}`, options);
  } catch (e) {
    throw new DeltashipError(`${base}${entry}: onnxruntime-web (${executionProvider}) could not load the model: ${e.message ?? e}`,
      'export the bundle again with this version of deltaship; for WebGPU a float16 bundle needs a GPU with shader-f16');
  }
  return new Session({ ort, session, manifest, tokenizer, gpuStates: webgpu });
}

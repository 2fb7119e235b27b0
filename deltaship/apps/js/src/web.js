// The browser: files fetched from the URL the bundle is served at, onnxruntime-web (wasm or WebGPU).
import { Tokenizer } from '@huggingface/tokenizers';
import { DeltashipError, Session, checkManifest, modelFiles, safePath } from './core.js';

export { DeltashipError, Session, sample, checkManifest, ioPlan, SCHEMA_VERSIONS } from './core.js';
export { Chat, renderChat, readSessionBytes, PROMPT_CACHE_FILE } from './chat.js';

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
 *   ort: the onnxruntime-web module to use (default: import('onnxruntime-web/webgpu') for WebGPU,
 *   import('onnxruntime-web') for wasm); pass your own to set ort.env first (e.g. ort.env.wasm.numThreads)
 * @returns {Promise<Session>}
 */
export async function openBundle(url, { executionProvider = 'wasm', ort, sessionOptions = {} } = {}) {
  // 'onnxruntime-web/webgpu' is the build with ONNX Runtime's native WebGPU provider, whose GroupQueryAttention
  // updates a static KV cache in place; the default build's (JSEP) GroupQueryAttention cannot.
  ort ??= executionProvider === 'webgpu' ? await import('onnxruntime-web/webgpu') : await import('onnxruntime-web');
  const base = new URL(url.endsWith('/') ? url : `${url}/`, globalThis.location?.href).href;
  const again = 'serve the directory written by `deltaship export --target onnx --out DIR` at this URL (or export it again)';
  const manifest = checkManifest(await fetchJson(`${base}manifest.json`, 'the bundle manifest', again), base);
  const { entry, externalData } = modelFiles(manifest); // every name checked by checkManifest: inside `base`
  let tokenizer = null;
  if ((manifest.tokenizer?.files ?? []).includes('tokenizer.json')) {
    const url = (name) => `${base}${safePath(manifest, name, 'tokenizer.files', base)}`;
    tokenizer = new Tokenizer(await fetchJson(url('tokenizer.json'), 'the tokenizer', again),
      await fetchJson(url('tokenizer_config.json'), 'the tokenizer config', again));
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
  return new Session({ ort, session, manifest, tokenizer, sharedState: webgpu ? kvCacheBuffer(ort) : null });
}

// ONNX Runtime's WebGPU GroupQueryAttention writes new positions into the static KV cache only when past and
// present are one buffer; given two, it makes present one call longer than the graph's static shape, which
// the next call refuses. So each KV-cache state is one GPU buffer, fed as past.* and preallocated as present.*.
function kvCacheBuffer(ort) {
  const bytes = { float32: 4, float16: 2 };
  return (state) => {
    if (!state.kind?.startsWith('kv_cache')) return null;
    const device = ort.env.webgpu.device;
    const size = state.shape.reduce((a, b) => a * b, 1) * bytes[state.dtype];
    // WebGPU zero-fills new buffers: the manifest's "zeros" init.
    const buffer = device.createBuffer({
      size: Math.ceil(size / 16) * 16,
      usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST,
    });
    return ort.Tensor.fromGpuBuffer(buffer, { dataType: state.dtype, dims: state.shape, dispose: () => buffer.destroy() });
  };
}

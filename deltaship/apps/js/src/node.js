// Node (and Electron's main process): files from a bundle directory, onnxruntime-node (CPU).
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import * as ort from 'onnxruntime-node';
import { Tokenizer } from '@huggingface/tokenizers';
import { DeltashipError, Session, checkManifest, modelFiles, safePath } from './core.js';
import { inside } from './files.js';

export { DeltashipError, Session, sample, checkManifest, ioPlan, SCHEMA_VERSIONS } from './core.js';
export { Chat, renderChat, readSessionBytes, PROMPT_CACHE_FILE } from './chat.js';

async function readJson(path, what, fix) {
  let text;
  try {
    text = await readFile(path, 'utf8');
  } catch (e) {
    throw new DeltashipError(`${path}: cannot read ${what} (${e.code ?? e.message})`, fix);
  }
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new DeltashipError(`${path}: ${what} is not valid JSON (${e.message})`, fix);
  }
}

/**
 * Open an ONNX bundle directory written by `deltaship export --target onnx --out DIR`.
 * Weights in external data (model.onnx.data beside model.onnx) are found by ONNX Runtime itself.
 * @param {string} dir bundle directory
 * @param {{threads?: number, sessionOptions?: object}} [opts] threads: intra-op threads (default: ONNX Runtime's)
 * @returns {Promise<Session>}
 */
export async function openBundle(dir, { threads, sessionOptions = {} } = {}) {
  const again = 'pass the directory written by `deltaship export --target onnx --out DIR` (or export it again)';
  const manifest = checkManifest(await readJson(join(dir, 'manifest.json'), 'the bundle manifest', again), dir);
  const { entry, externalData } = modelFiles(manifest);
  for (const name of externalData) await inside(dir, name, 'files'); // ONNX Runtime opens them beside the entry
  const entryPath = await inside(dir, entry, 'entry');
  let tokenizer = null;
  if ((manifest.tokenizer?.files ?? []).includes('tokenizer.json')) {
    const path = (name) => inside(dir, safePath(manifest, name, 'tokenizer.files', dir), 'tokenizer.files');
    const tj = await readJson(await path('tokenizer.json'), 'the tokenizer', again);
    const tc = await readJson(await path('tokenizer_config.json'), 'the tokenizer config', again);
    tokenizer = new Tokenizer(tj, tc);
  }
  const options = { graphOptimizationLevel: 'all', ...sessionOptions };
  if (threads) Object.assign(options, { intraOpNumThreads: threads, interOpNumThreads: 1 });
  let session;
  try {
    session = await ort.InferenceSession.create(entryPath, options);
  } catch (e) {
    throw new DeltashipError(`${entryPath}: onnxruntime-node could not load the model: ${e.message}`,
      'export the bundle again with this version of deltaship (and check onnxruntime-node is the version in package.json)');
  }
  return new Session({ ort, session, manifest, tokenizer });
}

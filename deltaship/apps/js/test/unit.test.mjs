// The driver's I/O contract against a fake ONNX Runtime session that checks every feed: the three position
// forms (the sequence-length pair, `position` [1] and `position_ids` [1, T]), logits of rank 2 and 3, chunking, state feedback,
// and the refusals. Run: node --test test/unit.test.mjs
import { test } from 'node:test';
import assert from 'node:assert/strict';
import * as ort from 'onnxruntime-node';
import { Session, checkManifest, ioPlan, modelFiles, sample, seededRandom } from '../src/core.js';

const V = 16;

const POSITION_INPUTS = {
  counts: [
    { name: 'current_sequence_length', shape: [1], dtype: 'int32', kind: 'current_sequence_length' },
    { name: 'past_sequence_length', shape: [1, 1], dtype: 'int32', kind: 'past_sequence_length' },
  ],
  ids: [{ name: 'position_ids', shape: [1, 'tokens'], dtype: 'int64', kind: 'position_ids' }],
  start: [{ name: 'position', shape: [1], dtype: 'int64', kind: 'position' }],
};

function manifest({ positions = 'start', logitsRank = 2, chunk = 4 } = {}) {
  return {
    schema: 'deltaship.bundle', schema_version: 1, target: 'onnx', entry: 'model.onnx',
    model: { vocab_size: V }, max_context: 64, prefill_chunk: chunk, tokens: { eos: [15] },
    files: { 'model.onnx': {}, 'model.onnx.data': {}, 'tokenizer.json': {}, 'tokenizer_config.json': {} },
    tokenizer: { files: ['tokenizer.json', 'tokenizer_config.json'] },
    inputs: [
      { name: 'input_ids', shape: [1, 'tokens'], dtype: 'int64', kind: 'tokens' },
      ...POSITION_INPUTS[positions],
    ],
    outputs: [{ name: 'logits', shape: logitsRank === 2 ? [1, V] : [1, 1, V], dtype: 'float32', kind: 'logits' }],
    states: [{ name: 'past.0.count', output: 'present.0.count', shape: [1, 2], dtype: 'float32', init: 'zeros' }],
  };
}

// A model whose state counts the tokens it has seen and whose logits pick (last token + position + 1) % V,
// so a wrong position, a dropped state or the wrong logits row changes the tokens.
function fakeSession(m, calls) {
  const pos = m.inputs[1];
  return {
    inputNames: [...m.inputs.map((i) => i.name), 'past.0.count'],
    // outputs beyond the logits and the states, as an --mtp bundle has: the driver must not fetch them
    outputNames: ['logits', 'present.0.count', 'logits_rows', 'hidden_states', 'rollback.0.count'],
    async run(feeds, fetches) {
      const ids = Array.from(feeds.input_ids.data, Number);
      const T = ids.length;
      assert.deepEqual(feeds.input_ids.dims, [1, T]);
      let start;
      if (pos.name === 'current_sequence_length') {
        assert.equal(feeds.current_sequence_length.type, 'int32');
        assert.deepEqual(feeds.current_sequence_length.dims, [1]);
        assert.deepEqual(feeds.past_sequence_length.dims, [1, 1]);
        const end = feeds.current_sequence_length.data[0];
        assert.equal(feeds.past_sequence_length.data[0], end - 1);
        start = end - T;
      } else if (pos.name === 'position_ids') {
        assert.deepEqual(feeds.position_ids.dims, [1, T]);
        start = Number(feeds.position_ids.data[0]);
        assert.deepEqual(Array.from(feeds.position_ids.data, Number), ids.map((_, i) => start + i));
      } else {
        assert.deepEqual(feeds.position.dims, [1]);
        start = Number(feeds.position.data[0]);
      }
      const seen = feeds['past.0.count'].data[0];
      assert.equal(seen, start, 'the state holds as many tokens as the position says');
      calls.push({ T, start, fetches });
      const rows = m.outputs[0].shape.length === 2 ? 1 : T; // rank 3: every row present, the last one counts
      const logits = new Float32Array(rows * V).fill(-1);
      logits[(rows - 1) * V + ((ids[T - 1] + start + T) % V)] = 1;
      const dims = m.outputs[0].shape.length === 2 ? [1, V] : [1, rows, V];
      return {
        logits: new ort.Tensor('float32', logits, dims),
        'present.0.count': new ort.Tensor('float32', Float32Array.of(seen + T, 0), [1, 2]),
      };
    },
    async release() {},
  };
}

function expected(prompt, n) {
  const out = [];
  let last = prompt[prompt.length - 1];
  let pos = prompt.length; // position of the token after `last`
  for (let i = 0; i < n; i++) {
    last = (last + pos) % V;
    out.push(last);
    pos += 1;
  }
  return out;
}

for (const positions of ['counts', 'start', 'ids']) {
  for (const logitsRank of [2, 3]) {
    test(`generate: positions as ${positions}, logits rank ${logitsRank}`, async () => {
      const m = manifest({ positions, logitsRank });
      const calls = [];
      const s = new Session({ ort, session: fakeSession(m, calls), manifest: m, tokenizer: null });
      const prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3];
      const r = await s.generate(prompt, { maxNewTokens: 5, stopAtEos: false });
      assert.deepEqual(r.outputIds, expected(prompt, 5));
      // 10 prompt tokens in chunks of 4, then one call per new token but the last
      assert.deepEqual(calls.map((c) => c.T), [4, 4, 2, 1, 1, 1, 1]);
      assert.deepEqual(calls.map((c) => c.start), [0, 4, 8, 10, 11, 12, 13]);
      // every call fetches the logits and the states only (each fetched output is copied out of the runtime)
      for (const c of calls) assert.deepEqual(c.fetches, ['logits', 'present.0.count']);
      s.reset();
      assert.deepEqual((await s.generate([7], { maxNewTokens: 3, stopAtEos: false })).outputIds, expected([7], 3));
    });
  }
}

test('stops after an end-of-sequence token and at the max context', async () => {
  const m = manifest();
  const s = new Session({ ort, session: fakeSession(m, []), manifest: m, tokenizer: null });
  // (14 + 1 + 0) % 16 = 15 = eos
  const r = await s.generate([14], { maxNewTokens: 5 });
  assert.deepEqual(r.outputIds, [15]);
  assert.equal(r.stopped, 'eos');
  s.reset();
  await assert.rejects(s.prefill(new Array(65).fill(1)), /exceed the bundle's max context of 64/);
  await assert.rejects(s.prefill([16]), /outside the vocabulary/);
});

test('refuses unknown schema versions, other targets and unknown inputs, naming the fix', () => {
  assert.equal(checkManifest({ ...manifest(), schema_version: 2 }, 'b').schema_version, 2); // 2 adds model_card only
  assert.throws(() => checkManifest({ ...manifest(), schema_version: 3 }, 'b'), /schema_version 3 .*\n  fix: export again with/);
  assert.throws(() => checkManifest({ ...manifest(), target: 'coreml' }, 'b'), /target is coreml.*\n  fix: export again with `deltaship export --target onnx/s);
  assert.throws(() => checkManifest({ schema: 'other' }, 'b'), /not a deltaship manifest/);
  const odd = manifest();
  odd.inputs.push({ name: 'attention_mask', shape: [1, 'tokens'], dtype: 'int64', kind: 'attention_mask' });
  assert.throws(() => ioPlan(odd), /attention_mask has kind "attention_mask"/);
});

test('external data files come from the manifest file list', () => {
  assert.deepEqual(modelFiles(manifest()), { entry: 'model.onnx', externalData: ['model.onnx.data'] });
});

test('sampling: greedy is the first maximum; top-k 1 is greedy; a seed repeats', () => {
  const logits = Float32Array.of(0, 3, 1, 3, -2);
  assert.equal(sample(logits), 1);
  assert.equal(sample(logits, { temperature: 0.7, topK: 1, random: seededRandom(1) }), 1);
  const draw = (seed) => {
    const random = seededRandom(seed);
    return Array.from({ length: 20 }, () => sample(logits, { temperature: 1, topK: 3, random }));
  };
  const a = draw(5);
  assert.deepEqual(a, draw(5));
  assert.ok(a.every((t) => [1, 2, 3].includes(t)), 'top-3 never draws outside the top 3');
  assert.ok(new Set(a).size > 1, 'temperature 1 is not greedy');
});

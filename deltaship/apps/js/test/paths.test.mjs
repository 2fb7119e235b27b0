// The bundle-path rule of the driver (deltaship/bundle/paths.py's, in JavaScript): a manifest naming a file
// outside the bundle, absolute, with `..`, or not listed in `files` is refused before any file is read, and the
// Node reader refuses a symlink out of the bundle. Needs no npm dependency. Run: node --test test/paths.test.mjs
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, mkdirSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { checkManifest, pathProblem } from '../src/core.js';
import { inside } from '../src/files.js';

function manifest(change = (m) => m) {
  const m = {
    schema: 'deltaship.bundle', schema_version: 2, target: 'onnx', entry: 'model.onnx',
    files: { 'model.onnx': {}, 'tokenizer.json': {}, 'tokenizer_config.json': {} },
    tokenizer: { files: ['tokenizer.json', 'tokenizer_config.json'] },
    states: [{ name: 'past.0.count', output: 'present.0.count', init: 'zeros' }],
  };
  change(m);
  return m;
}

test('a plain manifest passes', () => {
  assert.equal(checkManifest(manifest(), 'b').entry, 'model.onnx');
  assert.equal(pathProblem('model.mlpackage/Data/weights.bin'), null);
});

test('traversal, absolute and unlisted paths are refused, naming the field and the path', () => {
  const cases = [
    [(m) => { m.files['../../../../../../etc/passwd'] = {}; }, /files = "..\/..\/..\/..\/..\/..\/etc\/passwd" has a `..` component/],
    [(m) => { m.entry = '../other/model.onnx'; }, /entry = "..\/other\/model.onnx" has a `..` component/],
    [(m) => { m.entry = '/tmp/other/model.onnx'; }, /entry = "\/tmp\/other\/model.onnx" is an absolute path/],
    [(m) => { m.entry = 'C:/model.onnx'; }, /is an absolute path/],
    [(m) => { m.entry = 'a/./model.onnx'; }, /is not a normalized relative path/],
    [(m) => { m.entry = 'a\\..\\model.onnx'; }, /holds a NUL or backslash/],
    [(m) => { delete m.files['model.onnx']; }, /entry = "model.onnx" is not listed in `files`/],
    [(m) => { m.tokenizer.files.push('../x.json'); }, /tokenizer.files\[2\] = "..\/x.json" has a `..`/],
    [(m) => { m.entry = 7; }, /entry = 7 is not a file name/],
    [(m) => { m.files = []; }, /files is not an object/],
    [(m) => { m.entry = 'model$"x.onnx'; m.files[m.entry] = {}; }, /holds characters outside/],
  ];
  for (const [change, pattern] of cases) {
    assert.throws(() => checkManifest(manifest(change), 'b'), (e) => e.name === 'DeltashipError' && pattern.test(e.what)
      && /export the bundle again/.test(e.fix));
  }
});

test('the Node reader refuses a symlink out of the bundle', async () => {
  const root = mkdtempSync(join(tmpdir(), 'deltaship-paths-'));
  mkdirSync(join(root, 'outside'));
  writeFileSync(join(root, 'outside', 'model.onnx'), 'not a model');
  mkdirSync(join(root, 'b'));
  symlinkSync(join(root, 'outside', 'model.onnx'), join(root, 'b', 'model.onnx'));
  writeFileSync(join(root, 'b', 'tokenizer.json'), '{}');
  await assert.rejects(inside(join(root, 'b'), 'model.onnx', 'entry'), /entry = "model.onnx" resolves to .*outside the bundle/);
  assert.ok((await inside(join(root, 'b'), 'tokenizer.json', 'tokenizer.files')).endsWith('tokenizer.json'));
});

#!/usr/bin/env node
// Generate from a deltaship ONNX bundle in node (or Electron's main process), streaming tokens.
//   node examples/generate.mjs BUNDLE_DIR "prompt" ["another prompt" ...] [--max-new-tokens N] [--temperature T]
//        [--top-k K] [--seed S] [--threads N] [--json]
// --json prints one JSON object per prompt ({inputIds, outputIds, text, stopped}) instead of streaming text.
import { parseArgs } from 'node:util';
import { openBundle } from '../src/node.js';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    'max-new-tokens': { type: 'string', default: '32' },
    temperature: { type: 'string', default: '0' },
    'top-k': { type: 'string', default: '0' },
    seed: { type: 'string' },
    threads: { type: 'string' },
    json: { type: 'boolean', default: false },
  },
});
if (positionals.length < 2) {
  console.error('usage: node examples/generate.mjs BUNDLE_DIR "prompt" ... [--max-new-tokens N] [--json]');
  process.exit(2);
}
const [dir, ...prompts] = positionals;
try {
  const session = await openBundle(dir, { threads: values.threads ? Number(values.threads) : undefined });
  const opts = {
    maxNewTokens: Number(values['max-new-tokens']),
    temperature: Number(values.temperature),
    topK: Number(values['top-k']),
    seed: values.seed === undefined ? undefined : Number(values.seed),
  };
  for (const prompt of prompts) {
    session.reset();
    if (values.json) {
      console.log(JSON.stringify(await session.generate(prompt, opts)));
    } else {
      const ids = [];
      let shown = 0;
      process.stdout.write(prompt);
      for await (const tok of session.stream(prompt, opts)) {
        ids.push(tok);
        // Decode the whole output each time and print what is new: a byte-level token may be half of a
        // UTF-8 character (shown as U+FFFD until the rest arrives).
        const text = session.decodeText(ids);
        if (!text.endsWith('\uFFFD')) {
          process.stdout.write(text.slice(shown));
          shown = text.length;
        }
      }
      process.stdout.write('\n');
    }
  }
} catch (e) {
  console.error(e.message);
  process.exit(1);
}

"""The web and desktop (node / Electron) kits: the deltaship-runtime JS package plus a minimal example and a
README naming the bundle's own files, for an ONNX bundle.

    write_kit(bundle, out, "web")      -> deltaship-runtime/, index.html, main.js, bundle/, README.md
    write_kit(bundle, out, "desktop")  -> deltaship-runtime/, generate.mjs, bundle/, README.md
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

from deltaship.apps import export_for
from deltaship.bundle import read_manifest
from deltaship.chat.pieces import CHAT_RECORD, bundle_pieces
from deltaship.errors import DeltashipError
from deltaship.targets import a_bundle, on_platform

JS_PACKAGE = Path(__file__).parent / "js"
PLATFORMS = ("web", "desktop")
# What the kit copies of the package: the library, its package.json and README (not the tests, no node_modules).
_PACKAGE_FILES = ("package.json", "README.md")
# The npm packages each kit installs (at the versions deltaship-runtime pins): one node_modules at the kit's root,
# which deltaship-runtime/src finds by walking up, as node and the import map in index.html both do.
_KIT_DEPENDENCIES = {
    "web": ("onnxruntime-web", "onnxruntime-common", "@huggingface/tokenizers"),
    "desktop": ("onnxruntime-node", "onnxruntime-common", "@huggingface/tokenizers"),
}


def _manifest(bundle: Path, platform: str) -> dict[str, Any]:
    m = read_manifest(bundle)  # refuses other schema versions, naming the export that rebuilds them
    runs = on_platform(platform)
    if m["target"] not in {t.name for t in runs}:
        raise DeltashipError(
            f"{bundle} is {a_bundle(m['target'])}; the {platform} kit runs "
            f"{' or '.join(t.title or t.name for t in runs)} bundles",
            export_for(platform),
        )
    return m


def write_kit(bundle: Path, out: Path, platform: str) -> list[Path]:
    """Write the `platform` ("web" or "desktop") kit for ONNX `bundle` into directory `out` (new or empty).

    Copies the bundle into out/bundle, so the kit runs as written. Returns the files written.
    """
    bundle, out = Path(bundle), Path(out)
    if platform not in PLATFORMS:
        raise DeltashipError(
            f"unknown platform {platform!r} for the JavaScript kit", f"use one of {', '.join(PLATFORMS)}"
        )
    m = _manifest(bundle, platform)
    if out.exists() and any(out.iterdir()):
        raise DeltashipError(f"{out} exists and is not empty", "pass a new or empty directory")
    files = [f for f in m.get("files", {}) if f != "manifest.json"]
    missing = [f for f in files if not (bundle / f).is_file()]
    if missing:
        raise DeltashipError(
            f"{bundle}: the manifest lists {', '.join(missing)} but the files are missing", "export the bundle again"
        )
    out.mkdir(parents=True, exist_ok=True)
    pkg = out / "deltaship-runtime"
    for name in _PACKAGE_FILES:
        if (JS_PACKAGE / name).is_file():
            (pkg / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(JS_PACKAGE / name, pkg / name)
    shutil.copytree(JS_PACKAGE / "src", pkg / "src")
    (out / "bundle").mkdir()
    for name in ["manifest.json", *files]:
        shutil.copy2(bundle / name, out / "bundle" / name)
    chat = bundle_pieces(bundle, m)  # refuses a template that per-role pieces cannot express
    if chat is not None:
        (out / CHAT_RECORD).write_text(json.dumps(chat, indent=2, ensure_ascii=False) + "\n")
    if platform == "web":
        (out / "index.html").write_text(_INDEX_HTML)
        (out / "main.js").write_text(_MAIN_JS)
    else:
        (out / "generate.mjs").write_text(_GENERATE_MJS)
    pins = json.loads((JS_PACKAGE / "package.json").read_text())["dependencies"]
    (out / "package.json").write_text(
        json.dumps(
            {
                "name": f"deltaship-{platform}-kit",
                "private": True,
                "type": "module",
                "dependencies": {name: pins[name] for name in _KIT_DEPENDENCIES[platform]},
            },
            indent=2,
        )
        + "\n"
    )
    readme = _readme(m, platform, files)
    if chat is not None:
        readme += (
            "\n## Chat\n\n`chat.json` holds the bundle's chat template as per-role pieces (rendered by `deltaship app`); "
            "`Chat` in `deltaship-runtime/src/chat.js` takes them: `await Chat.create(session, { pieces, system })`, "
            "then `send(text)`, `retry()`, `undo()`, `reset()`, `save()` (bytes: keep them in IndexedDB or a file) and "
            "`Chat.load(session, bytes, { pieces })`.\n"
        )
    (out / "README.md").write_text(readme)
    return sorted(p for p in out.rglob("*") if p.is_file())


def _readme(m: dict[str, Any], platform: str, files: list[str]) -> str:
    model = m.get("source", {}).get("model", "the model")
    external = [f for f in files if f != m["entry"] and f.endswith(".data")]
    lines = [
        f"# {model} ({m['precision']}) in {'the browser' if platform == 'web' else 'node / Electron'}",
        "",
        f"Generated by deltaship from an ONNX bundle: `bundle/` holds {', '.join(f'`{f}`' for f in ['manifest.json', *files])}.",
        f"The model takes up to {m['prefill_chunk']} tokens per call and holds {m['max_context']} positions; "
        f"its {len(m['states'])} state tensors ({m.get('state_bytes', 0) / 2**20:.1f} MiB) are carried by "
        "`deltaship-runtime` exactly as `bundle/manifest.json` lists them.",
        "",
        "## Install",
        "",
        "```sh",
        *(
            [
                "# onnxruntime-node's install script downloads CUDA binaries; the CPU library is already in the package",
                "ONNXRUNTIME_NODE_INSTALL=skip npm install --ignore-scripts",
            ]
            if platform == "desktop"
            else ["npm install"]
        ),
        "```",
        "",
    ]
    sample = m.get("sample_prompt")
    if platform == "desktop":
        lines += [
            "## Run",
            "",
            "```sh",
            f"node generate.mjs bundle {shlex.quote(sample or 'your prompt')} --max-new-tokens 64",
            "```",
            "",
            *(
                [
                    f"Without a prompt it uses the bundle's sample prompt ({json.dumps(sample)}, `sample_prompt` in "
                    "`bundle/manifest.json`: what the model was trained on).",
                    "",
                ]
                if sample
                else []
            ),
            "In an Electron app run the model in the main process (or a utility process) with "
            "`import { openBundle } from './deltaship-runtime/src/node.js'`, pointing it at the bundle directory shipped "
            "with the app (outside the asar archive: onnxruntime-node opens the files itself), and stream tokens "
            "to the renderer over IPC. Keep `onnxruntime-node` out of the renderer.",
            "",
        ]
    else:
        lines += [
            "## Serve",
            "",
            "Any static server works; the page must come from http(s), not file://:",
            "",
            "```sh",
            "python3 -m http.server 8000   # then open http://localhost:8000/",
            "```",
            "",
            "`index.html` maps `onnxruntime-web` and `@huggingface/tokenizers` to `node_modules/` with an import map; "
            "with a bundler (Vite, webpack) import `./deltaship-runtime/src/web.js` and let it resolve them. "
            f"Put the bundle where the page can fetch it (here `bundle/`: `{m['entry']}`"
            + (
                f" and its external weights {', '.join(f'`{f}`' for f in external)}, passed with the "
                "`externalData` session option"
                if external
                else ""
            )
            + ").",
            "",
            "`main.js` uses WebGPU when the browser has it (states stay in GPU buffers between calls) and the "
            "wasm CPU backend otherwise. Serve with `Cross-Origin-Opener-Policy: same-origin` and "
            "`Cross-Origin-Embedder-Policy: require-corp` to let wasm use threads.",
            "",
            "The page shows the model loading (which file, its size, the seconds so far) and keeps Generate disabled "
            "until the model is ready; its prompt starts as "
            + (
                f"the bundle's sample prompt ({json.dumps(sample)}, `sample_prompt` in `bundle/manifest.json`)."
                if sample
                else "empty (the bundle records no `sample_prompt`)."
            ),
            "",
        ]
    lines += [
        "## React Native",
        "",
        "Use `onnxruntime-react-native` with the same driver: `deltaship-runtime/src/core.js` exports `Session`, which takes "
        "any ONNX Runtime JS module (`new Session({ ort, session, manifest, tokenizer })`).",
        "",
        "See `deltaship-runtime/README.md` for the API.",
        "",
    ]
    return "\n".join(lines)


_INDEX_HTML = """<!doctype html>
<html>
<head>
<meta charset="utf-8">
<title>deltaship</title>
<script type="importmap">
{"imports": {
  "onnxruntime-web": "./node_modules/onnxruntime-web/dist/ort.bundle.min.mjs",
  "onnxruntime-web/webgpu": "./node_modules/onnxruntime-web/dist/ort.webgpu.bundle.min.mjs",
  "@huggingface/tokenizers": "./node_modules/@huggingface/tokenizers/dist/tokenizers.min.mjs"
}}
</script>
<script type="module" src="main.js"></script>
</head>
<body data-state="loading">
<p id="status" role="status"><progress id="progress"></progress> <span id="status-text">Loading the model...</span></p>
<p>
<input id="prompt" size="60" aria-label="prompt">
<button id="generate" type="button" disabled>Generate</button>
</p>
<pre id="out"></pre>
</body>
</html>
"""

# No <form>: nothing on the page submits or navigates. Generate stays disabled until the session is open, and
# the prompt starts as the bundle's `sample_prompt` (recorded at export from the preset or the model card).
_MAIN_JS = """// Open the bundle (WebGPU when the browser has it, else wasm), show the load, stream tokens into the page.
import { openBundle } from './deltaship-runtime/src/web.js';

const $ = (id) => document.getElementById(id);
const button = $('generate');
const prompt = $('prompt');
const out = $('out');
let session = null;
let executionProvider = 'wasm';

function status(text, state, done = false) {
  $('status-text').textContent = text;
  $('progress').hidden = done;
  document.body.dataset.state = state;
}

async function load() {
  const t0 = performance.now();
  let stage = 'Reading the bundle manifest';
  const seconds = () => ((performance.now() - t0) / 1000).toFixed(1);
  const tick = setInterval(() => status(`${stage}... ${seconds()} s`, 'loading'), 250);
  try {
    const manifest = await (await fetch('./bundle/manifest.json')).json();
    if (!prompt.value && typeof manifest.sample_prompt === 'string') prompt.value = manifest.sample_prompt;
    const files = [manifest.entry, ...Object.keys(manifest.files ?? {}).filter((f) => f.startsWith(`${manifest.entry}.`))];
    const mib = files.reduce((n, f) => n + (manifest.files?.[f]?.bytes ?? 0), 0) / 2 ** 20;
    executionProvider = navigator.gpu && (await navigator.gpu.requestAdapter()) ? 'webgpu' : 'wasm';
    stage = `Loading ${files.join(' + ')} (${mib.toFixed(1)} MiB) into onnxruntime-web (${executionProvider})`;
    status(`${stage}...`, 'loading');
    session = await openBundle('./bundle/', { executionProvider });
    clearInterval(tick);
    status(`Ready: the model loaded in ${seconds()} s (${executionProvider}).`, 'ready', true);
    button.disabled = false;
  } catch (e) {
    clearInterval(tick);
    status(`Could not load the model: ${e.message ?? e}${e.fix ? ` (fix: ${e.fix})` : ''}`, 'error', true);
  }
}

async function generate() {
  if (!session || button.disabled) return;
  button.disabled = true;
  status('Generating...', 'generating', true);
  const text = prompt.value;
  try {
    session.reset();
    const ids = [];
    for await (const tok of session.stream(text, { maxNewTokens: 64 })) {
      ids.push(tok);
      out.textContent = text + session.decodeText(ids);
    }
    status(`Ready (${executionProvider}).`, 'done', true);
  } catch (e) {
    status(`Generation failed: ${e.message ?? e}`, 'error', true);
  } finally {
    button.disabled = false;
  }
}

button.addEventListener('click', (e) => {
  e.preventDefault();
  generate();
});
prompt.addEventListener('keydown', (e) => {
  if (e.key === 'Enter') {
    e.preventDefault();
    generate();
  }
});
load();
"""

_GENERATE_MJS = """// node generate.mjs BUNDLE_DIR "prompt" [--max-new-tokens N]: stream a completion to stdout.
import { parseArgs } from 'node:util';
import { openBundle } from './deltaship-runtime/src/node.js';

const { values, positionals } = parseArgs({ allowPositionals: true, options: { 'max-new-tokens': { type: 'string', default: '64' } } });
const [dir = 'bundle', given] = positionals;
const session = await openBundle(dir);
// The default prompt is the bundle's own (manifest.json sample_prompt: what the model was trained on).
const prompt = given ?? session.manifest?.sample_prompt;
if (!prompt) {
  console.error('give a prompt: node generate.mjs BUNDLE_DIR "text" (this bundle records no sample_prompt)');
  process.exit(2);
}
const ids = [];
let shown = 0;
process.stdout.write(prompt);
for await (const tok of session.stream(prompt, { maxNewTokens: Number(values['max-new-tokens']) })) {
  ids.push(tok);
  const text = session.decodeText(ids);
  if (!text.endsWith('\\uFFFD')) {  // wait for the rest of a split UTF-8 character
    process.stdout.write(text.slice(shown));
    shown = text.length;
  }
}
process.stdout.write('\\n');
"""

// Node's side of the bundle-path rule (core.js checks the names): a bundle file's real path, symlinks
// followed, must lie inside the bundle directory. No onnxruntime import, so it is testable on its own.
import { realpath } from 'node:fs/promises';
import { join, sep } from 'node:path';
import { DeltashipError } from './core.js';

/**
 * The path of bundle file `name` (checked by checkManifest), refused when it resolves (symlinks followed)
 * outside the bundle directory.
 */
export async function inside(dir, name, field) {
  const root = await realpath(dir);
  let real;
  try {
    real = await realpath(join(dir, name));
  } catch (e) {
    throw new DeltashipError(`${join(dir, name)}: cannot read the bundle's ${field} (${e.code ?? e.message})`,
      'export the bundle again (its files are incomplete)');
  }
  if (!real.startsWith(root + sep)) {
    throw new DeltashipError(`${dir}: manifest field ${field} = ${JSON.stringify(name)} resolves to ${real}, outside the bundle (a symlink?)`,
      'export the bundle again (or restore it from where it was shipped); a bundle names only files inside its own directory');
  }
  return real;
}

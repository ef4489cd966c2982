// Where kvgate's own files are at run time, whether it runs from a checkout (src/*.ts
// under tsx or vitest) or from an install (dist/src/*.js): the package root, and how to start a sibling module.

import { existsSync, readFileSync } from 'node:fs'
import { dirname, join, sep } from 'node:path'
import { fileURLToPath, pathToFileURL } from 'node:url'

/** True when this code runs compiled (dist/), false when it runs as TypeScript sources. */
export const runsCompiled = import.meta.url.endsWith('.js')

let root: string | undefined

/** The directory holding kvgate's package.json (the checkout, or node_modules/kvgate). */
export function packageRoot(): string {
  if (root !== undefined) return root
  let dir = dirname(fileURLToPath(import.meta.url))
  for (;;) {
    const pkg = join(dir, 'package.json')
    if (existsSync(pkg)) {
      try {
        if ((JSON.parse(readFileSync(pkg, 'utf8')) as { name?: unknown }).name === 'kvgate') {
          root = dir
          return dir
        }
      } catch {
        // Not ours (unreadable or not JSON): keep walking up.
      }
    }
    const up = dirname(dir)
    if (up === dir) throw new Error(`kvgate: package.json not found above ${fileURLToPath(import.meta.url)}`)
    dir = up
  }
}

/** kvgate's version from its package.json. */
export function packageVersion(): string {
  return (JSON.parse(readFileSync(join(packageRoot(), 'package.json'), 'utf8')) as { version: string })
    .version
}

/** True when kvgate is a dependency of another project (under node_modules), not its own checkout. */
export function installedAsDependency(): boolean {
  return packageRoot().split(sep).includes('node_modules')
}

/**
 * The module `name` (written with its .ts extension) next to `base`: the .ts source in
 * a checkout, the compiled .js in an install.
 */
export function siblingModule(base: string | URL, name: string): URL {
  const file = runsCompiled ? name.replace(/\.ts$/, '.js') : name
  return new URL(file, base)
}

/**
 * Node flags that let a child process run `file`: none for JavaScript, tsx's loader
 * (an absolute URL, so the child's cwd does not matter) for TypeScript sources.
 */
export function nodeFlagsFor(file: string | URL): string[] {
  const path = typeof file === 'string' ? file : fileURLToPath(file)
  if (!path.endsWith('.ts')) return []
  // tsx is a devDependency: only a checkout runs .ts files, and it has tsx.
  return ['--import', import.meta.resolve('tsx')]
}

/** A file:// URL for a path under the package root. */
export function packageFile(...parts: string[]): URL {
  return pathToFileURL(join(packageRoot(), ...parts))
}

// Entry of a codec worker thread, plain JS so it starts under any loader: an install
// runs the compiled worker beside it; a checkout registers tsx and loads the TypeScript worker.
import { existsSync } from 'node:fs'

const compiled = new URL('./codec-worker.js', import.meta.url)
if (existsSync(compiled)) {
  await import(compiled.href)
} else {
  const { register } = await import('tsx/esm/api')
  register()
  await import('./codec-worker.ts')
}

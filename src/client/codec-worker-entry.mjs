// Entry of a codec worker thread: plain JS, so it starts whatever loader the
// parent used (tsx, vitest); it registers tsx and loads the TypeScript worker.
import { register } from 'tsx/esm/api'

register()
await import('./codec-worker.ts')

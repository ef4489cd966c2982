import { defineConfig } from 'vitest/config'

// One runner for every suite: unit tests beside the code (src/**/*.test.ts) and
// cross-module / integration suites under test/. Suites that need a real service
// (RadosGW, workerd) start it themselves in their own setup.
export default defineConfig({
  test: {
    include: ['src/**/*.test.ts', 'test/**/*.test.ts'],
    testTimeout: 60_000,
    hookTimeout: 180_000,
    pool: 'forks',
    // The CI machine has 2 cores; RGW and workerd suites are heavy.
    maxWorkers: 2,
    reporters: ['default'],
  },
})

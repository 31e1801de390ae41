import { defineConfig } from "vitest/config";

import SummaryReporter from "./test/summary-reporter.js";

export default defineConfig({
  test: {
    include: ["test/**/*.test.ts"],
    globalSetup: ["test/global-setup.ts"],
    // The files share two daemons (one with capacity 1): run them one after another.
    fileParallelism: false,
    testTimeout: 60_000,
    hookTimeout: 240_000,
    reporters: ["default", new SummaryReporter()],
  },
});

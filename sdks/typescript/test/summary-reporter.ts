/**
 * Ends the run with one plain "vitest: N passed, N failed, N skipped" line, the closing-line
 * shape the repo's CI reads for any runner (vitest's own summary is decorated).
 */
import type { Reporter, TestModule, TestRunEndReason } from "vitest/node";

export default class SummaryReporter implements Reporter {
  onTestRunEnd(testModules: ReadonlyArray<TestModule>, unhandledErrors: ReadonlyArray<unknown>, reason: TestRunEndReason): void {
    const count = { passed: 0, failed: 0, skipped: 0 };
    for (const m of testModules) {
      for (const t of m.children.allTests()) {
        const state = t.result().state;
        if (state === "passed" || state === "failed" || state === "skipped") count[state] += 1;
      }
      // A file that failed to load (e.g. globalSetup or an import) ran no tests: count it.
      if (m.state() === "failed" && [...m.children.allTests()].length === 0) count.failed += 1;
    }
    count.failed += unhandledErrors.length;
    // A run that failed outside any test (globalSetup could not start the daemons) still fails.
    if (reason !== "passed" && count.failed === 0) count.failed = 1;
    process.stdout.write(`\nvitest: ${count.passed} passed, ${count.failed} failed, ${count.skipped} skipped\n`);
  }
}

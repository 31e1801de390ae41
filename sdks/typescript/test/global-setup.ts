/**
 * One tiny model, two daemons for the whole suite:
 * - open:  sink_window (window 32), no key: lifecycle, streaming, errors;
 * - keyed: --api-key, `full` strategy, capacity 1: auth, OUT_OF_RANGE, RESOURCE_EXHAUSTED.
 */
import { randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";

import type { TestProject } from "vitest/node";

import { makeTinyModel, startDaemon, type Daemon } from "./daemon.js";

declare module "vitest" {
  export interface ProvidedContext {
    openTarget: string;
    keyedTarget: string;
    apiKey: string;
  }
}

export default async function setup(project: TestProject) {
  const dir = mkdtempSync(path.join(tmpdir(), "kakeya-ts-"));
  const daemons: Daemon[] = [];
  const teardown = async () => {
    await Promise.all(daemons.map((d) => d.stop()));
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    const model = makeTinyModel(path.join(dir, "tiny-llama"));
    const apiKey = randomBytes(16).toString("hex");
    const common = ["--model", model, "--threads", "1", "--idle-ttl", "0"];
    const started = await Promise.allSettled([
      startDaemon([...common, "--kv-strategy", "sink_window", "--window", "32"]),
      // --persist off: a full store refuses new sessions (with persistence the LRU idle session spills to disk)
      startDaemon([...common, "--kv-strategy", "full", "--capacity", "1", "--api-key", apiKey, "--persist", "off"]),
    ]);
    for (const r of started) if (r.status === "fulfilled") daemons.push(r.value);
    const failed = started.find((r) => r.status === "rejected");
    if (failed) throw (failed as PromiseRejectedResult).reason;
    project.provide("openTarget", daemons[0]!.target);
    project.provide("keyedTarget", daemons[1]!.target);
    project.provide("apiKey", apiKey);
  } catch (err) {
    await teardown();
    throw err;
  }
  return teardown;
}

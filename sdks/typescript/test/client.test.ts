import { execFile } from "node:child_process";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

import { afterAll, describe, expect, inject, it } from "vitest";

import { CancelledError, Client, VERSION } from "../src/index.js";

const target = inject("openTarget");
const client = new Client(target);
afterAll(() => client.close());

describe("server info", () => {
  it("describes the model and the KV strategy", async () => {
    const info = await client.serverInfo();
    expect(info).toMatchObject({
      modelId: "tiny-llama",
      vocabSize: 256,
      defaultEosTokenIds: [2],
      kvStrategy: "sink_window",
      kvParams: { compressor: "identity", sink: "4", window: "32" },
      sink: 4,
      window: 32,
      compressor: "identity",
      maxContext: 2048,
      backend: "torch",
      serverVersion: VERSION,
      drafter: "",
      specK: 0,
    });
    expect(info.sessionCapacity).toBeGreaterThan(0);
    // The suite's open daemon saves every turn under a state directory of its own (daemon.ts).
    expect(info.persistence.mode).toBe("turn");
    expect(info).toMatchObject({ maxAppendTokens: 16384, maxPendingTokens: 32768 }); // kakeya serve's defaults
    expect(path.basename(info.persistence.stateDir)).toMatch(/^kakeya-ts-state-/);
    // Research knobs are no part of the product surface: they are not typed fields.
    expect(Object.keys(info).filter((key) => key.startsWith("restore"))).toEqual([]);
  });

  it("a fresh session inherits the default eos ids", async () => {
    const session = await client.createSession({ initialTokens: [1] });
    expect((await session.info()).eosTokenIds).toEqual([2]);
    await session.close();
  });
});

describe("close", () => {
  it("lets calls in flight finish and refuses new ones", async () => {
    const own = new Client(target);
    const session = await own.createSession({ initialTokens: [1, 2, 3], ignoreEos: true });
    const tokens: number[] = [];
    for await (const id of session.generate({ maxTokens: 20 })) {
      if (tokens.push(id) === 1) own.close();
    }
    expect(tokens).toHaveLength(20);
    await expect(session.info()).rejects.toBeInstanceOf(CancelledError);
    await expect(own.serverInfo()).rejects.toThrow(/Client was closed/);
    await client.session(session.id).close();
  });
});

describe("package", () => {
  // The built package (dist/, `npm run build`) loads in plain Node ESM through its exports map.
  it("both entry points import in Node and talk to the daemon", async () => {
    const pkgDir = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
    const script = `
      import { Client } from "@kakeya/runtime";
      import { tokensForChat } from "@kakeya/runtime/tokenization";
      const client = new Client(); // the address comes from KAKEYA_ADDRESS, as for every client
      const info = await client.serverInfo();
      client.close();
      console.log(JSON.stringify({ model: info.modelId, helper: typeof tokensForChat, target: client.target }));
    `;
    const env = { ...process.env, KAKEYA_ADDRESS: target };
    const { stdout } = await promisify(execFile)(process.execPath, ["--input-type=module", "-e", script], { cwd: pkgDir, env });
    expect(JSON.parse(stdout)).toEqual({ model: "tiny-llama", helper: "function", target });
  });
});

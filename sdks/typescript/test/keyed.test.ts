/**
 * The keyed daemon: --api-key, `full` KV strategy, capacity 1. API-key auth, and the
 * statuses that need a bounded context or a full session store.
 */
import { afterAll, describe, expect, inject, it } from "vitest";

import {
  Client,
  OutOfRangeError,
  ResourceExhaustedError,
  Status,
  UnauthenticatedError,
  type KakeyaError,
} from "../src/index.js";

const target = inject("keyedTarget");
const client = new Client(target, { apiKey: inject("apiKey") });
afterAll(() => client.close());

describe("API key", () => {
  it.each([
    ["missing", undefined],
    ["wrong", "not-the-key"],
  ])("%s key: every RPC is UNAUTHENTICATED", async (_what, apiKey) => {
    const stranger = new Client(target, apiKey === undefined ? {} : { apiKey });
    const calls: Array<() => Promise<unknown>> = [
      () => stranger.serverInfo(),
      () => stranger.createSession({ initialTokens: [1, 2, 3] }),
      () => stranger.session("anything").append([1]),
      async () => {
        for await (const _ of stranger.session("anything").generate({ maxTokens: 1 })) {
          // unreachable
        }
      },
    ];
    for (const call of calls) {
      const err = await call().catch((e: unknown) => e);
      expect(err).toBeInstanceOf(UnauthenticatedError);
      expect((err as KakeyaError).code).toBe(Status.UNAUTHENTICATED);
    }
    stranger.close();
  });

  it("the right key works", async () => {
    const info = await client.serverInfo();
    expect(info.kvStrategy).toBe("full");
    // --kv-dtype auto (the daemon's default): fp16 where the native CPU step's AVX2 attention runs, else fp32 (not listed)
    const { kv_dtype: kvDtype, ...params } = info.kvParams;
    expect(params).toEqual({ compressor: "identity" });
    expect([undefined, "fp16"]).toContain(kvDtype);
    expect([info.sink, info.window]).toEqual([0, 0]);
    expect(info.persistence).toEqual({ mode: "off", stateDir: "", shared: false, daemonId: "", leaseTtlSeconds: 0 }); // this daemon runs --persist off
    const session = await client.createSession({ initialTokens: [1, 2, 3] });
    expect((await session.generateAll({ maxTokens: 3 })).generatedTokens).toBeGreaterThan(0);
    await session.close();
  });
});

describe("bounded context (`full` strategy)", () => {
  it("OUT_OF_RANGE when an append would pass the model context; nothing is appended", async () => {
    const { maxContext } = await client.serverInfo();
    const session = await client.createSession({ initialTokens: [1, 2, 3] });
    const err = await session.append(new Array<number>(maxContext).fill(7)).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(OutOfRangeError);
    expect((err as KakeyaError).details).toMatch(/context/);
    expect((await session.info()).historyLength).toBe(3);
    await session.close();
  });

  it("generation stops with context_full at the model context", async () => {
    const { maxContext } = await client.serverInfo();
    const session = await client.createSession({ initialTokens: new Array<number>(maxContext - 4).fill(9), ignoreEos: true });
    const result = await session.generateAll({ maxTokens: 50 });
    expect(result.stopReason).toBe("context_full");
    expect(result.generatedTokens).toBeLessThanOrEqual(4);
    await session.close();
  });
});

describe("capacity", () => {
  it("a full daemon without persistence (--persist off) refuses a new session rather than drop an idle one", async () => {
    const old = await client.createSession({ initialTokens: [1, 2, 3] });
    const err = await client.createSession({ initialTokens: [4, 5] }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ResourceExhaustedError);
    expect((err as KakeyaError).message).toContain("session slots are taken");
    await old.append([6]); // still there
    expect((await old.info()).historyLength).toBe(4);
    await old.close();
    const fresh = await client.createSession({ initialTokens: [4, 5] });
    await fresh.close();
  });
});

describe("RESOURCE_EXHAUSTED", () => {
  it("a new session when the only slot is generating", async () => {
    const busy = await client.createSession({ initialTokens: [1, 2, 3], ignoreEos: true });
    const controller = new AbortController();
    let err: unknown;
    try {
      for await (const _ of busy.generate({ maxTokens: 100_000, signal: controller.signal })) {
        // The server holds the slot while it streams: a second session cannot get one.
        err = await client.createSession({ initialTokens: [1] }).catch((e: unknown) => e);
        controller.abort();
      }
    } catch {
      // the abort
    }
    expect(err).toBeInstanceOf(ResourceExhaustedError);
    expect((err as KakeyaError).code).toBe(Status.RESOURCE_EXHAUSTED);
    // Closing the busy session frees its slot at once, even before its Generate has wound down.
    await busy.close();
    const next = await client.createSession({ initialTokens: [1] });
    await next.close();
  });
});

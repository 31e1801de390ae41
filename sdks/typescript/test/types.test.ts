/**
 * Wire messages -> SDK objects field by field, by name (src/types.ts copyFields), without a daemon:
 * every field gets a value of its own, so a field the mapping drops or swaps fails.
 * (That the SDK interfaces name exactly the wire's fields is checked by the typecheck.)
 */
import { describe, expect, it } from "vitest";

import { GetServerInfoResponse, GetSessionInfoResponse, KVStrategyInfo, PersistenceInfo } from "../src/gen/kakeya/v1/runtime.js";
import { serverInfo, sessionInfo } from "../src/types.js";

/** Each field of a fresh message set to a value no other field holds (by the field's default's type). */
function distinct<T extends object>(base: T): T {
  const out: Record<string, unknown> = {};
  Object.entries(base).forEach(([k, v], i) => {
    if (typeof v === "string") out[k] = `${k}-${i}`;
    else if (typeof v === "number") out[k] = i + 1;
    else if (typeof v === "boolean") out[k] = true;
    else if (Array.isArray(v)) out[k] = [i, i + 100];
    else out[k] = v;
  });
  return out as T;
}

describe("wire -> SDK objects", () => {
  it("SessionInfo carries every wire field but the deprecated counters", () => {
    const r = distinct(GetSessionInfoResponse.create());
    const info = sessionInfo(r);
    const { inv1Violations: _a, inv2Violations: _b, ...surfaced } = r;
    expect(info).toEqual(surfaced);
    expect(Object.keys(info)).not.toContain("inv1Violations");
    expect(info.eosTokenIds).not.toBe(r.eosTokenIds); // a copy
  });

  it("ServerInfo carries every wire field, the strategy's name and params, and persistence", () => {
    const persistence = distinct(PersistenceInfo.create());
    const kvStrategy = KVStrategyInfo.create({ name: "paged", params: { window: "32", sink: "4", compressor: "kakeya_d4" } });
    const r = { ...distinct(GetServerInfoResponse.create()), kvStrategy, persistence };
    const info = serverInfo(r);
    const { kvStrategy: _k, persistence: _p, ...plain } = r;
    expect(info).toMatchObject(plain);
    expect(info.kvStrategy).toBe("paged");
    expect(Object.keys(info.kvParams)).toEqual(["compressor", "sink", "window"]);
    expect([info.sink, info.window, info.compressor]).toEqual([4, 32, "kakeya_d4"]);
    expect(info.persistence).toEqual(persistence);
  });

  it("an old server's missing messages read as defaults", () => {
    const info = serverInfo(GetServerInfoResponse.create({ modelId: "m" }));
    expect(info.persistence).toEqual({ mode: "", stateDir: "", shared: false, daemonId: "", leaseTtlSeconds: 0 });
    expect([info.kvStrategy, info.kvParams, info.compressor]).toEqual(["", {}, "identity"]);
  });
});

/**
 * The TypeScript SDK through a real proxy: `kakeya cluster up 3` (3 daemons sharing a state directory behind
 * HAProxy, routed by the x-kakeya-session metadata the SDK sends). Skipped without HAProxy on a developer's
 * machine; under CI (`make test` installs it) a missing HAProxy fails.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import path from "node:path";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import { AlreadyExistsError, Client } from "../src/index.js";
import { haproxyPath, makeTinyModel, startCluster, type LocalCluster } from "./daemon.js";

const haproxy = haproxyPath();
if (!haproxy && process.env.CI) throw new Error("CI is set and HAProxy is missing: make proxy installs it (apt-get install haproxy)");

describe.skipIf(!haproxy)("through HAProxy in front of 3 daemons", () => {
  let cluster: LocalCluster;
  let dir: string;

  beforeAll(async () => {
    dir = mkdtempSync(path.join(tmpdir(), "kakeya-ts-cluster-model-"));
    const model = makeTinyModel(path.join(dir, "tiny-llama"));
    cluster = await startCluster(3, ["--model", model, "--lease-ttl", "1"], ["--threads", "1", "--idle-ttl", "0", "--window", "32"]);
  });

  afterAll(async () => {
    await cluster?.stop();
    rmSync(dir, { recursive: true, force: true });
  });

  it("runs sessions end to end, each routed by its id", async () => {
    const client = new Client(cluster.target);
    const info = await client.serverInfo();
    expect(info.persistence).toMatchObject({ mode: "turn", shared: true, leaseTtlSeconds: 1 });
    const owners = new Set<string>();
    for (let i = 0; i < 6; i++) {
      const sessionId = `ts-cluster-${i}-${Date.now()}`;
      const s = await client.createSession({ sessionId, initialTokens: [1, 2, 3 + i], ignoreEos: true });
      expect(s.id).toBe(sessionId);
      await expect(client.createSession({ sessionId })).rejects.toBeInstanceOf(AlreadyExistsError);
      expect(await s.append([7, 8])).toBe(5);
      const r = await s.generateAll({ maxTokens: 4 });
      expect(r.generatedTokens).toBe(4);
      expect(r.durableLength).toBe(9);
      expect((await s.history()).length).toBe(9);
      expect((await s.info()).historyLength).toBe(9);
      await s.close();
      owners.add((await client.serverInfo()).persistence.daemonId); // round robin: no session header
    }
    expect(owners.size).toBeGreaterThan(1);
    client.close();
  });
});

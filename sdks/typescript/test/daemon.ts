/**
 * Start real `kakeya serve` processes for the suite: a tiny random-weight model written by
 * `inference_engine.model_store.tiny`, served on a free loopback port. The daemon prints
 * `READY <port>` on stdout once it listens.
 *
 * KAKEYA_PYTHON / KAKEYA_BIN override the interpreter and CLI (default: the repo's .venv).
 */
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { mkdtempSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const REPO_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../..");
const PYTHON = process.env.KAKEYA_PYTHON ?? path.join(REPO_ROOT, ".venv/bin/python");
const KAKEYA = process.env.KAKEYA_BIN ?? path.join(REPO_ROOT, ".venv/bin/kakeya");
const START_TIMEOUT_MS = 180_000;
const LOG_TAIL = 4000;

export function makeTinyModel(out: string, arch = "llama"): string {
  const r = spawnSync(PYTHON, ["-m", "inference_engine.model_store.tiny", "--arch", arch, "--out", out], {
    cwd: REPO_ROOT,
    encoding: "utf8",
  });
  if (r.error) throw new Error(`could not run ${PYTHON} (set KAKEYA_PYTHON): ${r.error.message}`);
  if (r.status !== 0) throw new Error(`making the tiny model failed (exit ${r.status}):\n${r.stderr.slice(-LOG_TAIL)}`);
  return out;
}

export interface Daemon {
  readonly target: string;
  readonly port: number;
  stop(): Promise<void>;
}

/** Spawn `kakeya ...argv` and resolve with the child once it prints `READY <port>`; `label` (and `where`, after
 * the reason) name it in the error of a start that fails. */
function spawnUntilReady(argv: string[], label: string, where = ""): Promise<{ child: ChildProcess; port: number }> {
  const child = spawn(KAKEYA, argv, {
    cwd: REPO_ROOT,
    stdio: ["ignore", "pipe", "pipe"],
    // A KAKEYA_API_KEY in the caller's environment would silently key every daemon.
    env: { ...process.env, KAKEYA_API_KEY: "", PYTHONUNBUFFERED: "1" },
  });
  let stderr = "";
  child.stderr!.setEncoding("utf8").on("data", (chunk: string) => {
    stderr = (stderr + chunk).slice(-LOG_TAIL);
  });
  return new Promise((resolve, reject) => {
    let stdout = "";
    const fail = (why: string) => {
      clearTimeout(timer);
      child.kill("SIGKILL");
      reject(new Error(`${label}: ${why}${where}\n--- stderr tail ---\n${stderr}`));
    };
    const timer = setTimeout(() => fail(`no READY line within ${START_TIMEOUT_MS / 1000}s`), START_TIMEOUT_MS);
    child.once("error", (err) => fail(`could not start ${KAKEYA} (set KAKEYA_BIN): ${err.message}`));
    child.once("exit", (code, signal) => fail(`exited before READY (code ${code}, signal ${signal})`));
    child.stdout!.setEncoding("utf8").on("data", (chunk: string) => {
      stdout += chunk;
      const m = /^READY (\d+)/m.exec(stdout);
      if (!m) return;
      clearTimeout(timer);
      child.removeAllListeners("exit");
      resolve({ child, port: Number(m[1]) });
    });
  });
}

/** Spawn `kakeya serve --bind 127.0.0.1:0 ...args` and resolve once it prints READY. Each daemon
 * persists sessions to a state directory of its own (one daemon per state directory). */
export async function startDaemon(args: string[]): Promise<Daemon> {
  const stateDir = mkdtempSync(path.join(os.tmpdir(), "kakeya-ts-state-"));
  const { child, port } = await spawnUntilReady(["serve", "--bind", "127.0.0.1:0", "--state-dir", stateDir, ...args],
    `kakeya serve ${args.join(" ")}`);
  return { target: `127.0.0.1:${port}`, port, stop: () => stopChild(child) };
}

function stopChild(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const kill = setTimeout(() => child.kill("SIGKILL"), 10_000);
    child.once("exit", () => {
      clearTimeout(kill);
      resolve();
    });
    child.kill("SIGTERM");
  });
}

export interface LocalCluster {
  readonly target: string;
  stop(): Promise<void>;
}

/** Where HAProxy is, or undefined (`kakeya cluster` needs it; `make test` installs it as root). */
export function haproxyPath(): string | undefined {
  const r = spawnSync("sh", ["-c", "command -v haproxy || ls /usr/sbin/haproxy"], { encoding: "utf8" });
  const found = r.stdout.trim().split("\n")[0];
  return r.status === 0 && found ? found : undefined;
}

/** `kakeya cluster up N ...args` (N daemons sharing a state directory behind HAProxy) on free ports; resolves
 * once it prints READY <proxy port>. */
export async function startCluster(n: number, args: string[], serveArgs: string[]): Promise<LocalCluster> {
  const runDir = mkdtempSync(path.join(os.tmpdir(), "kakeya-ts-cluster-"));
  const { child, port } = await spawnUntilReady(
    ["cluster", "up", String(n), "--port", "0", "--first-port", "0", "--run-dir", runDir, ...args, `--serve-args=${serveArgs.join(" ")}`],
    `kakeya cluster up ${n}`, ` (logs in ${runDir})`);
  return { target: `127.0.0.1:${port}`, stop: () => stopChild(child) };
}

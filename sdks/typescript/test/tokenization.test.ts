/**
 * The opt-in chat helpers give the same token ids as the Python SDK's `tokens_for_chat`
 * (a tiny BPE tokenizer trained on the spot; the pulled SmolLM2 when it is there), and keep
 * sessions append-only across turns.
 */
import { spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { homedir, tmpdir } from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

import { afterAll, beforeAll, describe, expect, it } from "vitest";

import {
  chatContinuation,
  chatDelta,
  fromOpenAIMessages,
  loadTokenizer,
  renderChat,
  tokensForChat,
  type ChatTokenizer,
  type LocalTokenizer,
  type OpenAIMessage,
} from "../src/tokenization.js";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO_ROOT = path.resolve(HERE, "../../..");
const PYTHON = process.env.KAKEYA_PYTHON ?? path.join(REPO_ROOT, ".venv/bin/python");
const SMOLLM2 = path.join(process.env.KAKEYA_HOME ?? path.join(homedir(), ".cache/kakeya"), "models/smollm2-135m-instruct");

const CONVERSATION: OpenAIMessage[] = [
  { role: "system", content: "be brief" },
  { role: "user", content: "hello world, how are you today?" },
  { role: "assistant", content: "the quick brown fox" },
  { role: "user", content: [{ type: "text", text: "système café " }, { type: "text", text: "naïve 🤖\n\ttabs  spaces" }] },
];
const CASES = [
  { messages: CONVERSATION.slice(0, 2), add_generation_prompt: true },
  { messages: CONVERSATION.slice(0, 3), add_generation_prompt: false },
  { messages: CONVERSATION, add_generation_prompt: true },
];

function pythonTokens(script: string, args: string[]): number[][] {
  const r = spawnSync(PYTHON, [script, ...args], { cwd: REPO_ROOT, encoding: "utf8" });
  if (r.status !== 0) throw new Error(`${script} failed (exit ${r.status}):\n${r.stderr.slice(-3000)}`);
  return JSON.parse(r.stdout.trim().split("\n").at(-1)!) as number[][];
}

let dir: string;
let tiny: LocalTokenizer;
let pythonIds: number[][];

beforeAll(async () => {
  dir = mkdtempSync(path.join(tmpdir(), "kakeya-tok-"));
  const pyCases = CASES.map((c) => ({ messages: fromOpenAIMessages(c.messages), add_generation_prompt: c.add_generation_prompt }));
  pythonIds = pythonTokens(path.join(HERE, "fixtures/make_tokenizer.py"), [dir, JSON.stringify(pyCases)]);
  tiny = await loadTokenizer(dir);
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("tokensForChat", () => {
  it("matches the Python SDK on a tiny BPE tokenizer", () => {
    const ids = CASES.map((c) => tokensForChat(c.messages, tiny, { addGenerationPrompt: c.add_generation_prompt }));
    expect(ids).toEqual(pythonIds);
  });

  it.skipIf(!existsSync(path.join(SMOLLM2, "tokenizer.json")))("matches the Python SDK on the pulled smollm2-135m-instruct", async () => {
    const smol = await loadTokenizer(SMOLLM2);
    const script = `
import json, sys
from kakeya.tokenization import load_tokenizer, tokens_for_chat
t = load_tokenizer(sys.argv[1])
print(json.dumps([tokens_for_chat(c["messages"], t, add_generation_prompt=c["add_generation_prompt"]) for c in json.loads(sys.argv[2])]))
`;
    const pyCases = CASES.map((c) => ({ messages: fromOpenAIMessages(c.messages), add_generation_prompt: c.add_generation_prompt }));
    const expected = pythonTokens("-c", [script, SMOLLM2, JSON.stringify(pyCases)]);
    expect(CASES.map((c) => tokensForChat(c.messages, smol, { addGenerationPrompt: c.add_generation_prompt }))).toEqual(expected);
  });

  it("accepts transformers.js-style results ({ input_ids })", () => {
    const fake: ChatTokenizer = {
      apply_chat_template: (messages, options) => ({ input_ids: [messages.length, options.add_generation_prompt ? 1 : 0] }),
      encode: () => [],
      decode: () => "",
    };
    expect(tokensForChat([{ role: "user", content: "x" }], fake)).toEqual([1, 1]);
    expect(tokensForChat([{ role: "user", content: "x" }], fake, { addGenerationPrompt: false })).toEqual([1, 0]);
  });
});

describe("fromOpenAIMessages", () => {
  it("flattens text parts and null content", () => {
    expect(fromOpenAIMessages([{ role: "user", content: [{ type: "text", text: "a" }, { type: "text", text: "b" }] }, { role: "assistant", content: null }])).toEqual([
      { role: "user", content: "ab" },
      { role: "assistant", content: "" },
    ]);
  });

  it("names the bad message", () => {
    expect(() => fromOpenAIMessages([{ role: "user", content: [{ type: "image_url" }] }])).toThrow(/messages\[0\]\.content has a non-text part/);
    expect(() => fromOpenAIMessages([{ content: "x" } as unknown as OpenAIMessage])).toThrow(/messages\[0\] has no string 'role'/);
  });
});

describe("multi-turn", () => {
  it("chatDelta is the rendered suffix of the grown conversation", () => {
    const before = tokensForChat(CONVERSATION.slice(0, 3), tiny, { addGenerationPrompt: false });
    const delta = chatDelta(CONVERSATION.slice(0, 3), CONVERSATION, tiny);
    expect([...before, ...delta]).toEqual(tokensForChat(CONVERSATION, tiny));
  });

  it("chatContinuation extends a history that holds the model's own reply tokens", () => {
    const first = CONVERSATION.slice(0, 2);
    const start = chatContinuation("", first, tiny);
    expect(start.tokens).toEqual(tokensForChat(first, tiny));
    // The "model" replied with these ids, ending in <|im_end|>; they are what the session holds.
    const reply = [...tiny.encode("the quick brown fox", { add_special_tokens: false }), ...tiny.encode("<|im_end|>", { add_special_tokens: false })];
    const held = start.text + tiny.decode(reply, { skip_special_tokens: false });
    const next = chatContinuation(held, CONVERSATION, tiny);
    expect(next.text).toBe(renderChat(CONVERSATION, tiny));
    expect(tiny.decode([...start.tokens, ...reply, ...next.tokens])).toBe(next.text);
  });

  it("refuses to continue when the template re-renders earlier turns", () => {
    expect(() => chatContinuation("<|im_start|>user\nsomething else", CONVERSATION, tiny)).toThrow(/start a new session/);
    expect(() => chatDelta([{ role: "user", content: "other" }], CONVERSATION, tiny)).toThrow(/start a new session/);
  });
});

describe("loadTokenizer", () => {
  it("explains a directory without tokenizer.json", async () => {
    await expect(loadTokenizer(tmpdir())).rejects.toThrow(/has no tokenizer\.json/);
  });
});

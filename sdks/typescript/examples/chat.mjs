#!/usr/bin/env node
/**
 * Multi-turn chat against a running Kakeya daemon, the way an Electron main process would
 * drive it: one long-lived session, the app's own tokenizer and chat template, streamed
 * replies, Ctrl-C to stop a reply without losing the session.
 *
 *   kakeya serve --model smollm2-135m-instruct --bind 127.0.0.1:50051     # elsewhere
 *   node examples/chat.mjs                                  # interactive (a TTY), or a scripted demo
 *   node examples/chat.mjs "Hi!" "What did I just say?"     # these turns, then exit
 *
 * Options: --address HOST:PORT (env KAKEYA_ADDRESS, default 127.0.0.1:50051), --model-dir DIR
 * (default $KAKEYA_HOME/models/smollm2-135m-instruct, KAKEYA_HOME defaulting to ~/.cache/kakeya), --api-key KEY (env KAKEYA_API_KEY),
 * --max-tokens N (default 128). Needs @huggingface/tokenizers and @huggingface/jinja installed.
 *
 * The runtime only sees token ids. Each turn appends just the new tokens: the session already
 * holds the model's own reply tokens, so nothing is re-rendered or re-tokenized (ADR 0008 §2.2).
 */
import { homedir } from "node:os";
import path from "node:path";
import { createInterface } from "node:readline/promises";
import { parseArgs } from "node:util";

import { CancelledError, Client } from "@kakeya/runtime";
import { chatContinuation, loadTokenizer, renderChat, tokensForChat } from "@kakeya/runtime/tokenization";

const { values: opts, positionals: scripted } = parseArgs({
  allowPositionals: true,
  options: {
    address: { type: "string", default: process.env.KAKEYA_ADDRESS || "127.0.0.1:50051" },
    "model-dir": {
      type: "string",
      default: path.join(process.env.KAKEYA_HOME ?? path.join(homedir(), ".cache/kakeya"), "models/smollm2-135m-instruct"),
    },
    "api-key": { type: "string", default: process.env.KAKEYA_API_KEY },
    "max-tokens": { type: "string", default: "128" },
  },
});
const DEMO_TURNS = ["Hi! My name is Ada. Please remember it.", "Name three colors of the rainbow.", "What is my name?"];

const tokenizer = await loadTokenizer(opts["model-dir"]);
const client = new Client(opts.address, { apiKey: opts["api-key"] });
const info = await client.serverInfo();
console.error(`connected to ${opts.address}: ${info.modelId} (kv ${info.kvStrategy}, context ${info.maxContext})`);

let session; // one long-lived session; replaced only when the history can no longer be extended
let heldText = ""; // what the session's token history decodes to
let heldLength = 0; // how many tokens it holds, as far as we have seen
const messages = [];
let controller; // aborts the reply being streamed

process.on("SIGINT", () => {
  if (controller && !controller.signal.aborted) controller.abort(new Error("stopped by the user"));
  else process.exit(130);
});

/** Append the new user turn; start a new session when the history cannot be extended. */
async function appendTurn() {
  if (session) {
    let next;
    try {
      next = chatContinuation(heldText, messages, tokenizer);
    } catch (err) {
      // The template renders the conversation differently from what the session holds (e.g.
      // it drops earlier reasoning): the history is append-only, so start over below.
      if (!(err instanceof Error) || !/start a new session/.test(err.message)) throw err;
    }
    // append() resolves to the exact history length once a stopped reply has wound down: a
    // mismatch means the server committed reply tokens we never saw, so the history is not
    // the conversation we think it is.
    if (next && (await session.append(next.tokens)) === heldLength + next.tokens.length) {
      [heldText, heldLength] = [next.text, heldLength + next.tokens.length];
      return;
    }
    console.error("  (the session history no longer matches the conversation: starting a new session)");
    await session.close();
  }
  const tokens = tokensForChat(messages, tokenizer);
  session = await client.createSession({ initialTokens: tokens });
  [heldText, heldLength] = [renderChat(messages, tokenizer), tokens.length];
}

async function turn(userText) {
  messages.push({ role: "user", content: userText });
  await appendTurn();

  process.stdout.write("assistant> ");
  const reply = [];
  let printed = "";
  controller = new AbortController();
  try {
    for await (const id of session.generate({ maxTokens: Number(opts["max-tokens"]), signal: controller.signal })) {
      reply.push(id);
      const text = tokenizer.decode(reply, { skip_special_tokens: true });
      if (text.endsWith("\uFFFD")) continue; // half of a multi-byte character: wait for the rest
      process.stdout.write(text.slice(printed.length));
      printed = text;
    }
  } catch (err) {
    if (!(err instanceof CancelledError)) throw err;
    process.stdout.write(" [stopped]");
  } finally {
    controller = undefined;
  }
  process.stdout.write("\n");
  heldText += tokenizer.decode(reply, { skip_special_tokens: false });
  heldLength += reply.length;
  messages.push({ role: "assistant", content: tokenizer.decode(reply, { skip_special_tokens: true }) });

  const r = session.lastResult;
  if (r) {
    const decodeSeconds = r.totalSeconds - r.timeToFirstTokenSeconds;
    const rate = r.generatedTokens > 1 && decodeSeconds > 0 ? ((r.generatedTokens - 1) / decodeSeconds).toFixed(1) : "-";
    console.error(
      `  [${r.stopReason}: ${r.generatedTokens} tokens, prefilled ${r.prefillTokens} new tokens, ` +
        `first token ${(r.timeToFirstTokenSeconds * 1000).toFixed(0)} ms, ${rate} tok/s]`,
    );
  }
}

try {
  if (scripted.length || !process.stdin.isTTY) {
    for (const text of scripted.length ? scripted : DEMO_TURNS) {
      console.log(`user> ${text}`);
      await turn(text);
    }
  } else {
    const rl = createInterface({ input: process.stdin, output: process.stdout });
    rl.on("SIGINT", () => process.emit("SIGINT"));
    for (;;) {
      const text = (await rl.question("user> ")).trim();
      if (!text || text === "/quit") break;
      await turn(text);
    }
    rl.close();
  }
  const i = session && (await session.info());
  if (i) console.error(`session ${session.id.slice(0, 8)}…: ${i.historyLength} tokens, ${(i.kvLiveBytes / 1e6).toFixed(1)} MB KV resident`);
} finally {
  await session?.close().catch(() => {});
  client.close();
}

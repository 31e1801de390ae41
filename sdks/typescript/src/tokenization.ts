/**
 * Opt-in tokenization helpers ("@kakeya/runtime/tokenization"). The runtime takes raw token
 * ids only (ADR 0008 §2.4); chat templates are the application's choice, applied here on
 * the client side. Mirrors `kakeya.tokenization` in the Python SDK.
 *
 * The helpers take any tokenizer shaped like transformers.js's `PreTrainedTokenizer`
 * (`apply_chat_template`, `encode`, `decode`); `loadTokenizer(modelDir)` builds one from a
 * pulled model directory with the optional peer dependencies `@huggingface/tokenizers` and
 * `@huggingface/jinja`. The core SDK never imports this module.
 */
import { readFile } from "node:fs/promises";
import path from "node:path";

export interface ChatMessage {
  role: string;
  content: string;
  /** Templates may read other keys (name, tool_calls, ...). */
  [key: string]: unknown;
}

/** An OpenAI-style message: content as a string, null, or a list of text parts. */
export interface OpenAIMessage {
  role: string;
  content?: string | null | ReadonlyArray<{ type: string; text?: string }>;
  [key: string]: unknown;
}

/** What the helpers need; transformers.js tokenizers and `loadTokenizer()` results both fit. */
export interface ChatTokenizer {
  apply_chat_template(messages: ChatMessage[], options: Record<string, unknown>): unknown;
  encode(text: string, options?: { add_special_tokens?: boolean }): unknown;
  decode(ids: number[], options?: { skip_special_tokens?: boolean }): string;
}

export interface ChatTemplateOptions {
  /** End with the template's assistant prompt (default true). */
  addGenerationPrompt?: boolean;
  /** Extra template variables, e.g. `{ enable_thinking: false }` for Qwen3. */
  templateKwargs?: Record<string, unknown>;
}

/** Normalize OpenAI-style messages to `{ role, content: string }` for a chat template. */
export function fromOpenAIMessages(messages: ReadonlyArray<OpenAIMessage>): ChatMessage[] {
  return messages.map((m, i) => {
    const { role, content } = m ?? ({} as OpenAIMessage);
    if (typeof role !== "string") throw new TypeError(`messages[${i}] has no string 'role'`);
    let text: string;
    if (Array.isArray(content)) {
      text = content
        .map((part: unknown) => {
          const p = part as { type?: unknown; text?: unknown };
          if (p?.type !== "text" || typeof p.text !== "string") {
            throw new TypeError(`messages[${i}].content has a non-text part ${JSON.stringify(part)}; only text parts are supported`);
          }
          return p.text;
        })
        .join("");
    } else if (content === null || content === undefined) {
      text = "";
    } else if (typeof content === "string") {
      text = content;
    } else {
      throw new TypeError(`messages[${i}].content must be a string or a list of text parts`);
    }
    return { ...m, role, content: text };
  });
}

function asIds(value: unknown, what: string): number[] {
  if (Array.isArray(value) && value.every((v) => typeof v === "number" || typeof v === "bigint")) return value.map(Number);
  if (value && typeof value === "object") {
    const v = value as { input_ids?: unknown; ids?: unknown };
    if (v.input_ids !== undefined) return asIds(v.input_ids, what);
    if (v.ids !== undefined) return asIds(v.ids, what);
  }
  throw new TypeError(`${what} did not return token ids (got ${Object.prototype.toString.call(value)}); pass a transformers.js tokenizer or one from loadTokenizer()`);
}

function templateOptions(options: ChatTemplateOptions, tokenize: boolean): Record<string, unknown> {
  return { ...options.templateKwargs, add_generation_prompt: options.addGenerationPrompt ?? true, tokenize, return_tensor: false, return_dict: false };
}

/** Render `messages` with the tokenizer's own chat template and return the token ids. */
export function tokensForChat(messages: ReadonlyArray<OpenAIMessage>, tokenizer: ChatTokenizer, options: ChatTemplateOptions = {}): number[] {
  return asIds(tokenizer.apply_chat_template(fromOpenAIMessages(messages), templateOptions(options, true)), "apply_chat_template");
}

/** Render `messages` with the chat template, as text. */
export function renderChat(messages: ReadonlyArray<OpenAIMessage>, tokenizer: ChatTokenizer, options: ChatTemplateOptions = {}): string {
  const text = tokenizer.apply_chat_template(fromOpenAIMessages(messages), templateOptions(options, false));
  if (typeof text !== "string") throw new TypeError("apply_chat_template with tokenize: false did not return a string");
  return text;
}

/**
 * Tokens to append when a conversation grows from `previousMessages` to `messages`: the
 * rendered suffix, checked to extend the earlier rendering exactly (append-only).
 */
export function chatDelta(
  previousMessages: ReadonlyArray<OpenAIMessage>,
  messages: ReadonlyArray<OpenAIMessage>,
  tokenizer: ChatTokenizer,
  options: ChatTemplateOptions = {},
): number[] {
  const before = previousMessages.length ? tokensForChat(previousMessages, tokenizer, { ...options, addGenerationPrompt: false }) : [];
  const after = tokensForChat(messages, tokenizer, options);
  if (before.some((t, i) => after[i] !== t)) {
    throw new Error("the chat template re-renders earlier turns differently; start a new session instead of appending");
  }
  return after.slice(before.length);
}

/**
 * Continue a session whose history decodes to `heldText` so that it renders as `messages`.
 *
 * Use this across turns of a live session: its history holds the model's own reply tokens
 * (decode them with `skip_special_tokens: false` and add them to `heldText`), which a
 * re-tokenized reply need not match. Returns the tokens to append and the text the history
 * then renders as. Throws when the template renders the held conversation differently (e.g.
 * it strips earlier reasoning): start a new session from `tokensForChat(messages)` then.
 */
export function chatContinuation(
  heldText: string,
  messages: ReadonlyArray<OpenAIMessage>,
  tokenizer: ChatTokenizer,
  options: ChatTemplateOptions = {},
): { tokens: number[]; text: string } {
  const text = renderChat(messages, tokenizer, options);
  if (!text.startsWith(heldText)) {
    throw new Error("the chat template renders the conversation so far differently from the session history; start a new session");
  }
  const suffix = text.slice(heldText.length);
  const tokens = suffix ? asIds(tokenizer.encode(suffix, { add_special_tokens: false }), "encode") : [];
  return { tokens, text };
}

type SpecialToken = string | { content?: string } | null | undefined;

/** The parts of `@huggingface/tokenizers`' Tokenizer and `@huggingface/jinja`'s Template used here. */
interface TokenizerBackend {
  encode(text: string, options?: { add_special_tokens?: boolean }): { ids: number[] };
  decode(ids: number[], options?: { skip_special_tokens?: boolean }): string;
}
interface TemplateBackend {
  render(items: Record<string, unknown>): string;
}

/**
 * A tokenizer from a local model directory (tokenizer.json, tokenizer_config.json, and the
 * chat template from chat_template.jinja or tokenizer_config.json), built on
 * `@huggingface/tokenizers` and `@huggingface/jinja`.
 */
export class LocalTokenizer implements ChatTokenizer {
  readonly #tokenizer: TokenizerBackend;
  readonly #template: TemplateBackend | undefined;
  readonly #specialTokens: Record<string, string>;

  /** @internal use `loadTokenizer(modelDir)`. */
  constructor(tokenizer: TokenizerBackend, template: TemplateBackend | undefined, specialTokens: Record<string, string>) {
    this.#tokenizer = tokenizer;
    this.#template = template;
    this.#specialTokens = specialTokens;
  }

  get hasChatTemplate(): boolean {
    return this.#template !== undefined;
  }

  encode(text: string, options: { add_special_tokens?: boolean } = {}): number[] {
    return [...this.#tokenizer.encode(text, { add_special_tokens: options.add_special_tokens ?? true }).ids];
  }

  decode(ids: number[], options: { skip_special_tokens?: boolean } = {}): string {
    return this.#tokenizer.decode(ids, { skip_special_tokens: options.skip_special_tokens ?? false });
  }

  /** transformers.js-compatible: `tokenize` (default true) returns ids, else the rendered text. */
  apply_chat_template(messages: ChatMessage[], options: Record<string, unknown> = {}): number[] | string {
    if (!this.#template) throw new Error("this model directory has no chat template (chat_template.jinja or tokenizer_config.json)");
    const { tokenize = true, add_generation_prompt = false, return_tensor: _t, return_dict: _d, ...kwargs } = options;
    const text = this.#template.render({ ...this.#specialTokens, ...kwargs, messages, add_generation_prompt });
    // Like transformers: the template already placed any special tokens it wants.
    return tokenize ? this.encode(text, { add_special_tokens: false }) : text;
  }
}

async function readJson(file: string): Promise<Record<string, unknown> | undefined> {
  try {
    return JSON.parse(await readFile(file, "utf8")) as Record<string, unknown>;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return undefined;
    throw err;
  }
}

async function importPeer<T>(name: string): Promise<T> {
  try {
    return (await import(name)) as T;
  } catch (err) {
    throw new Error(`loadTokenizer needs the optional peer dependency ${name}: npm install @huggingface/tokenizers @huggingface/jinja`, { cause: err });
  }
}

/** Load the tokenizer and chat template of a model directory (e.g. one pulled by `kakeya models pull`). */
export async function loadTokenizer(modelDir: string): Promise<LocalTokenizer> {
  const tokenizerJson = await readJson(path.join(modelDir, "tokenizer.json"));
  if (!tokenizerJson) throw new Error(`${modelDir} has no tokenizer.json; pass a model directory (e.g. ~/.cache/kakeya/models/<name>)`);
  const config = (await readJson(path.join(modelDir, "tokenizer_config.json"))) ?? {};
  let template: string | undefined;
  try {
    template = await readFile(path.join(modelDir, "chat_template.jinja"), "utf8");
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== "ENOENT") throw err;
    const fromConfig = config.chat_template as string | Array<{ name: string; template: string }> | undefined;
    template = Array.isArray(fromConfig) ? fromConfig.find((t) => t.name === "default")?.template : fromConfig;
  }
  const specialTokens: Record<string, string> = {};
  for (const key of ["bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"]) {
    const v = config[key] as SpecialToken;
    const s = typeof v === "string" ? v : v?.content;
    if (typeof s === "string") specialTokens[key] = s;
  }
  const { Tokenizer } = await importPeer<{ Tokenizer: new (json: object, config: object) => TokenizerBackend }>("@huggingface/tokenizers");
  const { Template } = await importPeer<{ Template: new (source: string) => TemplateBackend }>("@huggingface/jinja");
  return new LocalTokenizer(new Tokenizer(tokenizerJson, config), template === undefined ? undefined : new Template(template), specialTokens);
}

/**
 * Plain result objects the SDK returns (no generated protobuf types leak to callers), and
 * their conversions from the wire messages. Mirrors `kakeya.types` in the Python SDK.
 */
import {
  StopReason as PbStopReason,
  type DoneEvent,
  type GetServerInfoResponse,
  type GetSessionInfoResponse,
  PersistenceInfo as PbPersistenceInfo,
} from "./gen/kakeya/v1/runtime.js";

export type StopReason = "max_tokens" | "eos" | "cancelled" | "context_full" | "unspecified";

const STOP_REASONS: ReadonlyMap<PbStopReason, StopReason> = new Map([
  [PbStopReason.STOP_REASON_MAX_TOKENS, "max_tokens"],
  [PbStopReason.STOP_REASON_EOS, "eos"],
  [PbStopReason.STOP_REASON_CANCELLED, "cancelled"],
  [PbStopReason.STOP_REASON_CONTEXT_FULL, "context_full"],
]);

/** A bounded KV strategy dropped positions from attention during a Generate call. */
export interface HistoryTruncation {
  /** Positions newly dropped during this call. */
  readonly droppedTokens: number;
  /** Positions dropped over the session's lifetime. */
  readonly totalDroppedTokens: number;
}

/** What one Generate call did: its Done event plus the tokens and truncations it streamed. */
export interface GenerationResult {
  readonly stopReason: StopReason;
  readonly generatedTokens: number;
  /** Tokens prefilled by this call: only those appended since the previous Generate. */
  readonly prefillTokens: number;
  readonly prefillSeconds: number;
  readonly totalSeconds: number;
  readonly timeToFirstTokenSeconds: number;
  readonly draftedTokens: number;
  readonly acceptedTokens: number;
  readonly tokens: readonly number[];
  readonly historyTruncated: readonly HistoryTruncation[];
  /**
   * History tokens on disk once this turn was saved (the daemon saves it before Done): what the
   * session resumes with after a crash; 0 when the daemon does not persist sessions.
   */
  readonly durableLength: number;
  /** Why the turn's save failed (e.g. "No space left on device"); "" when it did not. */
  readonly saveError: string;
  /**
   * Positions the daemon ran through the model again before this turn (not in prefillTokens): a
   * `paged` session re-encoded as it passed the model's trained context; 0 otherwise.
   */
  readonly reencodedTokens: number;
}

export interface SessionInfo {
  readonly sessionId: string;
  readonly historyLength: number;
  /** Positions whose K/V are resident (attendable without restoration). */
  readonly residentPositions: number;
  /** Tokens recorded but not yet prefilled (the next Generate prefills them). */
  readonly pendingTokens: number;
  /** KV bytes held for attention every step: kvResidentBytes + kvSelectionBytes. */
  readonly kvLiveBytes: number;
  /** The hot set (sink, window, recalled pages); flat in the history length for bounded strategies. */
  readonly kvResidentBytes: number;
  /** What queries score to choose pages (paged: compact keys); 0 for strategies without pages. */
  readonly kvSelectionBytes: number;
  /**
   * Warm: exact K/V of evicted positions kept outside the hot set in host RAM (paged: the page store,
   * at most the daemon's --page-ram-mb of it per session); 0 otherwise.
   */
  readonly kvStoredBytes: number;
  /**
   * Cold: exact K/V of evicted positions held on disk (paged: pages past --page-ram-mb, read back from
   * a memory-mapped spill file); 0 while the page store fits its RAM budget, and for the other strategies.
   */
  readonly kvColdBytes: number;
  readonly idleSeconds: number;
  /** Positions dropped from attention over the session's lifetime. */
  readonly droppedTokens: number;
  readonly eosTokenIds: readonly number[];
  /** History tokens on disk: what the session resumes with after a crash (only saved turns are durable). */
  readonly durableLength: number;
  /** Why this session's saves fail ("" while they do not). */
  readonly saveError: string;
}

/** Session persistence: where and when sessions are saved to disk. */
export interface PersistenceInfo {
  /** "turn" (saved after every turn, resumed after a restart), "off" (memory only), "" (not reported). */
  readonly mode: string;
  /** The state directory sessions are saved under ("" when off). */
  readonly stateDir: string;
  /** Several daemons share the state directory (replicas behind a proxy), each session held by one through a lease. */
  readonly shared: boolean;
  /** This daemon's name in the leases (what `SessionOwnedElsewhereError.owner` names); "" unless shared. */
  readonly daemonId: string;
  /** Seconds without a heartbeat after which a daemon's sessions may be taken over; 0 unless shared. */
  readonly leaseTtlSeconds: number;
}

export interface ServerInfo {
  readonly modelId: string;
  readonly vocabSize: number;
  readonly defaultEosTokenIds: readonly number[];
  /** "full", "sink_window" or "dlm_restore". */
  readonly kvStrategy: string;
  /**
   * The strategy's parameters as the server reports them (strings): "compressor" always,
   * "sink" / "window" for bounded strategies, research keys for research strategies (those
   * are not product surface and may change between releases).
   */
  readonly kvParams: Readonly<Record<string, string>>;
  /** Attention-sink positions of a bounded strategy (kvParams.sink; 0 under `full`). */
  readonly sink: number;
  /** Sliding-window positions of a bounded strategy (kvParams.window; 0 under `full`). */
  readonly window: number;
  /** The resident cache store (kvParams.compressor; "identity" = uncompressed). */
  readonly compressor: string;
  /** Trained context of the model (max_position_embeddings). */
  readonly maxContext: number;
  readonly backend: string;
  readonly device: string;
  readonly serverVersion: string;
  readonly sessionCapacity: number;
  readonly idleTtlSeconds: number;
  /** Speculative decoding drafter ("" when off) and its block size. */
  readonly drafter: string;
  readonly specK: number;
  readonly persistence: PersistenceInfo;
  /** Most tokens one append (or createSession's initialTokens) may carry; 0 = no limit. */
  readonly maxAppendTokens: number;
  /** Most tokens a session may hold appended but not yet prefilled (generate prefills them); 0 = no limit. */
  readonly maxPendingTokens: number;
}

export function generationResult(done: DoneEvent, tokens: readonly number[], truncated: readonly HistoryTruncation[]): GenerationResult {
  return {
    stopReason: STOP_REASONS.get(done.stopReason) ?? "unspecified",
    generatedTokens: done.generatedTokens,
    prefillTokens: done.prefillTokens,
    prefillSeconds: done.prefillSeconds,
    totalSeconds: done.totalSeconds,
    timeToFirstTokenSeconds: done.timeToFirstTokenSeconds,
    draftedTokens: done.draftedTokens,
    acceptedTokens: done.acceptedTokens,
    tokens: [...tokens],
    historyTruncated: [...truncated],
    durableLength: done.durableLength,
    saveError: done.saveError,
    reencodedTokens: done.reencodedTokens,
  };
}

/**
 * A wire message's fields as a plain object: every field of `r` under its own name (repeated
 * fields as fresh arrays), less `omit` (deprecated wire fields). The mappings below are driven by
 * the message, so a field added to the proto needs only its SDK interface entry: `Exactly` fails
 * the typecheck while the interface and the copied fields differ.
 */
function copyFields<P extends object, O extends keyof P = never>(r: P, omit: readonly O[] = []): Copied<P, O> {
  const skip: readonly PropertyKey[] = omit;
  const out: Record<string, unknown> = {};
  for (const [k, v] of Object.entries(r)) if (!skip.includes(k)) out[k] = Array.isArray(v) ? [...v] : v;
  return out as Copied<P, O>;
}

type Copied<P, O extends keyof P> = { readonly [K in Exclude<keyof P, O>]: P[K] extends (infer E)[] ? readonly E[] : P[K] };

/** T when its fields are exactly K; else a type naming the fields that differ (returning it fails to compile). */
type Exactly<T, K extends PropertyKey> =
  [Exclude<keyof T, K> | Exclude<K, keyof T>] extends [never] ? T : { fieldsThatDiffer: Exclude<keyof T, K> | Exclude<K, keyof T> };

/** Wire fields the SDK does not surface. */
type SessionInfoOmitted = "inv1Violations" | "inv2Violations";
const SESSION_INFO_OMITTED: readonly SessionInfoOmitted[] = ["inv1Violations", "inv2Violations"];

export function sessionInfo(r: GetSessionInfoResponse): Exactly<SessionInfo, Exclude<keyof GetSessionInfoResponse, SessionInfoOmitted>> {
  return copyFields(r, SESSION_INFO_OMITTED);
}

function persistenceInfo(p: PbPersistenceInfo | undefined): Exactly<PersistenceInfo, keyof PbPersistenceInfo> {
  return copyFields(p ?? PbPersistenceInfo.create());
}

/** ServerInfo fields the wire does not carry under their own name: computed from kvStrategy's params. */
type ServerInfoDerived = "kvParams" | "sink" | "window" | "compressor";

export function serverInfo(r: GetServerInfoResponse): Exactly<ServerInfo, keyof GetServerInfoResponse | ServerInfoDerived> {
  const k = r.kvStrategy;
  const params: Record<string, string> = Object.fromEntries(Object.entries(k?.params ?? {}).sort(([a], [b]) => a.localeCompare(b)));
  return {
    ...copyFields(r),
    kvStrategy: k?.name ?? "",
    kvParams: Object.freeze(params),
    sink: Number(params.sink ?? 0),
    window: Number(params.window ?? 0),
    compressor: params.compressor ?? "identity",
    persistence: persistenceInfo(r.persistence),
  };
}

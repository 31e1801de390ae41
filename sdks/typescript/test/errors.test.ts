/** Status -> error class mapping, without a daemon. */
import { describe, expect, it } from "vitest";

import { fromStatus, toKakeyaError } from "../src/errors.js";
import * as sdk from "../src/index.js";

const { Status } = sdk;

const CLASSES: Array<[number, typeof sdk.KakeyaError]> = [
  [Status.INVALID_ARGUMENT, sdk.InvalidArgumentError],
  [Status.NOT_FOUND, sdk.SessionNotFoundError],
  [Status.ALREADY_EXISTS, sdk.AlreadyExistsError],
  [Status.UNAUTHENTICATED, sdk.UnauthenticatedError],
  [Status.PERMISSION_DENIED, sdk.PermissionDeniedError],
  [Status.FAILED_PRECONDITION, sdk.FailedPreconditionError],
  [Status.OUT_OF_RANGE, sdk.OutOfRangeError],
  [Status.RESOURCE_EXHAUSTED, sdk.ResourceExhaustedError],
  [Status.CANCELLED, sdk.CancelledError],
  [Status.DEADLINE_EXCEEDED, sdk.DeadlineExceededError],
  [Status.UNAVAILABLE, sdk.UnavailableError],
  [Status.INTERNAL, sdk.InternalError],
];

describe("typed errors", () => {
  it.each(CLASSES)("status %i maps to its class", (code, cls) => {
    const err = fromStatus({ code, details: "what went wrong" });
    expect(err).toBeInstanceOf(cls);
    expect(err).toBeInstanceOf(sdk.KakeyaError);
    expect(err).toBeInstanceOf(Error);
    expect(err.code).toBe(code);
    expect(cls.code).toBe(code);
    expect(err.details).toBe("what went wrong");
    expect(err.message).toBe("what went wrong");
    expect(err.name).toBe(cls.name);
    expect(err.codeName).toBe(Status[code]);
  });

  it("other statuses are a plain KakeyaError that keeps the code", () => {
    const err = fromStatus({ code: Status.DATA_LOSS, details: "" });
    expect(err.constructor).toBe(sdk.KakeyaError);
    expect(err.code).toBe(Status.DATA_LOSS);
    expect(err.details).toBe("DATA_LOSS");
  });

  it("a class built directly carries its own code", () => {
    expect(new sdk.SessionNotFoundError("gone").code).toBe(Status.NOT_FOUND);
    expect(new sdk.KakeyaError("x").code).toBe(Status.UNKNOWN);
  });

  it("an aborted signal wins over the status it caused", () => {
    const err = toKakeyaError({ code: Status.CANCELLED, details: "Cancelled on client" }, AbortSignal.abort("stop"));
    expect(err).toBeInstanceOf(sdk.CancelledError);
    expect((err as Error).cause).toBe("stop");
  });

  it("non-gRPC errors pass through", () => {
    const bug = new TypeError("bug");
    expect(toKakeyaError(bug)).toBe(bug);
  });
});

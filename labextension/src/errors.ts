/** The typed error of Infinijup requests (no JupyterLab imports). */

/**
 * A failed request to the Infinijup server extension.
 *
 * `message` and `reason` come from the server's JSON error body
 * (`{"message": str, "reason": str}`) when there is one; otherwise they
 * describe the transport failure (`reason` is then `network_error`,
 * `extension_missing`, `http_<status>` or `bad_response`).
 */
export class InfinijupRequestError extends Error {
  constructor(
    message: string,
    readonly reason: string,
    readonly status: number,
    readonly url: string = ''
  ) {
    super(message);
    this.name = 'InfinijupRequestError';
  }

  /** One line for a notification: the message, then the reason. */
  describe(): string {
    return this.reason ? `${this.message} (${this.reason})` : this.message;
  }
}

/** Turn anything thrown into an InfinijupRequestError. */
export function asRequestError(error: unknown): InfinijupRequestError {
  if (error instanceof InfinijupRequestError) {
    return error;
  }
  const message = error instanceof Error ? error.message : String(error);
  return new InfinijupRequestError(message, 'error', 0);
}

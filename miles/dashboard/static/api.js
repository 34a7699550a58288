// Same-origin JSON calls carrying the API token (kept in sessionStorage, never in a URL).

const TOKEN_KEY = "miles-dashboard-token";

/** The API answered 401: the page shows the login again with `message` (the API's detail). */
export class AuthError extends Error {}

/** Any other non-2xx answer; `message` is the API's detail as text. */
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

/** The API's `detail` as text: a string as it is; FastAPI's 422 list as one "loc: msg" line per entry. */
export function detailText(detail) {
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {
    return detail.map((entry) => {
      const loc = Array.isArray(entry?.loc) ? entry.loc.join(".") : "";
      const msg = entry?.msg ?? JSON.stringify(entry);
      return loc ? `${loc}: ${msg}` : String(msg);
    }).join("\n");
  }
  return JSON.stringify(detail);
}

/** Calls `path` (a relative URL) and returns its JSON; throws AuthError on 401, ApiError otherwise. */
export async function request(path, { method = "GET", body, contentType } = {}) {
  const headers = { Accept: "application/json" };
  const saved = token.get();
  if (saved) headers.Authorization = `Bearer ${saved}`;
  if (contentType) headers["Content-Type"] = contentType;
  const response = await fetch(path, { method, body, headers, cache: "no-store", credentials: "same-origin" });
  const text = await response.text();
  let payload = null;
  try {
    payload = text ? JSON.parse(text) : null;
  } catch {
    // Not JSON (a proxy's error page, say): the status line and the start of the body say enough.
  }
  if (response.ok && (payload !== null || !text)) return payload;
  const detail = payload && payload.detail !== undefined
    ? detailText(payload.detail)
    : `${response.status} ${response.statusText}${text ? `: ${text.slice(0, 300)}` : ""}`;
  if (response.status === 401) throw new AuthError(detail);
  throw new ApiError(response.status, detail);
}

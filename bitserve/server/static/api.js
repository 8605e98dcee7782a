// Calls to the bitserve API from the page: the API key (kept in localStorage, sent as a Bearer token),
// JSON requests with OpenAI-shaped errors, and a chat completion streamed over SSE.

const KEY_STORAGE = "bitserve.apiKey";

export function loadApiKey() {
  return localStorage.getItem(KEY_STORAGE) || "";
}

export function saveApiKey(key) {
  if (key) localStorage.setItem(KEY_STORAGE, key);
  else localStorage.removeItem(KEY_STORAGE);
}

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function headers(extra = {}) {
  const key = loadApiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// The server answers errors as {"error": {"message", "type", "code", "hint"}}: say what to do about it.
async function errorOf(response) {
  let detail = {};
  try {
    detail = (await response.json()).error || {};
  } catch {
    // not JSON (a proxy's page): the status alone
  }
  let message = detail.message || `HTTP ${response.status}`;
  if (response.status === 401) message += " (enter an API key above)";
  else if (detail.hint) message += ` (${detail.hint})`;
  return new ApiError(response.status, message, detail.code);
}

// Run `refresh` (async) now and then `intervalMs` after each run ends (never two at once).
export function pollEvery(intervalMs, refresh) {
  const poll = async () => {
    await refresh();
    setTimeout(poll, intervalMs);
  };
  poll();
}

export async function getJson(path, signal) {
  const response = await fetch(path, { headers: headers(), signal });
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

// The `data:` payloads of an SSE body, one at a time, as they arrive (events end with a blank line;
// `:` lines are keep-alive comments).
async function* ssePayloads(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replaceAll("\r\n", "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""));
        if (data.length) yield data.join("\n");
      }
    }
  } finally {
    await reader.cancel().catch(() => {}); // a no-op when the body ended; else frees the connection
  }
}

// POST a chat completion with `stream: true`; `onChunk` gets each JSON chunk. Resolves when the
// stream ends ([DONE]); rejects with an ApiError (HTTP or in-stream error) or an AbortError (stopped).
export async function streamChat(body, signal, onChunk) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  for await (const payload of ssePayloads(response.body)) {
    if (payload === "[DONE]") return;
    const chunk = JSON.parse(payload);
    if (chunk.error) throw new ApiError(response.status, chunk.error.message, chunk.error.code);
    onChunk(chunk);
  }
}

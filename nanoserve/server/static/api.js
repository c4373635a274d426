// Talking to the server: every call carries the API key, if the server wants one (`nanoserve serve --api-key`).
// The key is asked for on the first 401 and kept in this tab's sessionStorage (gone when the tab closes).
// Streams (chat, /v1/engine/events) are read with fetch rather than EventSource, which cannot send a header.

const KEY_ITEM = "nanoserve.apiKey";
let asking = null; // the open key dialog's promise: several calls that get 401 at once share one dialog

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM);
}

export function askForKey() {
  if (asking) return asking;
  const dialog = document.getElementById("key-dialog");
  const input = document.getElementById("key-input");
  input.value = apiKey() || "";
  asking = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      asking = null;
      if (dialog.returnValue === "ok" && input.value.trim()) {
        sessionStorage.setItem(KEY_ITEM, input.value.trim());
        resolve(true);
      } else {
        resolve(false);
      }
    }, { once: true });
    dialog.showModal();
  });
  return asking;
}

// fetch(path) with the key; on a 401, asks for the key and tries again (until the person cancels the dialog).
export async function apiFetch(path, options = {}) {
  for (;;) {
    const headers = { ...(options.headers || {}) };
    const key = apiKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    if (!(await askForKey())) return response;
  }
}

// The server's error message from an error response ({"error": {"message", ...}}), or the status line.
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}`;
}

// Calls onData(text) for each `data:` of a server-sent-events response body, until it ends or is aborted.
export async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) onData(data.join("\n"));
    }
  }
}

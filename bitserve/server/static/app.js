// The playground's entry module: wires the API key field, the model picker, the sampling controls,
// the chat, the request shown as curl / Python, and the live stats.

import { loadApiKey, saveApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { ModelPicker } from "./models.js";
import { curlSnippet, pythonSnippet } from "./snippets.js";
import { StatsView } from "./stats.js";

const byId = (id) => document.getElementById(id);

function numberField(id) {
  const value = byId(id).value.trim();
  return value === "" ? undefined : Number(value);
}

// The request body for `messages` (history and the new user turn), from the controls as they are now.
function buildRequest(model, messages) {
  const system = byId("system-prompt").value.trim();
  const body = {
    model,
    messages: system ? [{ role: "system", content: system }, ...messages] : messages,
    temperature: numberField("temperature"),
    top_p: numberField("top-p"),
    max_tokens: numberField("max-tokens"),
    seed: numberField("seed"),
    stream: true,
    stream_options: { include_usage: true },
  };
  for (const key of Object.keys(body)) if (body[key] === undefined) delete body[key];
  return body;
}

function showRequest(body) {
  byId("snippet-curl").textContent = curlSnippet(location.origin, body);
  byId("snippet-python").textContent = pythonSnippet(location.origin, body);
}

function wireSnippetTabs() {
  for (const tab of document.querySelectorAll("[data-snippet]")) {
    tab.addEventListener("click", () => {
      for (const other of document.querySelectorAll("[data-snippet]")) {
        const isActive = other === tab;
        other.setAttribute("aria-selected", String(isActive));
        byId(`snippet-${other.dataset.snippet}`).hidden = !isActive;
      }
    });
  }
  byId("copy-snippet").addEventListener("click", async () => {
    const shown = document.querySelector(".snippet:not([hidden])");
    try {
      await navigator.clipboard.writeText(shown.textContent);
      byId("copy-status").textContent = "copied";
    } catch {
      getSelection().selectAllChildren(shown); // no clipboard access (not a secure context): select it
      byId("copy-status").textContent = "selected: press Ctrl+C";
    }
  });
}

function main() {
  const status = byId("status");
  const picker = new ModelPicker(byId("model"), byId("model-details"), status, () => refreshRequest());
  const chat = new Chat(
    {
      transcript: byId("transcript"),
      prompt: byId("prompt"),
      send: byId("send"),
      stop: byId("stop"),
      clear: byId("clear"),
    },
    (messages) => buildRequest(picker.alias, messages),
    showRequest,
  );
  const refreshRequest = () => showRequest(buildRequest(picker.alias, chat.pendingMessages()));
  byId("settings").addEventListener("input", refreshRequest);
  byId("prompt").addEventListener("input", refreshRequest);

  const keyField = byId("api-key");
  keyField.value = loadApiKey();
  const stats = new StatsView(
    Object.fromEntries(
      ["phase", "active", "waiting", "batch", "batchedTokens", "tokensPerS", "kvPercent"].map((name) => [
        name,
        byId(`stat-${name}`),
      ]),
    ),
    { svg: byId("stats-chart"), legend: byId("stats-legend") },
    byId("stats-status"),
    () => picker.alias,
  );
  byId("save-key").addEventListener("click", () => {
    saveApiKey(keyField.value.trim());
    picker.refresh();
    stats.refresh();
  });

  wireSnippetTabs();
  refreshRequest();
  picker.start();
  stats.start();
}

main();

// The conversation: the transcript, one streamed answer at a time, and the stop button. Stopping
// aborts the fetch; the server sees the client go and aborts the sequence, freeing its KV blocks.

import { streamChat } from "./api.js";

function bubble(role, text) {
  const node = document.createElement("article");
  node.className = `message ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  const meta = document.createElement("div");
  meta.className = "meta";
  node.append(content, meta);
  return node;
}

// "model · version · N tokens · X tok/s · finish: stop", from what the stream said about itself.
function describeAnswer(seen, seconds) {
  const parts = [seen.model, seen.version];
  if (seen.usage) {
    parts.push(`${seen.usage.completion_tokens} tokens`);
    if (seconds > 0) parts.push(`${(seen.usage.completion_tokens / seconds).toFixed(1)} tok/s`);
  }
  if (seen.finish) parts.push(`finish: ${seen.finish}`);
  return parts.filter(Boolean).join(" · ");
}

export class Chat {
  // elements: {transcript, prompt, send, stop, clear}; buildRequest(messages) -> the request body;
  // onRequest(body): the request about to be sent
  constructor(elements, buildRequest, onRequest) {
    this.elements = elements;
    this.buildRequest = buildRequest;
    this.onRequest = onRequest;
    this.history = [];
    this.controller = null;
    elements.send.addEventListener("click", () => this.send());
    elements.stop.addEventListener("click", () => this.stop());
    elements.clear.addEventListener("click", () => this.clear());
    elements.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) this.send();
    });
    this.setBusy(false);
  }

  // The messages the next send would carry (the typed prompt as the last user turn).
  pendingMessages() {
    const text = this.elements.prompt.value.trim();
    return text ? [...this.history, { role: "user", content: text }] : [...this.history];
  }

  setBusy(isBusy) {
    this.elements.send.disabled = isBusy;
    this.elements.stop.disabled = !isBusy;
    this.elements.transcript.setAttribute("aria-busy", String(isBusy));
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  clear() {
    this.stop();
    this.history = [];
    this.elements.transcript.replaceChildren();
  }

  async send() {
    const text = this.elements.prompt.value.trim();
    if (!text || this.controller) return;
    const question = { role: "user", content: text };
    const body = this.buildRequest([...this.history, question]);
    this.onRequest(body);
    const answer = bubble("assistant", "");
    this.elements.transcript.append(bubble("user", text), answer);
    this.elements.prompt.value = "";
    await this.receive(body, question, answer);
  }

  async receive(body, question, answer) {
    const content = answer.querySelector(".content");
    const meta = answer.querySelector(".meta");
    this.controller = new AbortController();
    this.setBusy(true);
    answer.dataset.state = "streaming";
    const seen = {}; // model, version, usage and finish reason, from the chunks
    let firstTokenAt = 0;
    try {
      await streamChat(body, this.controller.signal, (chunk) => {
        seen.model = chunk.model;
        seen.version = chunk.model_version;
        seen.usage = chunk.usage || seen.usage;
        seen.finish = chunk.choices?.[0]?.finish_reason || seen.finish;
        const delta = chunk.choices?.[0]?.delta?.content;
        if (delta) {
          firstTokenAt ||= performance.now();
          content.textContent += delta;
          this.elements.transcript.scrollTop = this.elements.transcript.scrollHeight;
        }
      });
      answer.dataset.state = "done";
      meta.textContent = describeAnswer(seen, (performance.now() - firstTokenAt) / 1000);
    } catch (error) {
      const isStopped = error.name === "AbortError";
      answer.dataset.state = isStopped ? "stopped" : "error";
      const stopped = [describeAnswer(seen, 0), "stopped"].filter(Boolean).join(" · ");
      meta.textContent = isStopped ? stopped : error.message;
    } finally {
      this.controller = null;
      this.setBusy(false);
    }
    // a failed turn is not context; nor is one the user cleared away while it streamed
    if (answer.dataset.state !== "error" && answer.isConnected) {
      this.history.push(question, { role: "assistant", content: content.textContent });
    }
  }
}

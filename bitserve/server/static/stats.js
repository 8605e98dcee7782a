// Live view of GET /v1/stats (the `metrics` scope): the picked model's requests in flight, waiting
// requests, last step's batch, tokens/s and KV cache use, polled every second, with a chart.

import { getJson, pollEvery } from "./api.js";
import { LineChart, formatNumber } from "./chart.js";

const POLL_MS = 1000;

// /v1/stats gives the default model at the top level and every model under `models`.
function modelStats(payload, alias) {
  return (payload.models && payload.models[alias]) || payload;
}

export function summarize(payload, alias) {
  const stats = modelStats(payload, alias);
  const batching = stats.batching || {};
  return {
    phase: payload.phase,
    active: stats.requests?.num_active ?? 0,
    waiting: batching.num_waiting ?? 0,
    queuedTokens: stats.requests?.num_queued_prompt_tokens ?? 0,
    batch: batching.num_running ?? 0,
    batchedTokens: batching.num_batched_tokens ?? 0,
    tokensPerS: stats.throughput?.tokens_per_s ?? 0,
    kvPercent: 100 * (stats.kv_cache?.usage ?? 0),
  };
}

export class StatsView {
  // fields: {name: element} for each summarize() key; chart: {svg, legend}; status: an element
  constructor(fields, chart, status, currentAlias) {
    this.fields = fields;
    this.status = status;
    this.currentAlias = currentAlias;
    this.chart = new LineChart(chart.svg, chart.legend, [
      { key: "tokensPerS", label: "tok/s", unit: "", className: "series-a" },
      { key: "active", label: "running", unit: "", className: "series-b" },
      { key: "kvPercent", label: "KV", unit: "%", className: "series-c" },
    ]);
  }

  start() {
    pollEvery(POLL_MS, () => this.refresh());
  }

  async refresh() {
    if (document.hidden) return;
    try {
      const summary = summarize(await getJson("/v1/stats"), this.currentAlias());
      for (const [name, node] of Object.entries(this.fields)) {
        node.textContent = name === "phase" ? summary.phase : formatNumber(summary[name]);
      }
      this.chart.push(summary);
      this.status.textContent = "";
    } catch (error) {
      this.status.textContent = `stats: ${error.message}`;
    }
  }
}

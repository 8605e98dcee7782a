// The model picker, from GET /v1/models (the `models:read` scope): each alias with its version,
// device(s) and state; refreshed every few seconds, so models loaded or swapped meanwhile show up.

import { getJson, pollEvery } from "./api.js";

const REFRESH_MS = 5000;

function describe(model) {
  const devices = (model.devices && model.devices.length ? model.devices : [model.device]).join(", ");
  return [
    ["version", model.version],
    ["device", devices],
    ["state", model.state],
    ["file", model.file],
    ["formats", (model.quant_formats || []).join(", ")],
  ];
}

export class ModelPicker {
  // select: the <select>; details: a <dl>; status: an element for errors; onChange(alias)
  constructor(select, details, status, onChange) {
    this.select = select;
    this.details = details;
    this.status = status;
    this.models = [];
    select.addEventListener("change", () => {
      this.showDetails();
      onChange(select.value);
    });
  }

  get alias() {
    return this.select.value;
  }

  start() {
    pollEvery(REFRESH_MS, () => this.refresh());
  }

  async refresh() {
    try {
      this.models = (await getJson("/v1/models")).data;
      this.status.textContent = this.models.length ? "" : "no model is loaded";
    } catch (error) {
      this.models = [];
      this.status.textContent = `models: ${error.message}`;
    }
    this.render();
  }

  render() {
    const previous = this.select.value;
    const options = this.models.map((model) => {
      const option = document.createElement("option");
      option.value = model.id;
      const label = [model.id, model.version || "?", model.state, model.is_default ? "default" : ""];
      option.textContent = label.filter(Boolean).join(" · ");
      return option;
    });
    this.select.replaceChildren(...options);
    const fallback = this.models.find((model) => model.is_default) || this.models[0];
    if (this.models.some((model) => model.id === previous)) this.select.value = previous;
    else if (fallback) this.select.value = fallback.id;
    this.showDetails();
    if (this.select.value !== previous) this.select.dispatchEvent(new Event("change"));
  }

  showDetails() {
    const model = this.models.find((entry) => entry.id === this.select.value);
    const rows = model ? describe(model) : [];
    this.details.replaceChildren(
      ...rows.flatMap(([name, value]) => {
        const term = document.createElement("dt");
        const detail = document.createElement("dd");
        term.textContent = name;
        detail.textContent = value ?? "–";
        return [term, detail];
      }),
    );
  }
}

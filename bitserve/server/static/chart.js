// A small hand-written SVG line chart: a few series over the last N samples, each scaled to its own
// maximum (tokens/s and a request count do not share a unit), with a legend of current values. Colours
// come from the stylesheet, by each series' class name.

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 300;
const HEIGHT = 90;
const PAD = 4;

function element(name, attributes) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  return node;
}

export class LineChart {
  // series: [{key, label, unit, className}]; capacity: samples kept
  constructor(svg, legend, series, capacity = 60) {
    this.svg = svg;
    this.legend = legend;
    this.series = series;
    this.capacity = capacity;
    this.samples = [];
    svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
    svg.setAttribute("preserveAspectRatio", "none");
  }

  push(sample) {
    this.samples.push(sample);
    if (this.samples.length > this.capacity) this.samples.shift();
    this.render();
  }

  points(key) {
    const values = this.samples.map((sample) => sample[key] ?? 0);
    const top = Math.max(...values, 1e-9);
    const step = (WIDTH - 2 * PAD) / Math.max(this.capacity - 1, 1);
    const offset = this.capacity - values.length; // new samples enter on the right
    return values.map((value, i) => {
      const x = PAD + (offset + i) * step;
      const y = HEIGHT - PAD - (value / top) * (HEIGHT - 2 * PAD);
      return `${x.toFixed(1)},${y.toFixed(1)}`;
    });
  }

  render() {
    this.svg.replaceChildren(
      element("line", { x1: 0, y1: HEIGHT - PAD, x2: WIDTH, y2: HEIGHT - PAD, class: "axis" }),
    );
    for (const { key, className } of this.series) {
      const points = this.points(key);
      if (points.length < 2) continue;
      this.svg.append(element("polyline", { points: points.join(" "), class: `line ${className}` }));
    }
    const last = this.samples.at(-1) || {};
    this.legend.replaceChildren(
      ...this.series.map(({ key, label, unit, className }) => {
        const item = document.createElement("span");
        const swatch = document.createElement("i");
        swatch.className = `swatch ${className}`;
        item.append(swatch, `${label} ${formatNumber(last[key])}${unit || ""}`);
        return item;
      }),
    );
  }
}

export function formatNumber(value) {
  if (value === undefined || value === null) return "–";
  return Number.isInteger(value) ? String(value) : value.toFixed(1);
}

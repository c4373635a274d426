// Small canvas charts for the engine view, with no library: a time series (line and area), stacked step bars,
// and the KV block grid. Each draws the whole canvas from its data every time it is called.

// The canvas at its CSS width and `height` CSS pixels, sharp on high-DPI screens; returns its 2D context.
export function fitCanvas(canvas, height) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  canvas.style.height = `${height}px`;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return { ctx, width, height };
}

export function cssColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

// 1, 2 or 5 times a power of ten, at least `value`: a y axis's top.
export function niceCeil(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const m of [1, 2, 5, 10]) if (m * power >= value) return m * power;
  return 10 * power;
}

export function formatNumber(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Number.isInteger(v) && v < 1000) return String(v);
  if (v >= 10000) return `${(v / 1000).toFixed(0)}k`;
  if (v >= 1000) return `${(v / 1000).toFixed(1)}k`;
  if (v >= 100) return v.toFixed(0);
  if (v >= 10) return v.toFixed(1);
  return v.toFixed(v >= 1 ? 1 : 2);
}

const AXIS = "#5d6678";
const GRID = "rgba(255,255,255,0.06)";
const LEFT = 34; // room for the y labels

// A time series over the last `span` seconds up to `now` (seconds): points [{t, v}], v null for no value. The line
// breaks at a null, unless `connect` (a sparse series: seconds in which no request got its first token, say); a
// point with no neighbour is drawn as a dot.
export function timeChart(canvas, points, { span, now, color, connect = false, height = 110 }) {
  const { ctx, width, height: h } = fitCanvas(canvas, height);
  const top = 6, bottom = h - 16, plotW = width - LEFT - 4;
  const visible = points.filter((p) => p.t >= now - span && p.v !== null);
  const max = niceCeil(Math.max(0, ...visible.map((p) => p.v)) * 1.1);
  const x = (t) => LEFT + ((t - (now - span)) / span) * plotW;
  const y = (v) => bottom - (v / max) * (bottom - top);
  axes(ctx, width, top, bottom, max, formatNumber);
  // Time ticks, labelled back from now: four or five across the span.
  const step = span <= 60 ? 15 : span <= 300 ? 60 : 300;
  ctx.fillStyle = AXIS;
  ctx.font = "10px system-ui, sans-serif";
  for (let back = 0; back <= span; back += step) {
    ctx.textAlign = back === 0 ? "right" : back === span ? "left" : "center";
    ctx.fillText(back === 0 ? "now" : step < 60 ? `-${back}s` : `-${back / 60}m`, x(now - back), h - 3);
  }
  // The line, broken where there is no value; the area under it.
  const runs = [];
  let run = [];
  for (const p of points) {
    if (p.t < now - span) continue;
    if (p.v !== null) run.push(p);
    else if (!connect && run.length) { runs.push(run); run = []; }
  }
  if (run.length) runs.push(run);
  for (const r of runs) {
    if (r.length === 1) {
      ctx.fillStyle = color;
      ctx.beginPath();
      ctx.arc(x(r[0].t), y(r[0].v), 2, 0, 2 * Math.PI);
      ctx.fill();
      continue;
    }
    ctx.beginPath();
    r.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p.v)) : ctx.moveTo(x(p.t), y(p.v))));
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.6;
    ctx.stroke();
    ctx.lineTo(x(r[r.length - 1].t), bottom);
    ctx.lineTo(x(r[0].t), bottom);
    ctx.closePath();
    ctx.globalAlpha = 0.16;
    ctx.fillStyle = color;
    ctx.fill();
    ctx.globalAlpha = 1;
  }
}

// Recent steps, oldest first: [{decode, prefill, seqs}] (per-step means over each event's window): stacked bars of
// decode and prefill-chunk tokens on the left axis, sequences per step as a line on the right one.
export function stepsChart(canvas, steps, { slots, colors, height = 100 }) {
  const { ctx, width, height: h } = fitCanvas(canvas, height);
  const top = 6, bottom = h - 6, plotW = width - LEFT - 30;
  const max = niceCeil(Math.max(1, ...steps.map((s) => s.decode + s.prefill)));
  const maxSeqs = niceCeil(Math.max(1, ...steps.map((s) => s.seqs)));
  axes(ctx, width - 26, top, bottom, max, formatNumber);
  const barW = plotW / slots;
  const start = LEFT + plotW - steps.length * barW;
  const y = (v) => bottom - (v / max) * (bottom - top);
  steps.forEach((s, i) => {
    const x0 = start + i * barW;
    const w = Math.max(barW - 0.5, 0.5);
    ctx.fillStyle = colors.decode;
    ctx.fillRect(x0, y(s.decode), w, bottom - y(s.decode));
    ctx.fillStyle = colors.prefill;
    ctx.fillRect(x0, y(s.decode + s.prefill), w, y(s.decode) - y(s.decode + s.prefill));
  });
  // Sequences per step, on the right axis.
  const ys = (v) => bottom - (v / maxSeqs) * (bottom - top);
  ctx.beginPath();
  steps.forEach((s, i) => {
    const px = start + (i + 0.5) * barW;
    if (i) ctx.lineTo(px, ys(s.seqs)); else ctx.moveTo(px, ys(s.seqs));
  });
  ctx.strokeStyle = colors.batch;
  ctx.lineWidth = 1.2;
  ctx.stroke();
  ctx.fillStyle = AXIS;
  ctx.font = "10px system-ui, sans-serif";
  ctx.textAlign = "left";
  ctx.fillText(formatNumber(maxSeqs), width - 24, top + 8);
  ctx.fillText("0", width - 24, bottom);
}

// The KV block grid: {num_blocks, num_cells, counts: {state: [its count in each cell]}}; `colors`: state -> colour.
// A cell of several blocks fills from the bottom in proportion to its blocks in each state (free ones are its
// background).
export function gridChart(canvas, grid, colors) {
  const n = grid.num_cells;
  const cols = Math.min(n, 64);
  const rows = Math.ceil(n / cols);
  const size = Math.max(3, Math.floor(canvas.clientWidth / cols));
  const { ctx } = fitCanvas(canvas, rows * size);
  const states = Object.keys(grid.counts);
  const filled = states.filter((s) => s !== "free");
  for (let i = 0; i < n; i++) {
    const x = (i % cols) * size, y = Math.floor(i / cols) * size;
    const total = states.reduce((sum, s) => sum + grid.counts[s][i], 0) || 1;
    const inner = size - 1; // a one-pixel gap between cells
    ctx.fillStyle = colors.free;
    ctx.fillRect(x, y, inner, inner);
    let level = 0;
    for (const state of filled) {
      const count = grid.counts[state][i];
      if (!count) continue;
      const hgt = (count / total) * inner;
      ctx.fillStyle = colors[state];
      ctx.fillRect(x, y + inner - level - hgt, inner, hgt);
      level += hgt;
    }
  }
}

function axes(ctx, right, top, bottom, max, format) {
  ctx.strokeStyle = GRID;
  ctx.lineWidth = 1;
  ctx.fillStyle = AXIS;
  ctx.font = "10px system-ui, sans-serif";
  ctx.textAlign = "right";
  for (const f of [0, 0.5, 1]) {
    const y = Math.round(bottom - f * (bottom - top)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(LEFT, y);
    ctx.lineTo(right, y);
    ctx.stroke();
    ctx.fillText(format(max * f), LEFT - 5, y + 3);
  }
}

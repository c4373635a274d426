// The live engine view: reads /v1/engine/events (a snapshot up to 20 times a second, each with what happened since
// the one before: docs/server.md) and draws the tiles, the charts and the KV block grid.
//
// History is kept per second of the server's clock, for the last 15 minutes: output tokens and the seconds they
// came in, TTFT and inter-token latency sums and counts. The step chart keeps the last STEP_SLOTS events.

import { apiFetch, errorMessage, readEvents } from "./api.js";
import { cssColor, formatNumber, gridChart, stepsChart, timeChart } from "./charts.js";

const KEEP_S = 900;
const STEP_SLOTS = 240; // about 12 s at 20 events a second
const RETRY_MS = [500, 1000, 2000, 5000];

export function startEngineView() {
  const el = (id) => document.getElementById(id);
  const state = {
    seconds: new Map(), // whole second -> {gen, secs, ttftSum, ttftN, itlSum, itlN, busy}
    steps: [],
    last: null, // the latest event
    grids: {}, // the latest kv_grid / cpu_grid
    drawPending: false,
  };
  const colors = () => ({
    free: cssColor("--free"), used: cssColor("--used"), prefix: cssColor("--prefix"), cached: cssColor("--cached"),
    cpu: cssColor("--cpu"), decode: cssColor("--decode"), prefill: cssColor("--prefill"), batch: cssColor("--batch"),
  });

  function onEvent(e) {
    state.last = e;
    const w = e.window;
    if (w) {
      const second = Math.floor(e.time);
      const b = state.seconds.get(second) || { gen: 0, secs: 0, ttftSum: 0, ttftN: 0, itlSum: 0, itlN: 0, busy: 0 };
      b.gen += w.generation_tokens;
      b.secs += w.seconds;
      if (w.ttft_count) { b.ttftSum += w.ttft_ms * w.ttft_count; b.ttftN += w.ttft_count; }
      if (w.itl_count) { b.itlSum += w.itl_ms * w.itl_count; b.itlN += w.itl_count; }
      if (w.busy !== undefined) b.busy += w.busy * w.seconds;
      state.seconds.set(second, b);
      for (const t of state.seconds.keys()) if (t < second - KEEP_S) state.seconds.delete(t);
      if (w.steps) {
        state.steps.push({ decode: w.decode_tokens / w.steps, prefill: w.prefill_tokens / w.steps,
                           seqs: w.batch_seqs / w.steps });
      } else {
        state.steps.push({ decode: 0, prefill: 0, seqs: 0 });
      }
      if (state.steps.length > STEP_SLOTS) state.steps.shift();
    }
    if (e.kv_grid) state.grids.kv = e.kv_grid;
    if ("cpu_grid" in e) state.grids.cpu = e.cpu_grid;
    if (!state.drawPending) {
      state.drawPending = true;
      requestAnimationFrame(() => { state.drawPending = false; draw(); });
    }
  }

  // Sums over the buckets of the last `span` seconds up to `now`.
  function recent(now, span) {
    const sum = { gen: 0, secs: 0, ttftSum: 0, ttftN: 0, itlSum: 0, itlN: 0, busy: 0 };
    for (let t = now - span + 1; t <= now; t++) {
      const b = state.seconds.get(t);
      if (b) for (const k in sum) sum[k] += b[k];
    }
    return sum;
  }

  function draw() {
    const e = state.last;
    if (!e) return;
    const now = Math.floor(e.time);
    const c = colors();
    // Tiles: rates over the last 2 s, latencies over the last 10 s (TTFT: 30 s, first tokens are few).
    const short = recent(now, 2);
    const ttft = recent(now, 30);
    const itl = recent(now, 10);
    setText("stat-waiting", e.waiting);
    setText("stat-running", e.running);
    setText("stat-finished", e.finished ?? "–");
    setText("stat-tps", short.secs ? formatNumber(short.gen / short.secs) : "–");
    setHTML("stat-ttft", ttft.ttftN ? `${formatNumber(ttft.ttftSum / ttft.ttftN)}<small>ms</small>` : "–");
    setHTML("stat-itl", itl.itlN ? `${formatNumber(itl.itlSum / itl.itlN)}<small>ms</small>` : "–");
    setHTML("stat-prefix", e.prefix_cache_queries ? `${(100 * e.prefix_cache_hit_rate).toFixed(0)}<small>%</small>` : "–");
    setText("stat-preempt", e.preemptions);
    // Speculative decoding's mean acceptance length, only on an engine that runs it.
    const spec = e.spec_mean_acceptance_length;
    document.getElementById("tile-spec").hidden = spec == null;
    if (spec != null) setText("stat-spec", spec.toFixed(2));
    setHTML("stat-kv", `${(100 * e.kv_usage).toFixed(0)}<small>% of ${formatCount(e.kv_blocks_total)}</small>`);
    setHTML("stat-busy", short.secs ? `${(100 * short.busy / short.secs).toFixed(0)}<small>%</small>` : "–");

    // Charts: one point per second.
    const span = Number(document.getElementById("history-span").value);
    const points = { tps: [], ttft: [], itl: [] };
    for (let t = now - span; t <= now; t++) {
      const b = state.seconds.get(t);
      points.tps.push({ t, v: b && b.secs ? b.gen / b.secs : null });
      points.ttft.push({ t, v: b && b.ttftN ? b.ttftSum / b.ttftN : null });
      points.itl.push({ t, v: b && b.itlN ? b.itlSum / b.itlN : null });
    }
    timeChart(el("chart-tps"), points.tps, { span, now, color: c.decode });
    timeChart(el("chart-ttft"), points.ttft, { span, now, color: c.prefix, connect: true });
    timeChart(el("chart-itl"), points.itl, { span, now, color: c.cached, connect: true });
    const lastOf = (list) => [...list].reverse().find((p) => p.v !== null);
    setText("now-tps", lastOf(points.tps) ? formatNumber(lastOf(points.tps).v) : "");
    setText("now-ttft", lastOf(points.ttft) ? `${formatNumber(lastOf(points.ttft).v)} ms` : "");
    setText("now-itl", lastOf(points.itl) ? `${formatNumber(lastOf(points.itl).v)} ms` : "");

    stepsChart(el("chart-steps"), state.steps, { slots: STEP_SLOTS, colors: c });
    const s = e.last_step;
    setText("now-step", s ? `last step: ${s.decode_tokens} decode + ${s.prefill_tokens} prefill tokens, `
                            + `${s.num_seqs} seqs, ${s.ms.toFixed(1)} ms` : "");

    drawGrids(c);
  }

  function drawGrids(c) {
    const kv = state.grids.kv;
    if (kv) {
      gridChart(el("kv-grid"), kv, c);
      const t = kv.totals;
      for (const k of ["free", "used", "prefix", "cached"]) setText(`n-${k}`, formatCount(t[k]));
      el("kv-grid").dataset.used = String(t.used + t.prefix); // for the browser test (tests/server/test_web_page.py)
      const per = kv.num_blocks / kv.num_cells;
      setText("grid-scale", `${formatCount(kv.num_blocks)} blocks` + (per > 1 ? `, ${per.toFixed(1)} per cell` : ""));
    }
    const cpu = state.grids.cpu;
    el("cpu-pool").hidden = !cpu;
    if (cpu) {
      gridChart(el("cpu-grid"), cpu, c);
      setText("n-cpu", formatCount(cpu.totals.cpu));
      el("cpu-grid").dataset.used = String(cpu.totals.cpu);
      setText("cpu-scale", `${formatCount(cpu.num_blocks)} blocks`);
    }
  }

  // -- the event stream, reconnected when it ends ----------------------------------------------------------
  const live = el("live");
  let failures = 0;
  async function connect() {
    for (;;) {
      try {
        const response = await apiFetch("/v1/engine/events");
        if (!response.ok) throw new Error(await errorMessage(response));
        failures = 0;
        setLive("on", "live");
        await readEvents(response, (data) => {
          const event = JSON.parse(data);
          onEvent(event);
          if (event.status !== "ok") setLive("error", event.status);
        });
        setLive("", "reconnecting…");
      } catch (err) {
        setLive("error", "offline");
        console.warn("engine events:", err.message);
      }
      await new Promise((r) => setTimeout(r, RETRY_MS[Math.min(failures++, RETRY_MS.length - 1)]));
    }
  }
  function setLive(cls, text) {
    live.className = `live ${cls}`;
    setText("live-text", text);
  }

  document.getElementById("history-span").addEventListener("change", draw);
  window.addEventListener("resize", draw);
  connect();
}

function setText(id, value) {
  const node = document.getElementById(id);
  const text = String(value);
  if (node.textContent !== text) node.textContent = text;
}

function setHTML(id, html) {
  const node = document.getElementById(id);
  if (node.innerHTML !== html) node.innerHTML = html;
}

function formatCount(v) {
  return v === undefined || v === null ? "–" : v.toLocaleString("en-US");
}

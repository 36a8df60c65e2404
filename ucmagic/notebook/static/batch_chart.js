// ucmagic's batch chart (anywidget): the loop's wait per batch as a stacked bar of the stages it was
// spent on (fetch, your code, collate; grey without stage times). Hover: the batch, its stages and
// slowest files (asked from Python: `hovered` -> `hover_info`). Drag: zoom (`view` = [lo, hi] steps).
// Double click: the whole selection. Click: pick the batch (`selected`). No dependencies, no CDN.
// The plot is drawn in a W x H box scaled to the width it is given (at most W): narrow outputs see all of it.
const COLORS = { fetch: "#ff7f0e", user: "#9467bd", collate: "#2ca02c", none: "#9e9e9e" };
const LABELS = { fetch: "fetch", user: "your code", collate: "collate" };
const W = 720, H = 240, L = 52, R = 10, T = 10, B = 30;

function ms(v) { return v >= 10 ? v.toFixed(0) + " ms" : v.toFixed(2) + " ms"; }

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "ucmagic-chart";
  root.style.position = "relative";
  root.style.userSelect = "none";
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("width", "100%");
  svg.style.maxWidth = W + "px";
  svg.style.display = "block";
  const tip = document.createElement("div");
  tip.className = "ucmagic-chart-tip";
  Object.assign(tip.style, { position: "absolute", display: "none", background: "rgba(255,255,255,0.95)",
    border: "1px solid #999", padding: "4px 6px", font: "11px sans-serif", pointerEvents: "none",
    whiteSpace: "pre", zIndex: 10 });
  const legend = document.createElement("div");
  legend.style.font = "11px sans-serif";
  legend.innerHTML = Object.keys(LABELS).map(k =>
    `<span style="color:${COLORS[k]}">&#9632;</span> ${LABELS[k]}`).join(" &nbsp; ") +
    ` &nbsp; <span style="color:${COLORS.none}">&#9632;</span> not measured` +
    " &nbsp; <i>drag to zoom, double-click to reset, click a bar for its files</i>";
  root.append(svg, tip, legend);
  el.appendChild(root);

  let xOf = () => 0, stepAt = () => null, hoverStep = null;

  function draw() {
    const pts = model.get("points") || [];
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const add = (tag, attrs, parent = svg) => {
      const e = document.createElementNS(svgNS, tag);
      for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
      parent.appendChild(e);
      return e;
    };
    if (!pts.length) {
      add("text", { x: W / 2, y: H / 2, "text-anchor": "middle", "font-size": 12 }).textContent = "no batches in this selection";
      return;
    }
    const lo = pts[0].step, hi = pts[pts.length - 1].step;
    const top = Math.max(...pts.map(p => p.wait_ms), 1e-3);
    const bw = Math.max(1, (W - L - R) / Math.max(1, hi - lo + 1));
    xOf = s => L + (s - lo) * bw;
    stepAt = x => Math.min(hi, Math.max(lo, Math.floor((x - L) / bw) + lo));
    const y = v => T + (H - T - B) * (1 - v / top);
    add("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#444" });
    add("line", { x1: L, y1: T, x2: L, y2: H - B, stroke: "#444" });
    for (const f of [0, 0.5, 1]) {
      add("text", { x: L - 4, y: y(top * f) + 4, "text-anchor": "end", "font-size": 10 }).textContent = ms(top * f);
    }
    add("text", { x: L, y: H - 8, "font-size": 10 }).textContent = "batch " + lo;
    add("text", { x: W - R, y: H - 8, "font-size": 10, "text-anchor": "end" }).textContent = "batch " + hi;
    add("text", { x: (L + W) / 2, y: H - 8, "font-size": 10, "text-anchor": "middle" }).textContent = "wait per batch";
    const sel = model.get("selected");
    for (const p of pts) {
      const x = xOf(p.step), w = Math.max(1, bw * 0.85);
      const made = p.fetch_ms + p.user_ms + p.collate_ms;
      const parts = made > 0 ? [["fetch", p.fetch_ms], ["user", p.user_ms], ["collate", p.collate_ms]]
                             : [["none", made]];
      let base = 0;
      for (const [k, v] of parts) {
        const h = made > 0 ? p.wait_ms * v / made : p.wait_ms;
        if (h <= 0) continue;
        add("rect", { x, y: y(base + h), width: w, height: Math.max(0.5, y(base) - y(base + h)), fill: COLORS[k],
                      "data-step": p.step, class: "ucmagic-bar" });
        base += h;
      }
      if (p.index === sel) add("rect", { x: x - 1, y: T, width: w + 2, height: H - T - B, fill: "none",
                                          stroke: "#d62728", "stroke-width": 1.5 });
    }
  }

  function point(step) { return (model.get("points") || []).find(p => p.step === step); }

  function showTip(ev, step) {
    const p = point(step);
    if (!p) { tip.style.display = "none"; return; }
    const extra = model.get("hover_info");
    tip.textContent = `batch ${p.index} (epoch ${p.epoch}, worker ${p.worker}, step ${p.step})\n` +
      `waited ${ms(p.wait_ms)}; made in: fetch ${ms(p.fetch_ms)}, your code ${ms(p.user_ms)}, collate ${ms(p.collate_ms)}\n` +
      `${p.misses}/${p.items} cache misses` +
      (extra && extra.startsWith(`batch ${p.index} `) ? "\n" + extra.slice(extra.indexOf("\n") + 1) : "");
    const r = root.getBoundingClientRect();
    tip.style.left = Math.max(0, Math.min(ev.clientX - r.left + 12, r.width - 220)) + "px";
    tip.style.top = (ev.clientY - r.top + 12) + "px";
    tip.style.display = "block";
  }

  function hideTip() { tip.style.display = "none"; hoverStep = null; lastEv = null; }

  let dragFrom = null, band = null, lastEv = null;
  // the pointer in the plot's own units (not offsetX: the target may be a bar; the plot may be scaled)
  const xIn = ev => { const r = svg.getBoundingClientRect(); return (ev.clientX - r.left) * W / (r.width || W); };
  svg.addEventListener("mousemove", ev => {
    if (dragFrom !== null) return;  // dragging: the band, not the tooltip
    const x = xIn(ev);
    lastEv = ev;
    const step = stepAt(x);
    if (step !== hoverStep) {
      hoverStep = step;
      const p = point(step);
      if (p) { model.set("hovered", p.index); model.save_changes(); }
    }
    showTip(ev, step);
  });
  svg.addEventListener("mouseleave", hideTip);
  // the drag is followed on the window: the notebook must not start a cell drag or a text selection,
  // and a release outside the chart still ends it
  const onMove = ev => {
    if (dragFrom === null) return;
    const x = Math.max(L, Math.min(W - R, xIn(ev)));
    if (!band) { band = document.createElementNS(svgNS, "rect"); band.setAttribute("fill", "rgba(31,119,180,0.2)"); svg.appendChild(band); }
    band.setAttribute("x", Math.min(dragFrom, x)); band.setAttribute("y", T);
    band.setAttribute("width", Math.abs(x - dragFrom)); band.setAttribute("height", H - T - B);
  };
  const onUp = ev => {
    window.removeEventListener("mousemove", onMove, true);
    window.removeEventListener("mouseup", onUp, true);
    const from = dragFrom, x = xIn(ev);
    dragFrom = null;
    if (band) { band.remove(); band = null; }
    hideTip();  // the bars under the pointer are about to change: a tooltip left now would describe another batch
    if (from === null) return;
    if (Math.abs(x - from) < 4) {  // a click: pick the batch
      const p = point(stepAt(x));
      if (p) { model.set("selected", p.index); model.save_changes(); }
      return;
    }
    const a = stepAt(Math.min(from, x)), b = stepAt(Math.max(from, x));
    model.set("view", [a, b]);
    model.save_changes();
  };
  svg.addEventListener("mousedown", ev => {
    ev.preventDefault();
    ev.stopPropagation();
    hideTip();
    dragFrom = xIn(ev);
    band = null;
    window.addEventListener("mousemove", onMove, true);
    window.addEventListener("mouseup", onUp, true);
  });
  svg.addEventListener("dblclick", () => { hideTip(); model.set("view", []); model.save_changes(); });
  model.on("change:points", () => { hideTip(); draw(); });
  model.on("change:selected", draw);
  model.on("change:hover_info", () => { if (lastEv && hoverStep !== null) showTip(lastEv, hoverStep); });
  draw();
  model.set("rendered", true);
  model.save_changes();
  return () => { el.removeChild(root); };
}

export default { render };

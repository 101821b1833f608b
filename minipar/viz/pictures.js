// The explorers' pictures, drawn in the browser as SVG from the data the kernel sends
// (minipar/viz/pictures.py): the JSON that minipar/viz/{memory,traffic,timeline,
// sharding,stages}.py make and their matplotlib figures draw. A control change costs the
// kernel a few kilobytes of data, and the browser a redraw of a few hundred shapes.
//
// Four kinds of picture: "bars" (stacked bars per rank: memory, bytes sent, a pipeline's
// stages), "matrix" (the traffic heatmaps), "timeline" (a Gantt chart of the ranks) and
// "sharding" (the model strip and one panel per rank). Each is drawn in a viewBox WIDTH
// units wide, scaled to the output area (as JupyterLab scales an image).

const NS = "http://www.w3.org/2000/svg";
const WIDTH = 800;
const FONT = "font-family: sans-serif";

function node(parent, tag, attrs = {}, text = null) {
  const element = document.createElementNS(NS, tag);
  for (const [name, value] of Object.entries(attrs)) element.setAttribute(name, value);
  if (text !== null) element.textContent = text;
  if (parent) parent.appendChild(element);
  return element;
}

// Text of one or more lines ("\n"), the first line at y (baseline "middle" by default).
function label(parent, x, y, words, { size = 11, anchor = "middle", color = "#000",
                                      baseline = "middle", rotate = 0, weight = "normal" } = {}) {
  const lines = String(words).split("\n");
  const attrs = { x, y, "font-size": size, "text-anchor": anchor, fill: color,
                  "dominant-baseline": baseline, style: FONT, "font-weight": weight };
  if (rotate) attrs.transform = `rotate(${rotate} ${x} ${y})`;
  const element = node(parent, "text", attrs);
  lines.forEach((line, i) => {
    node(element, "tspan", { x, dy: i === 0 ? 0 : size * 1.15 }, line);
  });
  return element;
}

function lineCount(words) { return String(words || "").split("\n").length; }

// Ticks of a linear axis from 0 to top: steps of 1, 2, 2.5 or 5 times a power of ten.
function ticks(top, most = 6) {
  if (!(top > 0)) return [0];
  const raw = top / most;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map(m => m * power).find(s => s >= raw);
  const out = [];
  for (let k = 0; k * step <= top * (1 + 1e-9); k++) out.push(+(k * step).toPrecision(12));
  return out;
}

function tickText(value) {
  if (value === 0) return "0";
  if (Math.abs(value) >= 1000 || Number.isInteger(value)) return String(Math.round(value));
  return String(+value.toPrecision(3));
}

function frame(parent, x, y, w, h) {
  node(parent, "rect", { x, y, width: w, height: h, fill: "none", stroke: "#000",
                         "stroke-width": 0.8 });
}

function hatchPattern(svg, id, color) {
  const defs = node(svg, "defs");
  const pattern = node(defs, "pattern", { id, width: 6, height: 6,
                                          patternUnits: "userSpaceOnUse",
                                          patternTransform: "rotate(45)" });
  node(pattern, "line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: color, "stroke-width": 1.5 });
}

// An id for a pattern or gradient, unique in the page (each widget may load this module
// afresh, so a counter of its own would repeat another's).
function uid() { return Math.random().toString(36).slice(2); }

// ------------------------------------------------------------------ legend (right side)
function legendRight(svg, entries, x, y) {
  entries.forEach((entry, i) => {
    const ey = y + i * 16;
    if (entry.line) {  // a dash (the memory bars' own peaks), not a patch
      node(svg, "line", { x1: x, x2: x + 14, y1: ey, y2: ey, stroke: entry.color,
                          "stroke-width": 2.5 });
    } else {
      const fill = entry.hatch ? `url(#${svg.dataset.hatch})` : entry.color;
      node(svg, "rect", { x, y: ey - 5, width: 14, height: 10, fill,
                          stroke: entry.hatch ? "#000" : "none", "stroke-width": 0.6 });
    }
    label(svg, x + 19, ey, entry.label, { size: 10, anchor: "start" });
  });
}

// ------------------------------------------------------------------ bars
function drawBars(picture) {
  const panels = picture.panels;
  const column = picture.layout === "column";
  const legendWidth = picture.legend && picture.legend.length ? 120 : 0;
  const plotWidth = WIDTH - 80 - legendWidth - 15;
  const titleLines = Math.max(...panels.map(p => lineCount(p.title)));
  const tickLines = Math.max(...panels.map(p => Math.max(1, ...p.ticks.map(t => lineCount(t[1])))));
  const panelHeight = column ? 230 : 190;
  const top = 12 + 14 * titleLines;
  const bottom = 14 + 12 * tickLines + (panels.some(p => p.xlabel) ? 16 : 0);
  const rowHeight = top + panelHeight + bottom;
  const cols = column ? 1 : panels.length;
  const rows = column ? panels.length : 1;
  const height = rows * rowHeight + 6;
  const svg = node(null, "svg", { viewBox: `0 0 ${WIDTH} ${height}`, width: "100%" });
  svg.dataset.hatch = `minipar-hatch-${uid()}`;
  hatchPattern(svg, svg.dataset.hatch, "rgba(0,0,0,0.55)");
  const cellWidth = (plotWidth + (cols - 1) * 0) / cols;
  panels.forEach((panel, index) => {
    const px = 70 + (column ? 0 : index * (cellWidth + 0)) + (column ? 0 : 10 * index);
    const pw = (column ? plotWidth : cellWidth - 10 * (cols - 1) / cols) - (column ? 0 : 10);
    const py = (column ? index : 0) * rowHeight + top;
    const ph = panelHeight;
    const n = panel.ticks.length;
    const scale = panel.scale || 1;
    let stackTop = 0;
    for (let i = 0; i < n; i++) {
      let sum = 0;
      for (const series of panel.series) sum += series.values[i];
      stackTop = Math.max(stackTop, sum, panel.markers ? panel.markers[i] : 0);
    }
    const ymax = (panel.ymax || 1.05 * stackTop) / scale || 1;
    const y = v => py + ph - (v / ymax) * ph;
    const slot = pw / Math.max(n, 1);
    const x = i => px + (i + 0.5) * slot;
    for (const t of ticks(ymax)) {
      node(svg, "line", { x1: px - 4, x2: px, y1: y(t), y2: y(t), stroke: "#000" });
      label(svg, px - 6, y(t), tickText(t), { size: 10, anchor: "end" });
    }
    const barWidth = slot * 0.7;
    for (let i = 0; i < n; i++) {
      let base = 0;
      const hatched = panel.hatched && panel.hatched[i];
      for (const series of panel.series) {
        const value = series.values[i] / scale;
        if (value > 0) {
          const attrs = { x: x(i) - barWidth / 2, y: y(base + value), width: barWidth,
                          height: y(base) - y(base + value), fill: series.color,
                          stroke: panel.markers ? "#fff" : "none", "stroke-width": 0.5 };
          const bar = node(svg, "rect", attrs);
          const title = node(bar, "title");
          title.textContent = `${series.label || series.name}: ${tickText(value)} ${panel.unit}`;
          if (hatched) node(svg, "rect", { ...attrs, fill: `url(#${svg.dataset.hatch})` });
        }
        base += value;
      }
      if (panel.markers) {
        const peak = panel.markers[i] / scale;
        node(svg, "line", { x1: x(i) - slot * 0.38, x2: x(i) + slot * 0.38, y1: y(peak),
                            y2: y(peak), stroke: "#000", "stroke-width": 2.5 });
      }
      // Each category's own peak (memory bars): a dash of its colour beside the bar.
      for (const own of panel.own_peaks || []) {
        const value = own.values[i] / scale;
        if (value > 0) {
          const dash = node(svg, "line", { x1: x(i) + slot * 0.39, x2: x(i) + slot * 0.5,
                                           y1: y(value), y2: y(value), stroke: own.color,
                                           "stroke-width": 3 });
          node(dash, "title", {}, `${own.name}, its own peak: ${tickText(value)} ${panel.unit}`);
        }
      }
    }
    frame(svg, px, py, pw, ph);
    panel.ticks.forEach(([at, words]) => {
      const tx = px + (at + 0.5) * slot;
      node(svg, "line", { x1: tx, x2: tx, y1: py + ph, y2: py + ph + 4, stroke: "#000" });
      if (words) label(svg, tx, py + ph + 12, words, { size: 9 });
    });
    if (panel.xlabel) {
      label(svg, px + pw / 2, py + ph + 14 + 12 * tickLines, panel.xlabel, { size: 10 });
    }
    label(svg, px - 50, py + ph / 2, panel.ylabel, { size: 10, rotate: -90 });
    label(svg, px + pw / 2, py - 8 - 14 * (lineCount(panel.title) - 1), panel.title,
          { size: 12 });
  });
  if (legendWidth) {
    const legendTop = column ? height - 22 - 16 * picture.legend.length : top + 8;
    legendRight(svg, picture.legend, WIDTH - legendWidth + 5, legendTop);
  }
  return svg;
}

// ------------------------------------------------------------------ traffic matrices
function drawMatrix(picture) {
  const world = picture.world;
  const count = picture.panels.length;
  const side = Math.min(260, (WIDTH - 70 - 130 - 25 * (count - 1)) / count);
  const top = 62;
  const height = top + side + 48;
  const svg = node(null, "svg", { viewBox: `0 0 ${WIDTH} ${height}`, width: "100%" });
  const cell = side / world;
  const left = 55 + (WIDTH - 55 - 130 - count * side - 25 * (count - 1)) / 2;
  picture.panels.forEach((panel, k) => {
    const px = left + k * (side + 25);
    node(svg, "rect", { x: px, y: top, width: side, height: side, fill: "#f2f2f2" });
    for (const [i, j, sent, color, textColor, words] of panel.cells) {
      const rect = node(svg, "rect", { x: px + j * cell, y: top + i * cell, width: cell + 0.02,
                                       height: cell + 0.02, fill: color });
      node(rect, "title").textContent = `rank ${i} -> rank ${j}: ${sent} bytes per step`;
      if (picture.annotate && words) {
        label(svg, px + (j + 0.5) * cell, top + (i + 0.5) * cell - 4, words,
              { size: 8, color: textColor });
      }
    }
    for (const b of picture.boundaries) {
      const at = b * cell;
      const dash = { stroke: "#000", "stroke-dasharray": "4 3", "stroke-width": 0.8 };
      node(svg, "line", { x1: px, x2: px + side, y1: top + at, y2: top + at, ...dash });
      node(svg, "line", { x1: px + at, x2: px + at, y1: top, y2: top + side, ...dash });
    }
    frame(svg, px, top, side, side);
    for (const r of picture.labelled) {
      const at = (r + 0.5) * cell;
      label(svg, px + at, top + side + 10, r, { size: 9 });
      if (k === 0) label(svg, px - 5, top + at, r, { size: 9, anchor: "end" });
    }
    label(svg, px + side / 2, top + side + 27, "to rank", { size: 10 });
    if (k === 0) label(svg, px - 30, top + side / 2, "from rank", { size: 10, rotate: -90 });
    label(svg, px + side / 2, top - 22, panel.title, { size: 10 });
  });
  // the colour bar: its gradient spans the log scale, its ticks at their log positions
  const barX = left + count * side + 25 * (count - 1) + 18;
  const gradientId = `minipar-gradient-${uid()}`;
  const gradient = node(node(svg, "defs"), "linearGradient",
                        { id: gradientId, x1: 0, y1: 1, x2: 0, y2: 0 });
  const stops = picture.colorbar.stops;
  stops.forEach((color, i) => node(gradient, "stop", { offset: i / (stops.length - 1),
                                                       "stop-color": color }));
  node(svg, "rect", { x: barX, y: top, width: 12, height: side, fill: `url(#${gradientId})` });
  frame(svg, barX, top, 12, side);
  const [low, high] = picture.norm;
  const position = v => (high > low ? Math.log(v / low) / Math.log(high / low) : 0);
  for (const [value, words] of picture.colorbar.ticks) {
    const ty = top + side - position(value) * side;
    node(svg, "line", { x1: barX + 12, x2: barX + 16, y1: ty, y2: ty, stroke: "#000" });
    label(svg, barX + 18, ty, words, { size: 9, anchor: "start" });
  }
  label(svg, barX + 95, top + side / 2, picture.colorbar.label, { size: 10, rotate: 90 });
  label(svg, WIDTH / 2, 14, picture.title, { size: 12 });
  return svg;
}

// ------------------------------------------------------------------ timeline
function rgb([r, g, b]) { return `rgb(${r * 255}, ${g * 255}, ${b * 255})`; }

function drawTimeline(picture) {
  const n = picture.rank_labels.length;
  const rowHeight = 32;
  const left = 70;
  const plotWidth = WIDTH - left - 20;
  const top = 30;
  const legendRows = Math.ceil(picture.legend.length / 4);
  const height = top + n * rowHeight + 46 + 16 * legendRows;
  const svg = node(null, "svg", { viewBox: `0 0 ${WIDTH} ${height}`, width: "100%" });
  const x = v => left + (v / picture.xmax) * plotWidth;
  const y = v => top + (v + 0.5) * rowHeight;  // a row's centre at y(rank)
  const clip = `minipar-clip-${uid()}`;
  node(node(node(svg, "defs"), "clipPath", { id: clip }), "rect",
       { x: left, y: top, width: plotWidth, height: n * rowHeight });
  const bars = node(svg, "g", { "clip-path": `url(#${clip})` });
  for (const [x0, w, y0, h, color, edge] of picture.bars) {
    node(bars, "rect", { x: x(x0), y: y(y0), width: Math.max(x(x0 + w) - x(x0), 0.3),
                         height: h * rowHeight, fill: rgb(picture.colors[color]),
                         stroke: edge ? "#fff" : "none", "stroke-width": edge ? 0.4 : 0 });
  }
  for (const [tx, ty, words, color] of picture.texts) {
    label(bars, x(tx), y(ty), words, { size: 9, color });
  }
  frame(svg, left, top, plotWidth, n * rowHeight);
  picture.rank_labels.forEach((words, r) => label(svg, left - 6, y(r), words,
                                                  { size: 11, anchor: "end" }));
  const bottom = top + n * rowHeight;
  for (const t of ticks(picture.xmax, 8)) {
    node(svg, "line", { x1: x(t), x2: x(t), y1: bottom, y2: bottom + 4, stroke: "#000" });
    label(svg, x(t), bottom + 13, tickText(t), { size: 10 });
  }
  label(svg, left + plotWidth / 2, bottom + 30, picture.xlabel, { size: 11 });
  label(svg, left + plotWidth / 2, 14, picture.title, { size: 13 });
  const each = WIDTH / 4;
  picture.legend.forEach((entry, i) => {
    const lx = 20 + (i % 4) * each;
    const ly = bottom + 50 + 16 * Math.floor(i / 4);
    entry.colors.forEach((color, c) => node(svg, "rect", { x: lx + 9 * c, y: ly - 5,
                                                          width: 9, height: 10,
                                                          fill: rgb(color) }));
    label(svg, lx + 9 * entry.colors.length + 5, ly, entry.label, { size: 10, anchor: "start" });
  });
  return svg;
}

// ------------------------------------------------------------------ sharding
function rgbOf(hex) { return [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16)); }

function drawSharding(picture) {
  const ranks = picture.ranks;
  const n = ranks.length;
  const [rows, cols] = picture.grid;
  const left = 125;
  const stripWidth = WIDTH - left - 90;
  const rowHeight = 20;
  const top = 28;
  const stripHeight = n * rowHeight;
  const panelsTop = top + stripHeight + 58;
  const panelHeight = 110;
  const height = panelsTop + rows * (panelHeight + 22) + 6;
  const svg = node(null, "svg", { viewBox: `0 0 ${WIDTH} ${height}`, width: "100%" });
  const color = picture.color;
  // The strip: one pixel per slice and rank, shaded by the share of the slice held,
  // stretched over the strip's width (a few hundred slices per rank: one image, not
  // thousands of shapes).
  const canvas = document.createElement("canvas");
  canvas.width = picture.bins;
  canvas.height = n;
  const context = canvas.getContext("2d");
  const pixels = context.createImageData(picture.bins, n);
  const [pale, full] = [rgbOf("#f2f2f2"), rgbOf(color)];
  ranks.forEach((rank, r) => {
    rank.held.forEach((held, b) => {
      const share = held / (picture.edges[b + 1] - picture.edges[b]);
      const at = 4 * (r * picture.bins + b);
      for (let c = 0; c < 3; c++) pixels.data[at + c] = pale[c] + (full[c] - pale[c]) * share;
      pixels.data[at + 3] = 255;
    });
    label(svg, left - 5, top + (r + 0.5) * rowHeight, rank.label, { size: 9, anchor: "end" });
  });
  context.putImageData(pixels, 0, 0);
  node(svg, "image", { x: left, y: top, width: stripWidth, height: stripHeight,
                       href: canvas.toDataURL(), preserveAspectRatio: "none",
                       style: "image-rendering: pixelated" });
  const at = v => left + (v / picture.total) * stripWidth;
  picture.units.forEach(([words, lo, hi], i) => {
    if (i > 0) node(svg, "line", { x1: at(lo), x2: at(lo), y1: top, y2: top + stripHeight,
                                   stroke: "#000", "stroke-width": 0.6 });
    label(svg, (at(lo) + at(hi)) / 2, top + stripHeight + 11, words, { size: 10 });
  });
  frame(svg, left, top, stripWidth, stripHeight);
  label(svg, left + stripWidth / 2, 13, picture.title, { size: 11 });
  // what a shade means: the share of a slice held, 0% to 100%
  const gradientId = `minipar-gradient-${uid()}`;
  const gradient = node(node(svg, "defs"), "linearGradient",
                        { id: gradientId, x1: 0, y1: 1, x2: 0, y2: 0 });
  node(gradient, "stop", { offset: 0, "stop-color": "#f2f2f2" });
  node(gradient, "stop", { offset: 1, "stop-color": color });
  const barX = left + stripWidth + 8;
  node(svg, "rect", { x: barX, y: top, width: 10, height: stripHeight,
                      fill: `url(#${gradientId})` });
  frame(svg, barX, top, 10, stripHeight);
  for (const share of (n > 1 ? [0, 0.5, 1] : [0, 1])) {
    label(svg, barX + 14, top + stripHeight * (1 - share), `${share * 100}%`,
          { size: 9, anchor: "start" });
  }
  if (n >= 2) {
    label(svg, barX + 58, top + stripHeight / 2, n >= 4 ? "share of a slice held" : "share held",
          { size: 9, rotate: 90 });
  }
  label(svg, WIDTH / 2, panelsTop - 30, picture.tensor_title, { size: 11 });
  const [tensorRows, tensorCols] = picture.shape;
  const panelWidth = (WIDTH - 20) / cols;
  ranks.forEach((rank, r) => {
    const px = 10 + (r % cols) * panelWidth + 4;
    const py = panelsTop + Math.floor(r / cols) * (panelHeight + 22);
    const pw = panelWidth - 8;
    node(svg, "rect", { x: px, y: py, width: pw, height: panelHeight, fill: "#f2f2f2" });
    for (const [r0, r1, c0, c1] of rank.rects) {
      node(svg, "rect", { x: px + (c0 / tensorCols) * pw, y: py + (r0 / tensorRows) * panelHeight,
                          width: ((c1 - c0) / tensorCols) * pw,
                          height: ((r1 - r0) / tensorRows) * panelHeight, fill: color });
    }
    frame(svg, px, py, pw, panelHeight);
    label(svg, px + pw / 2, py - 8, rank.title, { size: 10 });
  });
  return svg;
}

const DRAW = { bars: drawBars, matrix: drawMatrix, timeline: drawTimeline,
               sharding: drawSharding };

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, c => `&#${c.charCodeAt(0)};`);
}

// The moment the reader changes one of the explorer's controls, say so in its status
// line, in the browser: the kernel's answer (the new setting's, or "measuring ...")
// replaces it a few tens of milliseconds later, or more on a busy machine.
function watchControls(model) {
  const manager = model.widget_manager;
  const watched = [];
  let stopped = false;
  (async () => {
    if (!manager || !model.get("status_id")) return;
    const status = await manager.get_model(model.get("status_id"));
    for (const [id, label] of model.get("controls")) {
      const control = await manager.get_model(id);
      if (stopped) return;
      const said = () => {
        const labels = control.get("_options_labels");
        const value = labels ? labels[control.get("index")] : control.get("value");
        status.set("value", `<span style='color:#666'>${escapeHtml(label)} = ` +
                            `${escapeHtml(value)} ... (the pictures below are still of the ` +
                            "last setting)</span>");
      };
      for (const name of ["change:index", "change:value"]) {
        control.on(name, said);
        watched.push([control, name, said]);
      }
    }
  })();
  return () => {
    stopped = true;
    watched.forEach(([control, name, said]) => control.off(name, said));
  };
}

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "minipar-pictures";
  root.style.maxWidth = "880px";
  el.appendChild(root);
  let drawn = 0;
  const draw = () => {
    const started = performance.now();
    const pictures = JSON.parse(model.get("data") || "[]");
    root.replaceChildren(...pictures.map(picture => DRAW[picture.kind](picture)));
    root.dataset.drawMs = (performance.now() - started).toFixed(1);
    root.style.visibility = model.get("visible") ? "visible" : "hidden";
    // what the pictures show and how many were drawn: for benchmarks/browser_explorers.py
    root.dataset.setting = model.get("setting");
    root.dataset.drawn = String(++drawn);
  };
  // One message sets the pictures, what they show and whether they are visible: the
  // changes it fires are drawn once, after the last.
  let scheduled = false;
  const schedule = () => {
    if (scheduled) return;
    scheduled = true;
    queueMicrotask(() => { scheduled = false; draw(); });
  };
  const names = ["change:data", "change:visible", "change:setting"];
  names.forEach(name => model.on(name, schedule));
  draw();
  const unwatch = watchControls(model);
  return () => { names.forEach(name => model.off(name, schedule)); unwatch(); };
}

export default { render };

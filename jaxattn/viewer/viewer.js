/* jaxattn attention viewer: head, model and matrix views of the weights in #jaxattn-data.
 *
 * Plain ES2017, no libraries, nothing fetched. The weights are bytes round(w * 255) in
 * [L, N, T, S] C order; every view draws on canvases (no element per weight), so a page of
 * 1024 tokens stays responsive. window.jaxattnViewer = {ready, L, N, T, S} once drawn.
 */
(function () {
  "use strict";

  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e",
                   "#1f9e89", "#35b779", "#6ece58", "#fde725"];
  const THUMB = 128;          // a thumbnail's pixels per side at most (and its CSS size)
  const MATRIX_SIDE = 768;    // the matrix view's largest size in CSS pixels...
  const MATRIX_MIN = 240;     // ...and the least it is given when the window is short
  const IDLE_MIN_SMALL = 0.02; // head view with nothing hovered: lines of at least this weight...
  const IDLE_MIN_LARGE = 0.1;  // ...or this one above IDLE_SMALL_LIMIT tokens
  const IDLE_SMALL_LIMIT = 128;
  const ALPHA_LEVELS = 16;

  const state = {
    view: "head", layer: 0, heads: [], matrixHead: 0,
    hover: null, pinned: null,      // {mode: "row" | "col", index}
    matrixHover: null,              // {t, s}
    matrixKey: null, matrixCell: 0,
  };
  const el = {};
  let D, W, SINK, L, N, T, S, LUT, keyDisplay, geometry = null, tinted = [], frame = 0;

  /* ------------------------------------------------------------------ data */

  // The page's own elements: under the script's parent (a notebook may hold several pages).
  const root = (document.currentScript && document.currentScript.parentNode) || document;
  function byId(id) { return root.querySelector("#" + id); }

  function decodeBase64(text) {
    if (typeof Uint8Array.fromBase64 === "function") return Uint8Array.fromBase64(text);
    const binary = atob(text);
    const out = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
    return out;
  }

  function readData() {
    D = JSON.parse(byId("jaxattn-data").textContent);
    L = D.L; N = D.N; T = D.T; S = D.S;
    if (D.encoding !== "uint8") throw new Error("unknown weight encoding " + D.encoding);
    W = decodeBase64(D.weights);
    if (W.length !== L * N * T * S) throw new Error("the weights hold " + W.length + " bytes, not L*N*T*S");
    SINK = D.sink_weights ? decodeBase64(D.sink_weights) : null;
    D.display = D.display || D.tokens;
    keyDisplay = D.key_display || D.display;
  }

  function rowStart(l, n, t) { return ((l * N + n) * T + t) * S; }
  function weight(l, n, t, s) { return W[rowStart(l, n, t) + s] / 255; }
  function sinkWeight(l, n, t) {
    return SINK && D.layers[l].sinks ? SINK[(l * N + n) * T + t] / 255 : null;
  }
  function fmt(v) { return v.toFixed(4); }

  function escapeHtml(text) {
    return String(text).replace(/[&<>"']/g, function (c) {
      return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c];
    });
  }

  function headColor(n) {
    // ten distinct colours, then hues a golden angle apart; always "#rrggbb"
    return n < PALETTE.length ? PALETTE[n] : hslHex((n * 137.5) % 360, 0.65, 0.45);
  }

  function hslHex(h, s, l) {
    const a = s * Math.min(l, 1 - l);
    const channel = function (k) {
      const x = (k + h / 30) % 12;
      const v = l - a * Math.max(-1, Math.min(x - 3, 9 - x, 1));
      return ("0" + Math.round(v * 255).toString(16)).slice(-2);
    };
    return "#" + channel(0) + channel(8) + channel(4);
  }

  function hexRgb(hex) {
    return [parseInt(hex.slice(1, 3), 16), parseInt(hex.slice(3, 5), 16), parseInt(hex.slice(5, 7), 16)];
  }

  function buildLut() {
    const anchors = VIRIDIS.map(hexRgb);
    const lut = new Uint8Array(256 * 3);
    for (let i = 0; i < 256; i++) {
      const x = i / 255 * (anchors.length - 1);
      const k = Math.min(anchors.length - 2, Math.floor(x));
      const f = x - k;
      for (let c = 0; c < 3; c++) lut[i * 3 + c] = Math.round(anchors[k][c] * (1 - f) + anchors[k + 1][c] * f);
    }
    return lut;
  }

  function kvSuffix(n) {
    const layer = D.layers[0];
    if (!layer.kv_of_head || (layer.kind !== "GQA" && layer.kind !== "MQA")) return "";
    return " (kv" + layer.kv_of_head[n] + ")";
  }

  function layerTitle(l) {
    const label = D.layers[l].label;
    return label ? "layer " + l + ": " + label : "layer " + l;
  }

  /* -------------------------------------------------------------- controls */

  function option(value, text) {
    const o = document.createElement("option");
    o.value = String(value);
    o.textContent = text;
    return o;
  }

  function buildControls() {
    for (let l = 0; l < L; l++) el.layerSelect.appendChild(option(l, layerTitle(l)));
    for (let n = 0; n < N; n++) {
      el.headSelect.appendChild(option(n, "head " + n + kvSuffix(n)));
      const label = document.createElement("label");
      label.className = "head-toggle-label";
      label.style.setProperty("--head-color", headColor(n));
      const box = document.createElement("input");
      box.type = "checkbox";
      box.className = "head-toggle";
      box.dataset.head = String(n);
      box.checked = true;
      label.appendChild(box);
      label.appendChild(document.createTextNode("h" + n + kvSuffix(n)));
      el.headToggles.appendChild(label);
    }
    state.heads = range(N);
    el.layerSelect.addEventListener("change", function () { selectLayer(Number(el.layerSelect.value)); });
    el.headSelect.addEventListener("change", function () { selectMatrixHead(Number(el.headSelect.value)); });
    el.headToggles.addEventListener("change", readHeadToggles);
    ["head", "model", "matrix"].forEach(function (name) {
      byId("tab-" + name).addEventListener("click", function () { showView(name); });
    });
  }

  function range(n) { return Array.from({length: n}, function (_, i) { return i; }); }

  function readHeadToggles() {
    state.heads = Array.from(root.querySelectorAll(".head-toggle"))
      .filter(function (box) { return box.checked; })
      .map(function (box) { return Number(box.dataset.head); });
    refreshHead();
  }

  function updateLayerLabel() {
    const layer = D.layers[state.layer];
    el.layerLabel.textContent = layerTitle(state.layer);
    el.layerLabel.dataset.layer = String(state.layer);
    el.layerLabel.dataset.kind = layer.kind || "";
    el.layerLabel.dataset.sinks = layer.sinks ? "1" : "0";
    if (layer.window !== null && layer.window !== undefined) el.layerLabel.dataset.window = String(layer.window);
    else delete el.layerLabel.dataset.window;
  }

  function selectLayer(l) {
    state.layer = l;
    el.layerSelect.value = String(l);
    updateLayerLabel();
    refreshHead();
    refreshMatrixValue();
    if (state.view === "matrix") drawMatrix();
  }

  function selectMatrixHead(n) {
    state.matrixHead = n;
    el.headSelect.value = String(n);
    refreshMatrixValue();
    if (state.view === "matrix") drawMatrix();
  }

  function showView(name) {
    state.view = name;
    ["head", "model", "matrix"].forEach(function (v) {
      byId("view-" + v).hidden = v !== name;
      byId("tab-" + v).setAttribute("aria-selected", v === name ? "true" : "false");
    });
    if (name === "head") { layoutHead(); drawHead(); }
    if (name === "matrix") { state.matrixCell = 0; drawMatrix(); }
  }

  /* ------------------------------------------------------------- head view */

  function tokenElement(kind, index, text, raw) {
    const div = document.createElement("div");
    div.className = "token " + kind;
    div.dataset.index = String(index);
    div.textContent = text;
    div.title = (kind === "query" ? "q " : "k ") + index + ": " + JSON.stringify(raw);
    return div;
  }

  function buildTokens() {
    const queries = document.createDocumentFragment();
    const keys = document.createDocumentFragment();
    const keyTokens = D.key_tokens || D.tokens;
    for (let t = 0; t < T; t++) queries.appendChild(tokenElement("query", t, D.display[t], D.tokens[t]));
    for (let s = 0; s < S; s++) keys.appendChild(tokenElement("key", s, keyDisplay[s], keyTokens[s]));
    el.queryColumn.appendChild(queries);
    el.keyColumn.appendChild(keys);
    wireColumn(el.queryColumn, "row");
    wireColumn(el.keyColumn, "col");
    el.headScroll.addEventListener("scroll", scheduleHead);
    window.addEventListener("resize", function () {
      layoutHead();
      scheduleHead();
      state.matrixCell = 0;
      drawMatrix();
    });
  }

  function wireColumn(column, mode) {
    column.addEventListener("mouseover", function (event) {
      const token = event.target.closest(".token");
      if (token) setHover({mode: mode, index: Number(token.dataset.index)});
    });
    column.addEventListener("mouseleave", function () { setHover(null); });
    column.addEventListener("click", function (event) {
      const token = event.target.closest(".token");
      if (token) togglePin({mode: mode, index: Number(token.dataset.index)});
    });
  }

  function sameTarget(a, b) { return !!a && !!b && a.mode === b.mode && a.index === b.index; }

  function active() { return state.pinned || state.hover; }

  function setHover(target) {
    if (sameTarget(target, state.hover) || (!target && !state.hover)) return;
    state.hover = target;
    if (!state.pinned) refreshHead();
  }

  function togglePin(target) {
    state.pinned = sameTarget(target, state.pinned) ? null : target;
    state.hover = target;
    refreshHead();
  }

  function refreshHead() {
    markTokens();
    updateReadout();
    if (state.view === "head") drawHead();
  }

  function tokenAt(mode, index) {
    return (mode === "row" ? el.queryColumn : el.keyColumn).children[index];
  }

  function markTokens() {
    root.querySelectorAll(".token.active").forEach(function (t) { t.classList.remove("active", "pinned"); });
    tinted.forEach(function (t) { t.style.backgroundColor = ""; });
    tinted = [];
    const target = active();
    if (!target) return;
    const token = tokenAt(target.mode, target.index);
    token.classList.add("active");
    if (state.pinned) token.classList.add("pinned");
    if (!state.heads.length) return;
    const rgb = hexRgb(headColor(state.heads[0]));
    const other = target.mode === "row" ? el.keyColumn : el.queryColumn;
    const count = target.mode === "row" ? S : T;
    for (let i = 0; i < count; i++) {
      const w = target.mode === "row" ? weight(state.layer, state.heads[0], target.index, i)
                                      : weight(state.layer, state.heads[0], i, target.index);
      if (w <= 0) continue;
      const cell = other.children[i];
      cell.style.backgroundColor = "rgba(" + rgb.join(",") + "," + (0.08 + 0.7 * Math.sqrt(w)).toFixed(3) + ")";
      tinted.push(cell);
    }
  }

  function updateReadout() {
    const target = active();
    const head = state.heads.length ? state.heads[0] : -1;
    const box = el.readout;
    box.dataset.layer = String(state.layer);
    box.dataset.head = String(head);
    box.dataset.pinned = state.pinned ? "1" : "0";
    delete box.dataset.sink;
    if (!target || head < 0) {
      box.dataset.mode = "none";
      box.dataset.index = "";
      box.innerHTML = '<div class="readout-head">' +
        (head < 0 ? "select a head" : "hover a token to read its weights") + "</div>";
      return;
    }
    box.dataset.mode = target.mode;
    box.dataset.index = String(target.index);
    box.innerHTML = target.mode === "row" ? rowReadout(target.index, head) : columnReadout(target.index, head);
  }

  function weightSpan(attribute, index, w, text) {
    return '<span class="w' + (w > 0 ? "" : " zero") + '" data-' + attribute + '="' + index +
      '" data-value="' + fmt(w) + '">' + escapeHtml(text) + " " + fmt(w) + "</span>";
  }

  function rowReadout(t, head) {
    const l = state.layer;
    const sink = sinkWeight(l, head, t);
    let title = "q " + t + " \u2018" + D.display[t] + "\u2019, layer " + l + ", head " + head + ": where it looks";
    if (sink !== null) {
      el.readout.dataset.sink = fmt(sink);
      title += " (sink " + fmt(sink) + ")";
    }
    const parts = [];
    for (let s = 0; s < S; s++) parts.push(weightSpan("key", s, weight(l, head, t, s), keyDisplay[s]));
    return '<div class="readout-head">' + escapeHtml(title) + "</div><div>" + parts.join("") + "</div>";
  }

  function columnReadout(s, head) {
    const l = state.layer;
    const title = "k " + s + " \u2018" + keyDisplay[s] + "\u2019, layer " + l + ", head " + head + ": who looks at it";
    const parts = [];
    for (let t = 0; t < T; t++) parts.push(weightSpan("query", t, weight(l, head, t, s), D.display[t]));
    return '<div class="readout-head">' + escapeHtml(title) + "</div><div>" + parts.join("") + "</div>";
  }

  function layoutHead() {
    if (state.view !== "head" || !T) return;
    const first = el.queryColumn.children[0];
    const rowHeight = T > 1 ? el.queryColumn.children[1].offsetTop - first.offsetTop : first.offsetHeight;
    const keyFirst = el.keyColumn.children[0];
    const scroll = el.headScroll;
    const width = el.gap.clientWidth;
    const height = scroll.clientHeight;
    const dpr = window.devicePixelRatio || 1;
    el.headCanvas.style.left = (scroll.offsetLeft + scroll.clientLeft + el.gap.offsetLeft) + "px";
    el.headCanvas.style.top = (scroll.offsetTop + scroll.clientTop) + "px";
    el.headCanvas.style.width = width + "px";
    el.headCanvas.style.height = height + "px";
    el.headCanvas.width = Math.max(1, Math.round(width * dpr));
    el.headCanvas.height = Math.max(1, Math.round(height * dpr));
    geometry = {rowHeight: rowHeight || 18, queryTop: first.offsetTop, keyTop: keyFirst.offsetTop,
                width: width, height: height, dpr: dpr};
  }

  function scheduleHead() {
    if (frame) return;
    frame = requestAnimationFrame(function () { frame = 0; drawHead(); });
  }

  function lineY(top, index) {
    return top + index * geometry.rowHeight + geometry.rowHeight / 2 - el.headScroll.scrollTop;
  }

  function visibleQueries() {
    const first = Math.floor((el.headScroll.scrollTop - geometry.queryTop) / geometry.rowHeight) - 1;
    const last = Math.ceil((el.headScroll.scrollTop + geometry.height - geometry.queryTop) / geometry.rowHeight) + 1;
    return [Math.max(0, first), Math.min(T - 1, last)];
  }

  function collectLines(head) {
    // [t, s, w] of the lines to draw for one head
    const target = active();
    const l = state.layer;
    const lines = [];
    if (target && target.mode === "row") {
      const base = rowStart(l, head, target.index);
      for (let s = 0; s < S; s++) if (W[base + s]) lines.push([target.index, s, W[base + s] / 255]);
    } else if (target) {
      for (let t = 0; t < T; t++) {
        const b = W[rowStart(l, head, t) + target.index];
        if (b) lines.push([t, target.index, b / 255]);
      }
    } else {
      const least = T > IDLE_SMALL_LIMIT ? IDLE_MIN_LARGE : IDLE_MIN_SMALL;
      const [first, last] = visibleQueries();
      for (let t = first; t <= last; t++) {
        const base = rowStart(l, head, t);
        for (let s = 0; s < S; s++) if (W[base + s] / 255 >= least) lines.push([t, s, W[base + s] / 255]);
      }
    }
    return lines;
  }

  function strokeHead(ctx, head, lines) {
    // one path per opacity level: a few strokes per head, whatever the number of lines
    const levels = Array.from({length: ALPHA_LEVELS}, function () { return []; });
    lines.forEach(function (line) {
      levels[Math.min(ALPHA_LEVELS - 1, Math.floor(Math.sqrt(line[2]) * ALPHA_LEVELS))].push(line);
    });
    const x0 = 2, x1 = geometry.width - 2;
    ctx.strokeStyle = headColor(head);
    levels.forEach(function (group, level) {
      if (!group.length) return;
      ctx.globalAlpha = (level + 1) / ALPHA_LEVELS;
      ctx.lineWidth = 1 + 2.5 * level / ALPHA_LEVELS;
      ctx.beginPath();
      group.forEach(function (line) {
        ctx.moveTo(x0, lineY(geometry.queryTop, line[0]));
        ctx.lineTo(x1, lineY(geometry.keyTop, line[1]));
      });
      ctx.stroke();
    });
  }

  function drawHead() {
    if (state.view !== "head") return;
    if (!geometry) layoutHead();
    const ctx = el.headCanvas.getContext("2d");
    ctx.setTransform(geometry.dpr, 0, 0, geometry.dpr, 0, 0);
    ctx.clearRect(0, 0, geometry.width, geometry.height);
    ctx.lineCap = "round";
    state.heads.forEach(function (head) { strokeHead(ctx, head, collectLines(head)); });
    ctx.globalAlpha = 1;
  }

  /* ------------------------------------------------------------ model view */

  function buildModel() {
    const rows = Math.min(T, THUMB), cols = Math.min(S, THUMB);
    const cssHeight = Math.max(16, Math.min(2 * THUMB, Math.round(THUMB * T / S)));
    const grid = document.createDocumentFragment();
    for (let l = 0; l < L; l++) {
      const row = document.createElement("div");
      row.className = "layer-row";
      const heading = document.createElement("h3");
      heading.textContent = layerTitle(l);
      row.appendChild(heading);
      const thumbs = document.createElement("div");
      thumbs.className = "thumbs";
      for (let n = 0; n < N; n++) thumbs.appendChild(thumbCell(l, n, rows, cols, cssHeight));
      row.appendChild(thumbs);
      grid.appendChild(row);
    }
    el.modelGrid.appendChild(grid);
    el.modelGrid.addEventListener("click", function (event) {
      const thumb = event.target.closest("canvas.thumb");
      if (!thumb) return;
      selectLayer(Number(thumb.dataset.layer));
      selectMatrixHead(Number(thumb.dataset.head));
      showView("matrix");
    });
    observeThumbs();
  }

  function thumbCell(l, n, rows, cols, cssHeight) {
    const figure = document.createElement("figure");
    figure.className = "thumb-cell";
    const canvas = document.createElement("canvas");
    canvas.className = "thumb";
    canvas.dataset.layer = String(l);
    canvas.dataset.head = String(n);
    canvas.width = cols;
    canvas.height = rows;
    canvas.style.height = cssHeight + "px";
    canvas.title = "layer " + l + ", head " + n + kvSuffix(n) + ": open in the matrix view";
    const caption = document.createElement("figcaption");
    caption.textContent = "head " + n + kvSuffix(n);
    figure.appendChild(canvas);
    figure.appendChild(caption);
    return figure;
  }

  function drawThumb(canvas) {
    if (canvas.dataset.drawn === "1") return;
    const l = Number(canvas.dataset.layer), n = Number(canvas.dataset.head);
    const rows = canvas.height, cols = canvas.width;
    const image = canvas.getContext("2d").createImageData(cols, rows);
    const peak = new Uint8Array(cols);
    for (let i = 0; i < rows; i++) {
      peak.fill(0);
      const t1 = Math.floor((i + 1) * T / rows);
      for (let t = Math.floor(i * T / rows); t < t1; t++) {
        const base = rowStart(l, n, t);
        for (let j = 0; j < cols; j++) {
          const s1 = Math.floor((j + 1) * S / cols);
          let m = peak[j];
          for (let s = Math.floor(j * S / cols); s < s1; s++) if (W[base + s] > m) m = W[base + s];
          peak[j] = m;
        }
      }
      for (let j = 0; j < cols; j++) paint(image.data, (i * cols + j) * 4, peak[j]);
    }
    canvas.getContext("2d").putImageData(image, 0, 0);
    canvas.dataset.drawn = "1";
  }

  function paint(pixels, at, byte) {
    pixels[at] = LUT[byte * 3];
    pixels[at + 1] = LUT[byte * 3 + 1];
    pixels[at + 2] = LUT[byte * 3 + 2];
    pixels[at + 3] = 255;
  }

  function observeThumbs() {
    const thumbs = Array.from(el.modelGrid.querySelectorAll("canvas.thumb"));
    if ("IntersectionObserver" in window) {
      const observer = new IntersectionObserver(function (entries) {
        entries.forEach(function (entry) {
          if (entry.isIntersecting) { drawThumb(entry.target); observer.unobserve(entry.target); }
        });
      });
      thumbs.forEach(function (thumb) { observer.observe(thumb); });
    }
    drawThumbsWhenIdle(thumbs);
  }

  function drawThumbsWhenIdle(thumbs) {
    // the rest in the background, one per idle slot, so the model view is ready when opened
    const later = window.requestIdleCallback || function (f) { return setTimeout(f, 30); };
    let next = 0;
    function step() {
      while (next < thumbs.length && thumbs[next].dataset.drawn === "1") next++;
      if (next >= thumbs.length) return;
      drawThumb(thumbs[next]);
      later(step);
    }
    later(step);
  }

  /* ----------------------------------------------------------- matrix view */

  function matrixCell() {
    // whole pixels per cell, the map fitting the window below its top where it can (1 pixel at least)
    const top = el.matrixCanvas.getBoundingClientRect().top + window.scrollY;  // from the page's top
    const high = Math.max(MATRIX_MIN, window.innerHeight - top - 16);
    const wide = Math.max(MATRIX_MIN, el.matrixCanvas.parentNode.clientWidth || MATRIX_SIDE);
    return Math.max(1, Math.floor(Math.min(MATRIX_SIDE, high, wide) / Math.max(T, S)));
  }

  function matrixImage() {
    const key = state.layer + ":" + state.matrixHead;
    if (state.matrixKey === key && el.matrixImage) return el.matrixImage;
    const image = document.createElement("canvas");
    image.width = S;
    image.height = T;
    const ctx = image.getContext("2d");
    const data = ctx.createImageData(S, T);
    const start = rowStart(state.layer, state.matrixHead, 0);
    for (let i = 0; i < T * S; i++) paint(data.data, i * 4, W[start + i]);
    ctx.putImageData(data, 0, 0);
    el.matrixImage = image;
    state.matrixKey = key;
    return image;
  }

  function drawMatrix() {
    if (state.view !== "matrix") return;
    const cell = state.matrixCell || (state.matrixCell = matrixCell());
    const canvas = el.matrixCanvas;
    if (canvas.width !== S * cell || canvas.height !== T * cell) {
      canvas.width = S * cell;
      canvas.height = T * cell;
    }
    const ctx = canvas.getContext("2d");
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(matrixImage(), 0, 0, S * cell, T * cell);
    el.matrixTitle.textContent = layerTitle(state.layer) + " \u2014 head " + state.matrixHead +
      kvSuffix(state.matrixHead) + " (rows: queries, columns: keys)";
    if (state.matrixHover) highlight(ctx, cell, state.matrixHover);
  }

  function highlight(ctx, cell, at) {
    const band = Math.max(cell, 1);
    ctx.fillStyle = "rgba(255, 255, 255, 0.28)";
    ctx.fillRect(0, at.t * cell, S * cell, band);
    ctx.fillRect(at.s * cell, 0, band, T * cell);
    ctx.strokeStyle = "#ff2d55";
    ctx.lineWidth = 1;
    ctx.strokeRect(at.s * cell - 1.5, at.t * cell - 1.5, band + 3, band + 3);
  }

  function matrixPointer(event) {
    const rect = el.matrixCanvas.getBoundingClientRect();
    const t = Math.floor((event.clientY - rect.top) / rect.height * T);
    const s = Math.floor((event.clientX - rect.left) / rect.width * S);
    if (t < 0 || t >= T || s < 0 || s >= S) return;
    state.matrixHover = {t: t, s: s};
    writeMatrixValue(t, s);
    drawMatrix();
  }

  function writeMatrixValue(t, s) {
    const l = state.layer, n = state.matrixHead;
    const w = weight(l, n, t, s);
    const box = el.matrixValue;
    box.dataset.layer = String(l);
    box.dataset.head = String(n);
    box.dataset.query = String(t);
    box.dataset.key = String(s);
    box.dataset.value = fmt(w);
    let text = "q " + t + " '" + D.display[t] + "' -> k " + s + " '" + keyDisplay[s] + "': " + fmt(w);
    const sink = sinkWeight(l, n, t);
    if (sink !== null) {
      box.dataset.sink = fmt(sink);
      text += "  (row's sink " + fmt(sink) + ")";
    } else {
      delete box.dataset.sink;
    }
    box.textContent = text;
  }

  function refreshMatrixValue() {
    // after a change of layer or head: the cell under the pointer again, or nothing stale
    if (state.matrixHover) { writeMatrixValue(state.matrixHover.t, state.matrixHover.s); return; }
    ["layer", "head", "query", "key", "value", "sink"].forEach(function (k) { delete el.matrixValue.dataset[k]; });
    el.matrixValue.textContent = "hover the map for a weight";
  }

  function wireMatrix() {
    el.matrixCanvas.addEventListener("mousemove", matrixPointer);
    el.matrixCanvas.addEventListener("mouseleave", function () { state.matrixHover = null; drawMatrix(); });
  }

  /* ------------------------------------------------------------------ start */

  function collectElements() {
    ["layer-select", "head-select", "head-toggles", "layer-label", "query-column", "key-column",
     "head-scroll", "head-canvas", "head-gap", "readout", "model-grid", "matrix-canvas", "matrix-value",
     "matrix-title"].forEach(function (id) {
      el[id.replace(/-(\w)/g, function (_, c) { return c.toUpperCase(); })] = byId(id);
    });
    el.gap = el.headGap;
  }

  function start() {
    collectElements();
    readData();
    LUT = buildLut();
    buildControls();
    updateLayerLabel();
    buildTokens();
    buildModel();
    wireMatrix();
    layoutHead();
    refreshHead();
    window.jaxattnViewer = {ready: true, L: L, N: N, T: T, S: S};
    document.body.dataset.ready = "1";
  }

  try {
    start();
  } catch (err) {
    const box = byId("error");
    box.hidden = false;
    box.textContent = "The attention viewer could not start: " + err.message;
    document.body.dataset.ready = "error";
  }
})();
